"""GPUMLATransformer: DeepSeek-style latent attention (mla.py) on the device, same contract as GPUTransformer.

    gpu = GPUMLATransformer.from_cpu(cpu_model, dtype="float16")   # or "bfloat16"; xp=numpy runs it on the CPU
    cache = gpu.new_cache(256)
    logits = gpu.prefill(ids, cache)      # float32 numpy [vocab], on the host
    logits = gpu.decode(token, cache)     # float32 numpy [vocab]

Written against an array module `xp` picked at construction: CuPy on the GPU (every matmul is then a
cuBLAS call), or NumPy, so the very same lines are tested on machines without a GPU. Only `xp.*`
functions both modules share appear below (never np.exp on a device array, never a host mask).

What lives on the device: the weights in 16 bits (fp16, or bf16 as its raw uint16 bits, as on the
CPU: CuPy has no bfloat16 dtype), the norm gains in fp32, and the latent cache (c_KV and the shared
RoPE key, `cache_dtype`, fp16 by default: the cache is MLA's whole point, so it stays small). The
residual stream, norms, RoPE, softmax and every matmul are fp32: each matmul widens its weight to
fp32 first (`_widen`), exactly as backend.as_f32 does on the CPU. That temporary costs a write and a
read of 4 bytes per weight on top of the 2 stored: simple and exact, not the roofline. The fast
path would be GEMMs with 16-bit inputs and fp32 output (cublasGemmEx, as GPUTransformer.gemm) and
latent-attention decode kernels; not here yet.

Attention: decode (one new position) runs mla.py's "absorbed" form, W_UK folded into the query and
W_UV applied after attending, so all heads read the one shared [L, kv_lora_rank + rope] cache.
Prefill runs the "naive" form by default (`prefill_attention`): with T queries the per-head keys
and values are expanded once per chunk and then serve all T rows, about half the flops of absorbed
at T = L (DeepSeek's own inference splits it the same way). Both are the same numbers.

No CUDA graph: every matmul here is a cuBLAS call made through CuPy, and CuPy's cuBLAS calls cannot
be captured into a graph (see gpu_model.py, whose captured decode step uses only our own kernels).
So decode pays Python and launch overhead per op; fine for correctness, a kernel port makes it fast.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.backend import to_dtype
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import CacheBase
from minillm.model.layers import rope_tables
from minillm.model.mla import LATENT_NORM_EPS, mla_rope, softmax_scale

DTYPES = ("float16", "bfloat16")


def _cupy():
    import cupy
    return cupy


def _widen(w, xp):
    """A stored weight as fp32: fp16 cast, bf16 bits (uint16) shifted into the top half of an fp32."""
    if w.dtype == xp.float32:
        return w
    if w.dtype == xp.uint16:
        return (w.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)   # a typed shift: stays 32-bit
    return w.astype(xp.float32)


def _linear(x, w, xp):
    """x @ Wᵀ, W in HF's [out, in] layout.   x: [T, in] -> [T, out]   (at decode: reads every byte of W)"""
    return x @ _widen(w, xp).T


def _rmsnorm(x, gain, eps: float, xp):
    """x / sqrt(mean(x²) + eps) * gain over the last axis, as layers.rmsnorm.   x: [T, n]"""
    mean_square = xp.square(x).sum(axis=-1, keepdims=True) * (1.0 / x.shape[-1])   # [T, 1]
    return (x * (1.0 / xp.sqrt(mean_square + eps))) * gain


def _rope(x, cos, sin, interleave: bool, xp):
    """mla.rope_part in xp.   x: [T, heads, rope]; cos, sin: [T, rope/2]

    DeepSeek pairs adjacent dims: gather evens then odds, then HF's half-split rotation."""
    if interleave:
        x = xp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)          # [T, heads, rope]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]                                  # [T, heads, rope/2] each
    c, s = cos[:, None, :], sin[:, None, :]                                # [T, 1, rope/2]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)     # [T, heads, rope]


