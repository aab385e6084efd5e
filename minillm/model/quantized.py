"""A quantized model's matrices, whatever their format: quantizing one by its method's name, which
matrices of a config are stored quantized (an MoE layer's experts instead of its MLP), and `gather`,
which turns their stored tensors back into one weight each. int8/int4 live in quant.py, fp8 / NF4 /
MXFP4 in formats.py; this module is the one that knows both (so neither imports the other's users).
"""
from __future__ import annotations

import numpy as np

from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig
from minillm.model.formats import from_tensors, quantize_format
from minillm.model.moe import moe_tensor_names
from minillm.model.quant import (LAYER_MATRICES, METHODS, SUFFIXES, Int4Weight, Int8Weight, QuantizedWeight,
                                 quantize_int4, quantize_int8)


def quantize(w: np.ndarray, method: str, group_size: int = 128,
             importance: np.ndarray | None = None) -> QuantizedWeight:
    """quantize_int8, or quantize_int4 with the grid search (weighted by `importance`), by name."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size, search=True, importance=importance)
    if method in METHODS:                                  # fp8, nf4, mxfp4
        return quantize_format(w, method)
    raise MiniLLMError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")


def quantized_matrices(config: ModelConfig) -> dict[str, int]:
    """Every matrix a quantized checkpoint of `config` stores quantized -> its input width.
    ({"model.layers.0.self_attn.q_proj": dim, ...}; an MoE layer's experts instead of its MLP; only the
    experts when the entry says "experts_only".)"""
    width = {"dim": config.dim, "attn": config.n_heads * config.head_dim, "ffn": config.ffn_dim}
    experts_only = (config.quantization or {}).get("experts_only", False)   # GPT-OSS's MXFP4 release
    out = {}
    for i in range(config.n_layers):
        for part, in_kind in LAYER_MATRICES.items():
            if not (config.is_moe_layer(i) and part.startswith("mlp.")) and not experts_only:
                out[f"model.layers.{i}.{part}"] = width[in_kind]
        if config.is_moe_layer(i):
            for key, names in moe_tensor_names(config, i).items():
                if key.startswith("experts.") or key == "shared":
                    ffn = config.moe_ffn_dim * (config.n_shared_experts if key == "shared" else 1)
                    for name, in_width in zip(names, (config.dim, config.dim, ffn)):
                        out[name.removesuffix(".weight")] = in_width
    return out


def gather(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """The inverse naming: each `P.qweight`/`P.scales`(/`P.mins`) group becomes one QuantizedWeight
    under `P.weight`, wrapping the stored arrays (no copy, nothing re-quantized)."""
    if not config.quantization:
        return tensors
    method = config.quantization.get("method")
    if method not in METHODS:
        raise MiniLLMError(f"config.json: unknown quantization method {method!r}")
    out = {k: v for k, v in tensors.items() if not k.endswith(SUFFIXES)}
    for prefix, in_features in quantized_matrices(config).items():
        try:
            if method == "int8":
                w = Int8Weight(tensors[prefix + ".qweight"], tensors[prefix + ".scales"])
            elif method == "int4":
                w = Int4Weight(tensors[prefix + ".qweight"], tensors[prefix + ".scales"],
                               tensors[prefix + ".mins"], in_features)
            else:                                          # fp8, nf4, mxfp4 (formats.py)
                w = from_tensors(config.quantization, tensors, prefix, in_features)
        except KeyError as e:
            raise MiniLLMError(f"quantized checkpoint is missing tensor {e.args[0]}") from None
        out[prefix + ".weight"] = w
    return out
