"""Multi-head latent attention (MLA, DeepSeek-V2/V3): a KV cache of one small latent per token.

GQA shrinks the cache by sharing K and V between heads. MLA shrinks it further by caching neither:
each token stores only

    c_KV   = RMSNorm(W_DKV · x)                 [kv_lora_rank]       a joint latent for K and V
    k_rope = RoPE(W_KR · x)                      [qk_rope_head_dim]   one RoPE key shared by all heads

and every head's key and value are linear images of the latent: k_nope_h = W_UK_h · c_KV,
v_h = W_UV_h · c_KV. RoPE cannot pass through those up-projections (the rotation depends on the
position), so the positional part of the key is "decoupled": a separate, small, shared head. A query
head is [q_nope_h, q_rope_h] and scores both parts:  q_nope_h · k_nope_h + q_rope_h · k_rope.

Two ways to compute the same numbers (mode "naive-prefill" takes naive for a prefill of T > 1 queries,
where the expanded keys serve all T rows for about half the flops, and absorbed at decode, as
DeepSeek's own inference does; the GPU runs MLA that way):
  naive     expand K_nope and V for every head from the cached latents at every step, then ordinary
            multi-head attention. Working set: n_heads × L × (qk_nope + v_head) per layer.
  absorbed  q_nope_h · (W_UK_h c) = (W_UK_hᵀ q_nope_h) · c: fold W_UK into the query, so each head
            scores directly against c_KV; and Σ p·(W_UV_h c) = W_UV_h (Σ p·c): attend over c_KV, then
            apply W_UV (and o_proj). All heads then read one shared [L, kv_lora_rank + rope] cache,
            like MQA. Working set: L × (kv_lora_rank + qk_rope_head_dim) per layer.

HF layout (DeepseekV3): q_proj or q_a_proj -> q_a_layernorm -> q_b_proj gives [H, qk_nope + qk_rope]
per token; kv_a_proj_with_mqa stacks W_DKV over W_KR; kv_b_proj stacks, per head, W_UK over W_UV.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.model.attention import mask_bias
from minillm.backend import array_module, as_f32
from minillm.model.config import ModelConfig
from minillm.model.layers import apply_rope, linear, rmsnorm, rope_inv_freq, yarn_inv_freq, yarn_mscale

# DeepSeek builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAWeights:
    """One layer's MLA projections, HF [out, in] layout. Either wq, or wq_a + q_norm + wq_b."""
    wq: np.ndarray | None        # [H * (nope + rope), dim]        q_proj (q_lora_rank is None)
    wq_a: np.ndarray | None      # [q_lora_rank, dim]              q_a_proj
    q_norm: np.ndarray | None    # [q_lora_rank]                   q_a_layernorm
    wq_b: np.ndarray | None      # [H * (nope + rope), q_lora_rank] q_b_proj
    wkv_a: np.ndarray            # [kv_lora_rank + rope, dim]      W_DKV over W_KR
    kv_norm: np.ndarray | None   # [kv_lora_rank]                  None: a linear latent (mla_convert)
    wkv_b: np.ndarray            # [H * (nope + v_head), kv_lora_rank]  per head: W_UK over W_UV
    wo: np.ndarray               # [dim, H * v_head]

    @classmethod
    def from_hf(cls, tensors: dict[str, np.ndarray], i: int) -> "MLAWeights":
        p = f"model.layers.{i}.self_attn."
        return cls(wq=tensors.get(p + "q_proj.weight"), wq_a=tensors.get(p + "q_a_proj.weight"),
                   q_norm=tensors.get(p + "q_a_layernorm.weight"), wq_b=tensors.get(p + "q_b_proj.weight"),
                   wkv_a=tensors[p + "kv_a_proj_with_mqa.weight"],
                   kv_norm=tensors.get(p + "kv_a_layernorm.weight"),
                   wkv_b=tensors[p + "kv_b_proj.weight"], wo=tensors[p + "o_proj.weight"])


# ---- RoPE and the softmax scale ----------------------------------------------------------------