def _causal_softmax(scores, xp):
    """Softmax over the last axis, in place; the T queries are the last T of L keys.   scores: [H, T, L]"""
    T, L = scores.shape[-2:]
    if T > 1:   # built with xp: a host mask cannot be added to a device array
        allowed = xp.arange(L)[None, :] <= xp.arange(L - T, L)[:, None]    # [T, L]
        scores += xp.where(allowed, xp.float32(0.0), xp.float32(-xp.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def absorbed_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale: float, xp):
    """mla.absorbed_attention in xp: score and attend in latent space.

    q_nope: [H, T, nope]  q_rope: [H, T, rope]  c_kv: [L, r]  k_rope: [L, rope]
    w_uk: [H, nope, r]  w_uv: [H, v_head, r]  -> [H, T, v_head]
    At decode nearly all the time goes to the two reads of c_kv (the scores and the weighted sum).
    """
    H, T, _ = q_nope.shape
    L, r = c_kv.shape
    scores = q_rope.reshape(H * T, -1) @ k_rope.T                          # [H*T, L]
    if q_nope.shape[-1]:   # models from mla_convert have no un-rotated part
        q_latent = q_nope @ w_uk                                           # [H, T, r]  W_UKᵀ q_nope per head
        scores += q_latent.reshape(H * T, r) @ c_kv.T                      # [H*T, L]
    scores *= scale
    weights = _causal_softmax(scores.reshape(H, T, L), xp)                 # [H, T, L]
    out_latent = weights.reshape(H * T, L) @ c_kv                          # [H*T, r]
    return out_latent.reshape(H, T, r) @ w_uv.transpose(0, 2, 1)           # [H, T, v_head]


def naive_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale: float, xp):
    """mla.naive_attention in xp: expand every head's keys and values, then multi-head attention.
    Same shapes as absorbed_attention."""
    k_nope = c_kv @ w_uk.transpose(0, 2, 1)                                # [H, L, nope]
    values = c_kv @ w_uv.transpose(0, 2, 1)                                # [H, L, v_head]
    scores = q_nope @ k_nope.transpose(0, 2, 1) + q_rope @ k_rope.T        # [H, T, L]
    scores *= scale
    return _causal_softmax(scores, xp) @ values                            # [H, T, v_head]


@dataclass
class GPUMLALayer:
    """One layer on the device, HF [out, in] layout. Either wq, or wq_a + q_norm + wq_b."""
    attn_norm: object      # [dim] fp32
    wq: object             # [H * (nope + rope), dim] 16-bit, or None
    wq_a: object           # [q_lora_rank, dim], or None
    q_norm: object         # [q_lora_rank] fp32, or None
    wq_b: object           # [H * (nope + rope), q_lora_rank], or None
    wkv_a: object          # [kv_lora_rank + rope, dim]   W_DKV over W_KR
    kv_norm: object        # [kv_lora_rank] fp32, or None (a linear latent: mla_convert)
    wkv_b: object          # [H * (nope + v_head), kv_lora_rank]  per head: W_UK over W_UV
    wo: object             # [dim, H * v_head]
    mlp_norm: object       # [dim] fp32
    w_gate_up: object      # [2 * ffn_dim, dim]  gate rows, then up rows
    w_down: object         # [dim, ffn_dim]

    def matrices(self) -> list:
        return [w for w in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b, self.wo, self.w_gate_up,
                            self.w_down) if w is not None]


class GPUMLACache(CacheBase):
    """The latent cache on the device: c_kv [layers, capacity, kv_lora_rank], k_rope [layers, capacity, rope].
    Same contract as kv_cache.MLACache; `append` returns the layer's latents so far, as stored."""

    def __init__(self, config: ModelConfig, capacity: int, xp, dtype=None):
        n = (config.n_layers, capacity)
        dtype = dtype or xp.float16
        self.c_kv = xp.zeros(n + (config.kv_lora_rank,), dtype=dtype)
        self.k_rope = xp.zeros(n + (config.qk_rope_head_dim,), dtype=dtype)
        self.max_seq_len = capacity
        self.length = 0

    def append(self, layer: int, c_kv_new, k_rope_new):
        """c_kv_new: [T, r], k_rope_new: [T, rope] -> [length + T, r], [length + T, rope] in the cache dtype"""
        start, end = self.length, self.end_of_write(c_kv_new.shape[0])
        self.c_kv[layer, start:end] = c_kv_new                             # narrowed to the cache dtype
        self.k_rope[layer, start:end] = k_rope_new
        return self.c_kv[layer, :end], self.k_rope[layer, :end]


