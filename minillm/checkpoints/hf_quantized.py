"""Checkpoints that ship in a low-bit format (HF `quantization_config`), read as minillm's formats.

HF's fine-grained fp8 (quant_method "fp8", what DeepSeek-V3 and many "-FP8" Llama/Qwen releases use)
stores each linear layer as `P.weight` (F8_E4M3 codes, [out, in]) and `P.weight_scale_inv` (fp32, one
per tile of weight_block_size, e.g. 128 x 128): W = codes · scale_inv of its tile. That is
formats.Fp8Weight with block scales, so the tensors are renamed (`P.qweight`, `P.scales`: no copy)
and config.json's entry becomes minillm's {"method": "fp8", "kind": "e4m3", "block": [128, 128]}.

Loaded where the layout is a plain Llama / Mistral / Mixtral / Qwen2 one (every layer matrix fp8,
activations dynamic). Everything else is refused in one line: static activation scales, a partly
quantized layer, MLA (DeepSeek-V3's attention: minillm quantizes GQA layers only).

MXFP4 (quant_method "mxfp4") is GPT-OSS's release format: its experts' matrices in MXFP4, the rest
bf16. That is formats.Mxfp4Weight's layout, so config.json's entry becomes {"method": "mxfp4",
"experts_only": true} and hf_layouts.py names each expert's blocks and scales (views, as shipped).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from minillm.errors import MiniLLMError

FP8_LAYOUTS = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")
SCALE_SUFFIX = ".weight_scale_inv"


def translate_config(d: dict[str, Any]) -> dict[str, Any]:
    """config.json with an HF fp8 `quantization_config` -> the same with minillm's "quantization"
    entry; other configs unchanged (the config reader refuses what it does not know)."""
    q = d.get("quantization_config") if isinstance(d, dict) else None
    if not isinstance(q, dict):
        return d
    method, arch = q.get("quant_method"), (d.get("architectures") or ["?"])[0]
    if method == "mxfp4":
        return _gpt_oss_mxfp4(d, q, arch)
    if method != "fp8":
        return d
    if arch not in FP8_LAYOUTS:
        raise MiniLLMError(f"fp8 checkpoint of {arch}: fp8 weights load for {', '.join(FP8_LAYOUTS)} layouts only "
                           "(minillm quantizes GQA layers, not MLA)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise MiniLLMError(f"fp8 quantization_config weight_block_size={block!r}: expected [rows, cols] "
                           "(per-tensor fp8 scales are not supported)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise MiniLLMError(f"fp8 activation_scheme={q['activation_scheme']!r}: only 'dynamic' (weights-only) loads")
    kind = {"e4m3": "e4m3", "float8_e4m3fn": "e4m3", "e5m2": "e5m2"}.get(str(q.get("fmt", "e4m3")))
    if kind is None:
        raise MiniLLMError(f"fp8 fmt={q.get('fmt')!r}: expected e4m3 or e5m2")
    rest = {k: v for k, v in d.items() if k != "quantization_config"}
    return rest | {"quantization": {"method": "fp8", "kind": kind, "block": list(block)}}


def _gpt_oss_mxfp4(d: dict[str, Any], q: dict[str, Any], arch: str) -> dict[str, Any]:
    """GPT-OSS's MXFP4 release: the experts' matrices are MXFP4 blocks and scales (hf_layouts.py names them
    each expert's P.qweight / P.scales), everything else stays in bf16."""
    if arch != "GptOssForCausalLM":
        raise MiniLLMError(f"quantization_config quant_method 'mxfp4' on {arch}: minillm reads MXFP4 checkpoints "
                           "of GptOssForCausalLM (the experts quantized); its own mxfp4 is `minillm convert --quant mxfp4`")
    kept = q.get("modules_to_not_convert") or []
    if not isinstance(kept, list) or any(isinstance(m, str) and ".experts" in m for m in kept):
        raise MiniLLMError(f"mxfp4 modules_to_not_convert={str(kept)[:120]}: minillm reads checkpoints whose "
                           "experts are all MXFP4 (and nothing else is)")
    rest = {k: v for k, v in d.items() if k != "quantization_config"}
    return rest | {"quantization": {"method": "mxfp4", "experts_only": True}}


def translate_tensors(tensors: dict[str, np.ndarray], layer_matrices) -> dict[str, np.ndarray]:
    """`P.weight` + `P.weight_scale_inv` -> `P.qweight` + `P.scales` (the same arrays). Untouched when
    nothing carries a scale. `layer_matrices`: the prefixes that must all be fp8 (quantized.quantized_matrices)."""
    scaled = {name.removesuffix(SCALE_SUFFIX) for name in tensors if name.endswith(SCALE_SUFFIX)}
    if not scaled:
        return tensors
    missing = sorted(set(layer_matrices) - scaled)
    if missing:
        raise MiniLLMError(f"fp8 checkpoint: {missing[0]} is not fp8 ({len(missing)} layer matrices are not); "
                           "checkpoints mixing fp8 and float layer matrices are not supported")
    out = {}
    for name, a in tensors.items():
        prefix = name.removesuffix(".weight").removesuffix(SCALE_SUFFIX)
        if prefix in scaled and name.endswith(".weight"):
            out[prefix + ".qweight"] = a                                   # fp8 codes (raw bytes)
        elif name.endswith(SCALE_SUFFIX):
            out[prefix + ".scales"] = a.astype(np.float32, copy=False)     # [out / bo, in / bi]
        else:
            out[name] = a
    return out
