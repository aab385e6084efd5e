"""GPT-OSS in GGUF (llama.cpp's "gpt-oss"): its metadata, its tensor names, and its experts kept in MXFP4.

llama.cpp's converter writes the experts stacked, `blk.N.ffn_{gate,up,down}_exps.weight` [E, out, in] in ggml's
MXFP4 blocks, with biases `..._exps.bias` [E, out], the router `blk.N.ffn_gate_inp.{weight,bias}`, the sinks
`blk.N.attn_sinks.weight` [heads] and q/k/v/o biases. What the file does not say, llama.cpp fixes in code and
so does this: the windowed layers are the even ones (0, 2, ...), the SwiGLU clamp is 7.0 (alpha 1.702), and
YaRN's correction range is rounded to whole dimensions (HF's truncate=True).

A ggml MXFP4 block of 32 weights is 17 bytes: one E8M0 scale byte, then 16 bytes whose low nibbles are weights
0-15 and high nibbles weights 16-31, each an E2M1 code (ggml multiplies the codes' doubled values by half the
scale: the same products). formats.Mxfp4Weight holds the same codes and scale bytes, weight 2j in a byte's low
nibble and 2j+1 in its high one: only the nibbles move, bit-exact.
"""
from __future__ import annotations

import re

import numpy as np

from minillm.model.config import ModelConfig
from minillm.model.formats import MX_BLOCK, Mxfp4Weight
from minillm.model.quant import pack_int4

_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
          "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SWIGLU_LIMIT = 7.0      # llama.cpp's constant for gpt-oss (the GGUF has no key for it), HF's default too
GGML_BLOCK_BYTES = 1 + MX_BLOCK // 2


def gpt_oss_config(get, names: set, vocab: int, meta) -> ModelConfig:
    """A gpt-oss GGUF's config (`get(key)` reads `gpt-oss.<key>`, `meta(key)` any key)."""
    n_layers, dim, n_heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    scaling = None
    if get("rope.scaling.type") == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                   "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                   "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length"), "truncate": True}
    elif get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"gpt-oss.rope.scaling.type={get('rope.scaling.type')!r} is not implemented (only yarn)")
    window = get("attention.sliding_window")
    windows = tuple(window if i % 2 == 0 else None for i in range(n_layers))
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads), ffn_dim=get("feed_forward_length"),
        head_dim=get("attention.key_length") or dim // n_heads,
        norm_eps=float(str(np.float32(get("attention.layer_norm_rms_epsilon", 1e-5)))),
        rope_theta=float(get("rope.freq_base", 150000.0)), rope_scaling=scaling,
        max_seq_len=get("context_length", 4096), tie_embeddings="output.weight" not in names, family="gpt_oss",
        qkv_bias=True, o_bias=True, attention_sinks=True, moe_bias=True, n_experts=get("expert_count"),
        n_experts_per_token=get("expert_used_count"), moe_ffn_dim=get("expert_feed_forward_length"),
        router="softmax", norm_topk_prob=True, swiglu_limit=SWIGLU_LIMIT,
        layer_windows=windows if len(set(windows)) > 1 else None,
        sliding_window=windows[0] if len(set(windows)) == 1 else None,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"), eos_token_id=meta("tokenizer.ggml.eos_token_id"))


def is_gpt_oss_tensor(gguf_name: str) -> bool:
    """A layer tensor of gpt-oss (global ones, token_embd/output_norm/output, are named as for every architecture)."""
    m = _TENSOR.fullmatch(gguf_name)
    return m is not None and (m.group(2) in _LAYER or m.group(2) in _EXPERTS or m.group(2) == "attn_sinks")


def gpt_oss_pieces(gguf_name: str, w, config: ModelConfig) -> dict:
    """One gpt-oss layer tensor -> {HF name: tensor}; a stack of experts (an array [E, ...] or a list of
    E weights) splits into one per expert."""
    layer, part, kind = _TENSOR.fullmatch(gguf_name).groups()
    prefix = f"model.layers.{layer}."
    if part == "attn_sinks":
        return {prefix + "self_attn.sinks": w}                                    # [heads]
    if part in _LAYER:
        return {f"{prefix}{_LAYER[part]}.{kind}": w}
    return {f"{prefix}mlp.experts.{e}.{_EXPERTS[part]}.{kind}": w[e] for e in range(config.n_experts)}


def mxfp4_experts(data: np.ndarray) -> list[Mxfp4Weight]:
    """ggml MXFP4 bytes of a stack of experts [E, out, in / 32 * 17] -> one Mxfp4Weight per expert (module docstring)."""
    n_experts, out_dim, row_bytes = data.shape
    blocks = np.asarray(data).reshape(n_experts, out_dim, row_bytes // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[..., 0])                          # [E, out, in / 32]: E8M0 bytes
    nibbles = blocks[..., 1:]                                              # [E, out, in / 32, 16]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)          # [E, out, in / 32, 32]: weight order
    in_features = codes.shape[2] * MX_BLOCK
    return [Mxfp4Weight(pack_int4(codes[e].reshape(out_dim, in_features)), scales[e], in_features)
            for e in range(n_experts)]
