"""The tensors a config implies: HF name -> shape, for checking any checkpoint before it is used."""
from __future__ import annotations

import re
from typing import Iterable

from minillm.model.config import ModelConfig
from minillm.model.moe import moe_matrix_shapes
from minillm.model.transformer import bias_names


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"model\.layers\.\d+\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.")


def numbered(names: Iterable[str], pattern: re.Pattern) -> set[int]:
    """The indices `pattern`'s group finds in the names (layers in `model.layers.N.`, ...)."""
    return {int(m.group(1)) for name in names if (m := pattern.match(name))}


def count_mismatch(declared: int, present: set[int], what: str) -> str | None:
    """Why `declared` (a count from a config) is not the `present` indices 0..declared-1, or None.

    Checked before anything is built per layer or per expert: a config claiming 2^31 layers is
    refuted by the tensors at once, not after 2^31 layers' worth of names."""
    if len(present) != declared:
        return f"the tensors hold {len(present)} {what}s"
    if present and max(present) != declared - 1:           # as many, but numbered past the end
        first_gap = min(set(range(declared)) - present)
        return f"the tensors number {what}s up to {max(present)} but have no {what} {first_gap}"
    return None


def hf_count_mismatch(c: ModelConfig, names: Iterable[str]) -> str | None:
    """Whether the layers and experts HF tensor names number are the config's, naming the field if not."""
    names = list(names)
    layers = count_mismatch(c.n_layers, numbered(names, _LAYER), "layer")
    if layers:
        return f"num_hidden_layers={c.n_layers} in config.json, but {layers}"
    experts = count_mismatch(c.n_experts, numbered(names, _EXPERT), "expert") if c.n_moe_layers else None
    if experts:
        field = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts",
                 "gpt_oss": "num_local_experts"}.get(c.family, "n_routed_experts")
        return f"{field}={c.n_experts} in config.json, but {experts}"
    return None


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every float tensor a model of this config has ([out, in] for matrices):
    biases, MLA attention and MoE blocks included."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.dim), "model.norm.weight": (c.dim,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.dim)
    attention = _mla_shapes(c) if c.attention == "mla" else {
        "self_attn.q_proj": (q, c.dim), "self_attn.k_proj": (kv, c.dim), "self_attn.v_proj": (kv, c.dim),
        "self_attn.o_proj": (c.dim, q)}
    dense = {"mlp.gate_proj": (c.ffn_dim, c.dim), "mlp.up_proj": (c.ffn_dim, c.dim), "mlp.down_proj": (c.dim, c.ffn_dim)}
    norms = {"input_layernorm": (c.dim,), "post_attention_layernorm": (c.dim,)}
    if c.sandwich_norms:                                    # Gemma: a norm before and after attention and the MLP
        norms |= {"pre_feedforward_layernorm": (c.dim,), "post_feedforward_layernorm": (c.dim,)}
    if c.qk_norm:                                           # Qwen3, Gemma 3: one gain per head dimension
        norms |= {"self_attn.q_norm": (c.head_dim,), "self_attn.k_norm": (c.head_dim,)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        mlp = {} if c.is_moe_layer(i) else dense
        shapes |= {f"{p}{part}.weight": shape for part, shape in (attention | mlp | norms).items()}
        shapes |= {name: (shapes[name.removesuffix(".bias") + ".weight"][0],) for name in bias_names(c, i).values()}
        if c.attention_sinks:                                   # GPT-OSS: one learned logit per query head
            shapes[p + "self_attn.sinks"] = (c.n_heads,)
        if c.is_moe_layer(i):
            shapes |= moe_matrix_shapes(c, i)
    return shapes


def _mla_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One MLA layer's attention tensors (mla.py): low-rank or plain queries, the latent KV path, o."""
    qk = c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    q = ({"self_attn.q_a_proj": (c.q_lora_rank, c.dim), "self_attn.q_a_layernorm": (c.q_lora_rank,),
          "self_attn.q_b_proj": (qk, c.q_lora_rank)} if c.q_lora_rank else {"self_attn.q_proj": (qk, c.dim)})
    return q | {"self_attn.kv_a_proj_with_mqa": (c.kv_lora_rank + c.qk_rope_head_dim, c.dim),
                "self_attn.kv_a_layernorm": (c.kv_lora_rank,),
                "self_attn.kv_b_proj": (c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                "self_attn.o_proj": (c.dim, c.n_heads * c.v_head_dim)}
