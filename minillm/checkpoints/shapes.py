"""The tensors a config implies: HF name -> shape, for checking any checkpoint before it is used."""
from __future__ import annotations

from minillm.model.config import ModelConfig
from minillm.model.moe import moe_matrix_shapes
from minillm.model.transformer import bias_names


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
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        mlp = {} if c.is_moe_layer(i) else dense
        shapes |= {f"{p}{part}.weight": shape for part, shape in (attention | mlp | norms).items()}
        shapes |= {name: (shapes[name.removesuffix(".bias") + ".weight"][0],) for name in bias_names(c, i).values()}
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