class GPUMLATransformer:
    prefill_chunk = 512            # tokens per pass: bounds the [H, chunk, L] fp32 score tables
    prefill_attention = "naive"    # "naive" or "absorbed" for T > 1; decode is always absorbed
    cache_dtype = "float16"        # the latent cache: "float16" or "float32"

    def __init__(self, config: ModelConfig, layers: list[GPUMLALayer], embed, final_norm, lm_head,
                 dtype: str = "float16", xp=None):
        if config.attention != "mla":
            raise ValueError("GPUMLATransformer runs MLA models; MHA/GQA/MQA ones use GPUTransformer")
        self.xp = xp if xp is not None else _cupy()
        self.config, self.layers, self.dtype = config, layers, dtype
        self.embed, self.final_norm, self.lm_head = embed, final_norm, lm_head
        self.inv_freq, self.rope_gain = mla_rope(config)                   # host: the tables are tiny
        self.scale = softmax_scale(config)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_cpu(cls, model, dtype: str = "float16", xp=None) -> "GPUMLATransformer":
        """Copy a CPU `minillm.model.transformer.Transformer` (an MLA one) to the device: matrices in `dtype`
        (fp16, or bf16 bits), norm gains fp32."""
        xp = xp if xp is not None else _cupy()
        if dtype not in DTYPES:
            raise ValueError(f"GPU weights are float16 or bfloat16, not {dtype!r}")
        if model.config.attention != "mla":
            raise ValueError("GPUMLATransformer runs MLA models; MHA/GQA/MQA ones use GPUTransformer")
        dev = lambda a: None if a is None else xp.asarray(to_dtype(_plain(a), dtype))
        f32 = lambda a: None if a is None else xp.asarray(to_dtype(_plain(a), "float32"))
        layers = []
        for L in model.layers:
            m = L.mla
            layers.append(GPUMLALayer(
                attn_norm=f32(L.attn_norm), wq=dev(m.wq), wq_a=dev(m.wq_a), q_norm=f32(m.q_norm),
                wq_b=dev(m.wq_b), wkv_a=dev(m.wkv_a), kv_norm=f32(m.kv_norm), wkv_b=dev(m.wkv_b),
                wo=dev(m.wo), mlp_norm=f32(L.mlp_norm),
                w_gate_up=dev(np.concatenate([_plain(L.w_gate), _plain(L.w_up)])), w_down=dev(L.w_down)))
        embed = dev(model.embed)
        lm_head = embed if model.lm_head is model.embed else dev(model.lm_head)
        return cls(model.config, layers, embed, f32(model.final_norm), lm_head, dtype=dtype, xp=xp)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the matrices a decode step reads, as stored (norm gains and the embedding row left out)."""
        per_layer = sum(w.nbytes for L in self.layers for w in L.matrices())
        return per_layer + self.lm_head.nbytes

    def new_cache(self, max_seq_len: int | None = None) -> GPUMLACache:
        """A latent cache for up to `max_seq_len` positions (default: the model's context)."""
        dtype = {"float16": self.xp.float16, "float32": self.xp.float32}[self.cache_dtype]
        return GPUMLACache(self.config, max_seq_len or self.config.max_seq_len, self.xp, dtype)

    # ---- the two phases --------------------------------------------------------------------------
    def prefill(self, tokens, cache: GPUMLACache, all_logits: bool = False) -> np.ndarray:
        """Run the prompt, filling the cache.  -> logits [T, vocab] if all_logits else [vocab] (host fp32)"""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        cache.end_of_write(len(tokens))                                    # refuses to run past the capacity
        outputs = []
        for start in range(0, len(tokens), self.prefill_chunk):
            x = self.forward(tokens[start:start + self.prefill_chunk], cache)   # [T, dim]
            if all_logits:
                outputs.append(self._host(self.head(x)))
            elif start + self.prefill_chunk >= len(tokens):
                outputs.append(self._host(self.head(x[-1:]))[0])
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def decode(self, token: int, cache: GPUMLACache) -> np.ndarray:
        """Run one new position against the cache.  -> logits [vocab] (host fp32)"""
        cache.end_of_write(1)
        x = self.forward(np.array([token], dtype=np.int64), cache)         # [1, dim]
        return self._host(self.head(x))[0]

    # ---- the forward pass ------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, cache: GPUMLACache):
        """tokens: [T] new positions after the cache's `length`.  -> the last layer's x [T, dim] fp32"""
        xp, c = self.xp, self.config
        positions = np.arange(cache.length, cache.length + len(tokens))
        cos, sin = rope_tables(positions, self.inv_freq)                   # [T, rope/2] each, host fp32
        cos, sin = xp.asarray(cos * self.rope_gain), xp.asarray(sin * self.rope_gain)  # YaRN's gain
        x = _widen(self.embed[xp.asarray(tokens)], xp)                     # [T, dim]
        for i, L in enumerate(self.layers):
            x = x + self.attention(_rmsnorm(x, L.attn_norm, c.norm_eps, xp), L, i, cache, cos, sin)
            x = x + self.mlp(_rmsnorm(x, L.mlp_norm, c.norm_eps, xp), L)
        cache.advance(len(tokens))
        return x

    def attention(self, h, L: GPUMLALayer, i: int, cache: GPUMLACache, cos, sin):
        """mla.mla_attention in xp.   h: [T, dim] (normed) -> [T, dim]"""
        xp, c = self.xp, self.config
        T, H = h.shape[0], c.n_heads
        nope, rope, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        if L.wq is not None:
            q = _linear(h, L.wq, xp)                                       # [T, H * (nope + rope)]
        else:   # the low-rank query: down, norm, up
            q = _linear(_rmsnorm(_linear(h, L.wq_a, xp), L.q_norm, LATENT_NORM_EPS, xp), L.wq_b, xp)
        q = q.reshape(T, H, nope + rope)                                   # [T, H, nope + rope]
        q_nope = q[..., :nope].transpose(1, 0, 2)                          # [H, T, nope]
        q_rope = _rope(q[..., nope:], cos, sin, c.rope_interleave, xp).transpose(1, 0, 2)   # [H, T, rope]
        kv = _linear(h, L.wkv_a, xp)                                       # [T, r + rope]
        c_kv = kv[:, :r] if L.kv_norm is None else _rmsnorm(kv[:, :r], L.kv_norm, LATENT_NORM_EPS, xp)  # [T, r]
        k_rope = _rope(kv[:, None, r:], cos, sin, c.rope_interleave, xp)[:, 0]                     # [T, rope]
        c_kv, k_rope = (_widen(a, xp) for a in cache.append(i, c_kv, k_rope))   # [L, r], [L, rope] fp32
        w_up = _widen(L.wkv_b, xp).reshape(H, nope + c.v_head_dim, r)      # [H, nope + v_head, r]
        w_uk, w_uv = w_up[:, :nope], w_up[:, nope:]                        # [H, nope, r], [H, v_head, r]
        attend = naive_attention if T > 1 and self.prefill_attention == "naive" else absorbed_attention
        out = attend(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, self.scale, xp)   # [H, T, v_head]
        return _linear(out.transpose(1, 0, 2).reshape(T, H * c.v_head_dim), L.wo, xp)   # [T, dim]

    def mlp(self, h, L: GPUMLALayer):
        """SwiGLU with gate and up as one matmul.   h: [T, dim] (normed) -> [T, dim]"""
        gate_up = _linear(h, L.w_gate_up, self.xp)                         # [T, 2 * ffn_dim]
        gate, up = gate_up[:, :self.config.ffn_dim], gate_up[:, self.config.ffn_dim:]
        return _linear(gate / (1.0 + self.xp.exp(-gate)) * up, L.w_down, self.xp)   # silu(gate) * up -> [T, dim]

    def head(self, x):
        """Final norm and LM head.   x: [T, dim] -> logits [T, vocab] fp32 (on the device)"""
        return _linear(_rmsnorm(x, self.final_norm, self.config.norm_eps, self.xp), self.lm_head, self.xp)

    def _host(self, a) -> np.ndarray:
        return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float32)


def _plain(a) -> np.ndarray:
    """A host weight as a plain array; quantized ones are refused (the MLA GPU path is 16-bit only)."""
    from minillm.model.quant import QuantizedWeight
    if isinstance(a, QuantizedWeight):
        raise ValueError("int8/int4 weights are not supported for MLA models on the GPU")
    return np.asarray(a)