def mla_rope(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [rope/2], gain on cos and sin) for the qk_rope_head_dim rotary dims.

    YaRN (DeepSeek-V3's long-context scaling) also scales cos and sin by its attention factor.
    """
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "yarn":
        return yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, s, cfg.max_seq_len)
    if kind == "repeat":   # mla_convert: each source frequency serves `repeat` latent key heads
        base = rope_inv_freq(s["head_dim"], cfg.rope_theta, s.get("base"))          # [hd/2]
        return np.repeat(base, s["repeat"]), 1.0                                   # [hd/2 * repeat]
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling), 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """1/√(qk_nope + qk_rope), times YaRN's mscale² when the config asks for mscale_all_dim."""
    scale = cfg.head_dim ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("mscale_all_dim") and s.get("rope_type", s.get("type", "default")) != "default":
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


def rope_part(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """RoPE on the rotary dims.  x: [T, heads, rope]

    DeepSeek's pairs are adjacent dims (x0, x1), (x2, x3), ...: gather evens then odds, and HF's
    half-split rotation applies (the output stays in that order, for queries and keys alike).
    """
    if interleave:
        x = array_module(x).concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)   # [T, heads, rope]
    return apply_rope(x, cos, sin)


# ---- the attention layer -----------------------------------------------------------------------

def mla_attention(h: np.ndarray, w: MLAWeights, layer: int, cache, cos, sin, cfg: ModelConfig,
                  mode: str = "absorbed") -> np.ndarray:
    """Latent attention of the new positions against the cache.  h: [T, dim] (normed) -> [T, dim]"""
    T, H = h.shape[0], cfg.n_heads
    nope, rope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    # Queries: one projection, or a low-rank pair with a norm between.
    if w.wq is not None:
        q = linear(h, w.wq)                                                 # [T, H * (nope + rope)]
    else:
        q = linear(rmsnorm(linear(h, w.wq_a), w.q_norm, LATENT_NORM_EPS), w.wq_b)
    q = q.reshape(T, H, nope + rope)                                        # [T, H, nope + rope]
    q_nope = q[..., :nope].transpose(1, 0, 2)                               # [H, T, nope]
    q_rope = rope_part(q[..., nope:], cos, sin, cfg.rope_interleave).transpose(1, 0, 2)  # [H, T, rope]
    # What the cache keeps: the latent and the shared RoPE key.
    kv = linear(h, w.wkv_a)                                                 # [T, r + rope]
    c_kv = kv[:, :r] if w.kv_norm is None else rmsnorm(kv[:, :r], w.kv_norm, LATENT_NORM_EPS)  # [T, r]
    k_rope = rope_part(kv[:, None, r:], cos, sin, cfg.rope_interleave)[:, 0]                  # [T, rope]
    c_kv, k_rope = (as_f32(a) for a in cache.append(layer, c_kv, k_rope))   # [L, r], [L, rope] (a 16-bit cache widened)
    # kv_b_proj holds, per head, W_UK ([nope, r]) over W_UV ([v_head, r]).
    w_up = as_f32(w.wkv_b).reshape(H, nope + cfg.v_head_dim, r)             # [H, nope + v_head, r]
    w_uk, w_uv = w_up[:, :nope], w_up[:, nope:]                             # [H, nope, r], [H, v_head, r]
    naive = mode == "naive" or (mode == "naive-prefill" and T > 1)
    attend = naive_attention if naive else absorbed_attention
    out = attend(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, softmax_scale(cfg))   # [H, T, v_head]
    return linear(out.transpose(1, 0, 2).reshape(T, H * cfg.v_head_dim), w.wo)  # [T, dim]


def naive_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale: float) -> np.ndarray:
    """Expand every head's keys and values from the latent, then multi-head attention.

    q_nope: [H, T, nope]  q_rope: [H, T, rope]  c_kv: [L, r]  k_rope: [L, rope]  -> [H, T, v_head]
    """
    k_nope = c_kv @ w_uk.transpose(0, 2, 1)                                 # [H, L, nope]  rebuilt each step
    values = c_kv @ w_uv.transpose(0, 2, 1)                                 # [H, L, v_head]
    scores = q_nope @ k_nope.transpose(0, 2, 1) + q_rope @ k_rope.T         # [H, T, L]
    return _softmax(scores * scale) @ values                                # [H, T, v_head]


def absorbed_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale: float) -> np.ndarray:
    """Score and attend in latent space: W_UK moves to the query, W_UV after the weighted sum.

    Same shapes as naive_attention. All H heads share the cache, so each product is one 2-D matmul
    over [H * T] query rows: at decode, almost all the time goes to reading c_KV twice.
    """
    H, T, _ = q_nope.shape
    L, r = c_kv.shape
    scores = q_rope.reshape(H * T, -1) @ k_rope.T                           # [H*T, L]
    if q_nope.shape[-1]:   # (models converted by mla_convert have no un-rotated part)
        q_latent = q_nope @ w_uk                                            # [H, T, r]  W_UKᵀ q_nope per head
        scores += q_latent.reshape(H * T, r) @ c_kv.T                       # [H*T, L]
    scores *= scale
    weights = _softmax(scores.reshape(H, T, L))                             # [H, T, L]
    out_latent = weights.reshape(H * T, L) @ c_kv                           # [H*T, r]  attend over c_KV
    return out_latent.reshape(H, T, r) @ w_uv.transpose(0, 2, 1)            # [H, T, v_head]


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Causal softmax over the last axis, in place.  scores: [H, T, L], queries = the last T of L."""
    T, L = scores.shape[-2:]
    xp = array_module(scores)
    if T > 1:
        scores += mask_bias(T, L, xp=xp)                                    # [T, L] broadcast over heads
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores
