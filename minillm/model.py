"""The Transformer: a Llama-family forward pass over a KV cache, readable top to bottom.

`prefill(tokens, cache)` runs the whole prompt at once (big matrix-matrix products: compute-bound);
`decode(token, cache)` runs one new position (matrix-vector products: memory-bound). Both are the
same `forward`, over a different number of new positions.

Attention comes in two kinds, picked once from `config.attention`: "gqa" (`attention_block`, the
Llama path) and "mla" (`mla_block`, DeepSeek's latent attention in mla.py, with its own cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attention import grouped_attention
from .backend import as_f32
from .config import ModelConfig
from .kv_cache import Int8KVCache, KVCache, MLACache, RollingKVCache
from .layers import apply_rope, linear, rmsnorm, rope_inv_freq, rope_tables, swiglu
from .mla import MLAWeights, mla_attention, mla_rope
from .quant import gather


@dataclass
class LayerWeights:
    """One transformer block, in HF's [out, in] layout, stored in any dtype backend.as_f32 widens.

    MLA layers leave wq, wk, wv, wo as None and keep their attention weights in `mla`.
    """
    attn_norm: np.ndarray   # [dim]
    wq: np.ndarray | None   # [n_heads * hd, dim]
    wk: np.ndarray | None   # [n_kv_heads * hd, dim]
    wv: np.ndarray | None   # [n_kv_heads * hd, dim]
    wo: np.ndarray | None   # [dim, n_heads * hd]
    mlp_norm: np.ndarray    # [dim]
    w_gate: np.ndarray      # [ffn_dim, dim]
    w_up: np.ndarray        # [ffn_dim, dim]
    w_down: np.ndarray      # [dim, ffn_dim]
    mla: MLAWeights | None = None

    @classmethod
    def from_hf(cls, tensors: dict[str, np.ndarray], i: int, attention: str = "gqa") -> "LayerWeights":
        p = f"model.layers.{i}."
        if attention == "mla":
            attn = dict(wq=None, wk=None, wv=None, wo=None, mla=MLAWeights.from_hf(tensors, i))
        else:
            attn = dict(wq=tensors[p + "self_attn.q_proj.weight"], wk=tensors[p + "self_attn.k_proj.weight"],
                        wv=tensors[p + "self_attn.v_proj.weight"], wo=tensors[p + "self_attn.o_proj.weight"])
        return cls(
            attn_norm=tensors[p + "input_layernorm.weight"],
            **attn,
            mlp_norm=tensors[p + "post_attention_layernorm.weight"],
            w_gate=tensors[p + "mlp.gate_proj.weight"],
            w_up=tensors[p + "mlp.up_proj.weight"],
            w_down=tensors[p + "mlp.down_proj.weight"],
        )


class Transformer:
    # Prompts longer than this run through the model in chunks, so attention scores stay
    # [heads, chunk, L] instead of [heads, L, L] (8k tokens would need gigabytes otherwise).
    prefill_chunk = 512
    # MLA only: "absorbed" (attend in latent space) or "naive" (expand K and V per head); same numbers.
    mla_mode = "absorbed"
    # "float32" or "int8" (Int8KVCache: a quarter of the bytes; GQA models only).
    kv_cache_dtype = "float32"

    def __init__(self, config: ModelConfig, tensors: dict[str, np.ndarray]):
        self.config = config
        tensors = gather(config, tensors)                                   # quantized: qweight/scales -> one weight
        self.embed = tensors["model.embed_tokens.weight"]                   # [vocab, dim]
        self.layers = [LayerWeights.from_hf(tensors, i, config.attention) for i in range(config.n_layers)]
        self.final_norm = tensors["model.norm.weight"]                      # [dim]
        self.lm_head = tensors.get("lm_head.weight", self.embed)            # [vocab, dim] (tied: the embedding)
        if config.tie_embeddings:
            self.lm_head = self.embed
        self.rope_gain = 1.0                                                # YaRN scales cos and sin
        if config.attention == "mla":
            self.inv_freq, self.rope_gain = mla_rope(config)
            self.attend = self.mla_block
        else:
            self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
            self.attend = self.attention_block

    def new_cache(self, max_seq_len: int | None = None) -> KVCache | RollingKVCache | MLACache | Int8KVCache:
        """A cache for up to `max_seq_len` positions (default: the model's context). With a sliding
        window shorter than that, a rolling buffer of the window's size is all that is needed.
        kv_cache_dtype "int8" always gives a contiguous Int8KVCache (the window is then a mask)."""
        cfg = self.config
        n = max_seq_len or cfg.max_seq_len
        if cfg.attention == "mla":
            return MLACache(cfg, n)
        if self.kv_cache_dtype == "int8":
            return Int8KVCache(cfg, n)
        if cfg.sliding_window is not None and n > cfg.sliding_window:
            return RollingKVCache(cfg, cfg.sliding_window)
        return KVCache(cfg, n)

    # ---- the two phases ----------------------------------------------------------------------
    def prefill(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run the prompt, filling the cache.  -> logits [T, vocab] if all_logits else [vocab]"""
        tokens = np.asarray(tokens, dtype=np.int64)
        outputs = []
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start:start + self.prefill_chunk]
            is_last = start + self.prefill_chunk >= len(tokens)
            if all_logits or is_last:
                outputs.append(self.forward(chunk, cache, last_only=not all_logits))
            else:
                self.forward(chunk, cache, skip_head=True)
        return np.concatenate(outputs) if all_logits else outputs[-1][-1]

    def decode(self, token: int, cache: KVCache) -> np.ndarray:
        """Run one new position against the cache.  -> logits [vocab]"""
        return self.forward(np.array([token], dtype=np.int64), cache)[0]

    # ---- the forward pass ----------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, cache: KVCache, last_only: bool = False,
                skip_head: bool = False) -> np.ndarray | None:
        """tokens: [T] new positions, appended after the cache's `length` ones.  -> logits [T or 1, vocab]"""
        cfg = self.config
        positions = np.arange(cache.length, cache.length + len(tokens))
        cos, sin = rope_tables(positions, self.inv_freq)                    # [T, hd/2] each
        if self.rope_gain != 1.0:
            cos, sin = cos * self.rope_gain, sin * self.rope_gain
        x = as_f32(self.embed[tokens])                                      # [T, dim]
        for i, layer in enumerate(self.layers):
            x = x + self.attend(x, layer, i, cache, cos, sin)
            x = x + swiglu(rmsnorm(x, layer.mlp_norm, cfg.norm_eps), layer.w_gate, layer.w_up, layer.w_down)
        cache.advance(len(tokens))
        if skip_head:
            return None
        if last_only:
            x = x[-1:]                                                      # only the next token's logits are needed
        return linear(rmsnorm(x, self.final_norm, cfg.norm_eps), self.lm_head)   # [T, vocab]

    def attention_block(self, x, layer: LayerWeights, i: int, cache: KVCache, cos, sin) -> np.ndarray:
        cfg = self.config
        T, hd = x.shape[0], cfg.head_dim
        h = rmsnorm(x, layer.attn_norm, cfg.norm_eps)                       # [T, dim]
        q = linear(h, layer.wq).reshape(T, cfg.n_heads, hd)                 # [T, n_heads, hd]
        k = linear(h, layer.wk).reshape(T, cfg.n_kv_heads, hd)              # [T, n_kv_heads, hd]
        v = linear(h, layer.wv).reshape(T, cfg.n_kv_heads, hd)              # [T, n_kv_heads, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.append(i, k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # [n_kv, L, hd] each
        out = grouped_attention(q, keys, values, cfg.sliding_window)        # [T, n_heads * hd]
        return linear(out, layer.wo)                                        # [T, dim]

    def mla_block(self, x, layer: LayerWeights, i: int, cache: MLACache, cos, sin) -> np.ndarray:
        h = rmsnorm(x, layer.attn_norm, self.config.norm_eps)               # [T, dim]
        return mla_attention(h, layer.mla, i, cache, cos, sin, self.config, self.mla_mode)   # [T, dim]
