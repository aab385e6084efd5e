"""Mixtral in GGUF: llama.cpp writes it as architecture "llama" with `llama.expert_count` and
`llama.expert_used_count`, a router `blk.N.ffn_gate_inp.weight` [E, dim], and the experts either
stacked, `blk.N.ffn_{gate,up,down}_exps.weight` [E, out, in] (current converters), or one tensor each,
`blk.N.ffn_{gate,up,down}.E.weight` (older files). Both become Mixtral's HF names
(`model.layers.N.block_sparse_moe.experts.E.w1/w3/w2.weight`, `...block_sparse_moe.gate.weight`).

HF transformers' own GGUF loader maps no expert keys for "llama" (and has no "mixtral" entry), so
it cannot serve as the reference here: tests/test_moe_gguf.py writes a GGUF from a random HF Mixtral
with gguf's writer, in llama.cpp's layout, and checks this reader gives back HF's logits.
"""
from __future__ import annotations

import re

import numpy as np

_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_SPLIT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_HF_PART = {"gate": "w1", "up": "w3", "down": "w2"}        # Mixtral's names for SwiGLU's three matrices


def moe_fields(get) -> dict:
    """ModelConfig fields of a Mixtral GGUF (`get(key)` reads `llama.<key>`); {} for a dense model."""
    n_experts = get("expert_count")
    if not n_experts:
        return {}
    return dict(n_experts=int(n_experts), n_experts_per_token=int(get("expert_used_count") or 2),
                moe_ffn_dim=int(get("feed_forward_length")), router="softmax", norm_topk_prob=True)


def is_moe_tensor(gguf_name: str) -> bool:
    return any(p.fullmatch(gguf_name) for p in (_STACKED, _SPLIT, _ROUTER))


def moe_hf_tensors(gguf_name: str, w: np.ndarray, config=None) -> dict[str, np.ndarray]:
    """One dequantized MoE tensor -> {HF name: [out, in] array}: a stacked one splits into E experts.
    Mixtral's names, or Qwen3-MoE's (`mlp.gate`, `mlp.experts.E.gate_proj`, ...) when `config` is one."""
    prefix, parts = "model.layers.{}.block_sparse_moe.", _HF_PART
    if config is not None and config.family == "qwen3_moe":
        prefix, parts = "model.layers.{}.mlp.", {p: f"{p}_proj" for p in _HF_PART}
    if m := _ROUTER.fullmatch(gguf_name):
        return {prefix.format(m.group(1)) + "gate.weight": w}                     # [E, dim]
    if m := _SPLIT.fullmatch(gguf_name):
        layer, part, e = m.groups()
        return {prefix.format(layer) + f"experts.{e}.{parts[part]}.weight": w}
    m = _STACKED.fullmatch(gguf_name)
    layer, part = m.groups()
    return {prefix.format(layer) + f"experts.{e}.{parts[part]}.weight": w[e] for e in range(w.shape[0])}
