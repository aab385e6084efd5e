"""HF checkpoints that hold minillm's tensors under other names and shapes, renamed at load as views.

Nothing here copies a weight: every tensor returned is a slice (a view) of the memory-mapped file, so
a model loads in the bytes it ships in. The model code then sees the Llama layout it already runs.

Phi-3 / Phi-4-mini fuse two groups of projections:
    self_attn.qkv_proj   [(H + 2 KV) · hd, dim]   rows: q's, then k's, then v's
    mlp.gate_up_proj     [2 · ffn, dim]           rows: gate's, then up's
They are split into q/k/v_proj and gate/up_proj row blocks. The CPU model stacks them again
(LayerWeights.fuse, as for every Llama: one matmul instead of three), so splitting costs nothing there,
and everything that works per matrix (quantizing, tensor-parallel shards, shape checks) works unchanged.

GPT-OSS stacks its E experts in one tensor per kind, in [in, out] order, gate and up interleaved:
    mlp.experts.gate_up_proj       [E, dim, 2 · ffn]   column 2j is gate unit j, column 2j + 1 up unit j
    mlp.experts.gate_up_proj_bias  [E, 2 · ffn]        same interleaving
    mlp.experts.down_proj          [E, ffn, dim]
    mlp.experts.down_proj_bias     [E, dim]
Each expert becomes `mlp.experts.{e}.{gate,up,down}_proj.weight` [out, in] (a transposed, strided view)
and `.bias`. The release ships the expert matrices in MXFP4 (config.json's quantization_config,
quant_method "mxfp4") instead, in [out, in] order:
    mlp.experts.gate_up_proj_blocks  uint8 [E, 2 · ffn, dim / 32, 16]   two E2M1 codes a byte, low nibble first
    mlp.experts.gate_up_proj_scales  uint8 [E, 2 · ffn, dim / 32]       E8M0: the block's scale is 2^(byte - 127)
    (down_proj_blocks [E, dim, ffn / 32, 16], down_proj_scales [E, dim, ffn / 32])
which is formats.Mxfp4Weight's layout exactly: each expert's rows become `P.qweight` [out, in / 2] and
`P.scales` [out, in / 32], and minillm computes with the 4-bit codes (hf_quantized.translate_config
makes config.json say {"method": "mxfp4", "experts_only": true}).
"""
from __future__ import annotations

import re

import numpy as np

from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig

_PHI3_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")
_GPT_OSS_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def split_fused(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Phi-3's fused and GPT-OSS's stacked tensors renamed as minillm's per-matrix ones (views); other
    checkpoints unchanged."""
    if config.family == "phi3":
        return _split_phi3(config, tensors)
    if config.family == "gpt_oss":
        return _unstack_gpt_oss(config, tensors)
    return tensors


def _split_phi3(c: ModelConfig, tensors: dict) -> dict:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = {}
    for name, a in tensors.items():
        m = _PHI3_FUSED.fullmatch(name)
        if m is None:
            out[name] = a
            continue
        prefix, kind = m.groups()
        parts = {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
                 "mlp.gate_up_proj": (("mlp.gate_proj", c.ffn_dim), ("mlp.up_proj", c.ffn_dim))}[kind]
        rows = sum(n for _, n in parts)
        if a.ndim != 2 or a.shape[0] != rows:          # (its width is checked with the parts: a GGUF's may be bytes)
            raise MiniLLMError(f"tensor {name} has shape {tuple(a.shape)}, config.json implies {rows} rows")
        start = 0
        for part, n in parts:
            out[f"{prefix}{part}.weight"] = a[start:start + n]                  # [n, dim] rows: a view
            start += n
    return out


def _unstack_gpt_oss(c: ModelConfig, tensors: dict) -> dict:
    out = {}
    for name, a in tensors.items():
        m = _GPT_OSS_STACKED.fullmatch(name)
        if m is None:
            out[name] = a
            continue
        prefix, kind, suffix = m.groups()
        suffix = suffix or ""
        if suffix == "_scales":
            continue                                                            # read with its _blocks
        width_in, width_out = (c.dim, 2 * c.moe_ffn_dim) if kind == "gate_up_proj" else (c.moe_ffn_dim, c.dim)
        expected = {"": (c.n_experts, width_in, width_out), "_bias": (c.n_experts, width_out),
                    "_blocks": (c.n_experts, width_out, width_in // 32, 16)}[suffix]
        if tuple(a.shape) != expected or (suffix == "_blocks" and width_in % 32):
            raise MiniLLMError(f"tensor {name} has shape {tuple(a.shape)}, config.json implies {expected}")
        if suffix == "_blocks":
            scales = tensors.get(f"{prefix}{kind}_scales")
            if scales is None or tuple(scales.shape) != expected[:3]:
                raise MiniLLMError(f"tensor {prefix}{kind}_scales: missing or not of shape {expected[:3]}")
        for e in range(c.n_experts):
            for part, rows in _expert_rows(kind):
                p = f"{prefix}{e}.{part}"
                if suffix == "":
                    out[p + ".weight"] = a[e][:, rows].T                        # [out, in]: a transposed view
                elif suffix == "_bias":
                    out[p + ".bias"] = a[e][rows]                               # [out]
                else:
                    out[p + ".qweight"] = a[e][rows].reshape(-1, width_in // 2)  # [out, in / 2]: the codes
                    out[p + ".scales"] = scales[e][rows]                          # [out, in / 32]
    return out


def _expert_rows(kind: str) -> list[tuple[str, slice]]:
    """Which output units of a stacked kind each expert matrix is: gate and up interleave (2j, 2j + 1)."""
    if kind == "gate_up_proj":
        return [("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))]
    return [("down_proj", slice(None))]


def pack_gpt_oss_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse for MXFP4: every stacked float `mlp.experts.{gate_up,down}_proj` [E, in, out] becomes
    `_blocks` [E, out, in / 32, 16] and `_scales` [E, out, in / 32] as GPT-OSS ships them (each expert
    quantized by formats.quantize_mxfp4); everything else unchanged. For tests and lesson 23."""
    from minillm.backend import as_f32
    from minillm.model.formats import quantize_mxfp4
    out = {}
    for name, a in tensors.items():
        m = _GPT_OSS_STACKED.fullmatch(name)
        if m is None or m.group(3):
            out[name] = a
            continue
        experts = [quantize_mxfp4(np.ascontiguousarray(as_f32(w).T)) for w in a]      # each [out, in]
        out[name + "_blocks"] = np.stack([q.qweight.reshape(len(q.qweight), -1, 16) for q in experts])
        out[name + "_scales"] = np.stack([q.scales for q in experts])
    return out
