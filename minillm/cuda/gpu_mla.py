"""GPUMLATransformer: DeepSeek-style MLA models' decode step on our kernels, captured as one CUDA graph.

    gpu = GPUMLATransformer.from_cpu(cpu_model, dtype="float16")   # or .random(config) for benchmarks
    cache = gpu.new_cache(256)            # GPUMLACache: the latent cache, [layers, capacity, r + rope] 16-bit
    logits = gpu.prefill(ids, cache)      # float32 numpy [vocab], on the host
    logits = gpu.decode(token, cache)

The decode step, 10 launches a layer, none of them cuBLAS (so it can be captured):
    gemv_rmsnorm  [q_a | kv_a] (or [q | kv_a]) = W_in · rmsnorm(x)        one GEMV for both: same input
    gemv_rmsnorm  q = W_qb · rmsnorm(q_a, q_norm)                         (q_lora models only)
    mla_kv_append c_kv = rmsnorm(kv[:r]) · kv_norm, RoPE(k_rope) -> cache row pos (16-bit)
    mla_q_absorb  q_cat[h] = [W_UK_hᵀ q_nope[h] | RoPE(q_rope[h])]        the query in latent space
    mla_attention + mla_combine   o_lat[h] = softmax(scale q_cat[h] · cacheᵀ) · c_kv   (flash-decoding splits)
    mla_v_up      o[h] = W_UV_h · o_lat[h]
    gemv          x += W_o · o
    gemv_swiglu   act = silu(gate) · up of rmsnorm(x)
    gemv          x += W_down · act
then the final norm fused into the LM head GEMV: kernels/mla_decode.cu's kernels and gemv.cu's v4, replayed as
one CUDA graph per cache (graph.GraphDecode, as GPUTransformer). Weights 16-bit, gains, activations and
accumulations fp32, the latent cache 16-bit.

Prefill: a model made by `from_cpu` runs the prompt through device_model's path (the engine's Transformer on
CuPy, cuBLAS GEMMs) built over these very device arrays (`prefill_transformer`: views, no second copy), writing
the same latent cache; a `random` model, or `prefill(..., by_step=True)`, runs it a token at a time through the
decode graph. `unsupported` says what this path refuses (MoE, FlashNorm, int8/int4 weights, shapes the kernels
cannot take: check_shape); llm.gpu_path runs those on device_model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minillm.backend import to_dtype
from minillm.model.config import ModelConfig
from minillm.model.mla import LATENT_NORM_EPS, mla_rope, softmax_scale
from minillm.cuda.gpu_kv_cache import device_dtype
from minillm.cuda.graph import GraphDecode
from minillm.cuda.kernels import Kernels, module, suffix
from minillm.cuda.qweights import random_matrices
from minillm.model.kv_cache import CacheBase

SOURCE = "mla_decode"                      # kernels/mla_decode.cu
KERNELS = {"kv_append": "mla_kv_append_{sfx}", "q_absorb": "mla_q_absorb_{sfx}",
           "attention": "mla_attention_{sfx}", "combine": "mla_combine", "v_up": "mla_v_up_{sfx}"}
MLA_TK, MLA_HEADS, MLA_MAX_W, MLA_MAX_R, MLA_ABSORB_COLS = 32, 16, 640, 512, 256   # as #defined in mla_decode.cu
MAX_SPLITS = 64


def _cp():
    import cupy
    return cupy


# ---- the launchers of kernels/mla_decode.cu --------------------------------------------------------
class MLAKernels(Kernels):
    """Kernels, and the launchers of mla_decode.cu (fetched at construction too: nothing compiles in a capture)."""

    def __init__(self, dtype: str = "float16"):
        super().__init__(dtype)
        for key, name in KERNELS.items():
            f = self.fn[f"mla_{key}"] = module(SOURCE).get_function(name.format(sfx=suffix(dtype)))
            getattr(f, "attributes", None)          # NVRTC + module load now
        most = self.fn["mla_attention"].attributes.get("max_threads_per_block", 32 * MLA_HEADS)
        if most < 32 * MLA_HEADS:               # > 128 registers a thread were taken: say so, not a launch error
            raise RuntimeError(f"mla_attention compiled for at most {most} threads a block, needs {32 * MLA_HEADS}")

    def mla_kv_append(self, kv, gain, eps: float, r: int, rope: int, pos, inv_freq, rope_gain: float,
                      interleave: bool, cache) -> None:
        """kv [r + rope] fp32 -> cache [capacity, r + rope] (one layer) row pos[0]: rmsnorm(kv[:r]) · gain
        (gain None: copied as is) | RoPE(kv[r:])."""
        self._launch("mla_kv_append", (1,), (256,),
                     (kv, self._nil_f32 if gain is None else gain, np.int32(gain is not None), np.float32(eps),
                      np.int32(r), np.int32(rope), pos, inv_freq, np.float32(rope_gain), np.int32(interleave), cache))

    def mla_q_absorb(self, q, wkv_b, H: int, nope: int, rope: int, v: int, r: int, pos, inv_freq,
                     rope_gain: float, interleave: bool, q_cat) -> None:
        """q [H * (nope + rope)] fp32, wkv_b [H * (nope + v), r] -> q_cat [H, r + rope] fp32."""
        self._launch("mla_q_absorb", (H, -(-r // MLA_ABSORB_COLS)), (256,),
                     (q, wkv_b, np.int32(nope), np.int32(rope), np.int32(v), np.int32(r), pos, inv_freq,
                      np.float32(rope_gain), np.int32(interleave), q_cat))

    def mla_attention(self, q_cat, cache, H: int, r: int, pos, scale: float, parts, o_lat) -> None:
        """q_cat [H, W] fp32 against one layer's cache [capacity, W] (positions 0 .. pos[0]) -> o_lat [H, r]
        fp32. parts = (m [H, S], l [H, S], acc [H, S, r]) fp32 scratch; S: the most splits."""
        part_m, part_l, part_acc = parts
        S, W = part_m.shape[1], cache.shape[1]
        self._launch("mla_attention", (-(-H // MLA_HEADS), S), (32 * MLA_HEADS,),
                     (q_cat, cache, np.int32(H), np.int32(r), np.int32(W), pos, np.float32(scale),
                      part_m, part_l, part_acc))
        self._launch("mla_combine", (H,), (128,), (part_m, part_l, part_acc, np.int32(r), np.int32(S), pos, o_lat))

    def mla_v_up(self, o_lat, wkv_b, H: int, nope: int, v: int, r: int, o) -> None:
        """o_lat [H, r] fp32 -> o [H * v] fp32, o[h * v + e] = W_UV_h[e] · o_lat[h]."""
        self._launch("mla_v_up", (-(-H * v // 8),), (256,),
                     (o_lat, wkv_b, np.int32(H), np.int32(nope), np.int32(v), np.int32(r), o))


# ---- shapes, weights, cache ---------------------------------------------------------------------------
def check_shape(c: ModelConfig) -> None:
    """Refuse (ValueError, one line) a config these kernels cannot run."""
    r, rope = c.kv_lora_rank, c.qk_rope_head_dim
    if c.attention != "mla":
        raise ValueError("GPUMLATransformer runs MLA models; GQA models run on gpu_model.GPUTransformer")
    widths = {"dim": c.dim, "ffn_dim": c.ffn_dim, "n_heads * v_head_dim": c.n_heads * c.v_head_dim,
              "kv_lora_rank": r, "kv_lora_rank + qk_rope_head_dim": r + rope}
    if c.q_lora_rank:
        widths["q_lora_rank"] = c.q_lora_rank
    odd = [f"{k}={v}" for k, v in widths.items() if v % 8]
    if odd:
        raise ValueError(f"the MLA fast path needs multiples of 8 ({', '.join(odd)}): use device_model")
    if r > MLA_MAX_R or r + rope > MLA_MAX_W or rope % 2:
        raise ValueError(f"the MLA fast path takes kv_lora_rank <= {MLA_MAX_R}, kv_lora_rank + rope <= {MLA_MAX_W} "
                         f"and an even rope dim, not {r} + {rope}: use device_model")


def unsupported(model) -> str | None:
    """Why the fast path cannot run this CPU Transformer (one line), or None. Needs no GPU."""
    from minillm.model.quant import QuantizedWeight
    try:
        check_shape(model.config)
    except ValueError as e:
        return str(e)
    if model.flashnorm:
        return "the MLA fast path does not run FlashNorm models"
    if model.comm is not None:
        return "the MLA fast path runs on one GPU (no tensor parallelism)"
    for L in model.layers:
        if L.moe is not None:
            return "the MLA fast path runs dense-MLP layers only (MoE)"
        if any(isinstance(w, QuantizedWeight) for w in vars(L.mla).values()) or \
                any(isinstance(w, QuantizedWeight) for w in (L.w_gate, L.w_up, L.w_down)):
            return "the MLA fast path takes 16-bit weights, not int8/int4"
    return None


def n_splits_for(n_heads: int, capacity: int, n_sms: int = 132) -> int:
    """Flash-decoding splits (the scratch's S): about 2 blocks per SM over the head groups, at most 64, and
    no more than the capacity's tiles. The kernel uses fewer while the context is short."""
    want = math.ceil(2 * n_sms / -(-n_heads // MLA_HEADS))
    return int(max(1, min(want, MAX_SPLITS, -(-capacity // MLA_TK))))


@dataclass
class MLALayer:
    attn_norm: object   # [dim] fp32
    w_in: object        # [q_in + r + rope, dim]: q_a_proj (q_in = q_lora) or q_proj (q_in = H (nope+rope)), over kv_a
    q_norm: object      # [q_lora] fp32, or None
    wq_b: object        # [H * (nope + rope), q_lora], or None
    kv_norm: object     # [r] fp32, or None (a linear latent)
    wkv_b: object       # [H * (nope + v), r]: per head, W_UK rows then W_UV rows
    wo: object          # [dim, H * v]
    mlp_norm: object    # [dim] fp32
    w_gate_up: object   # [2 ffn, dim]
    w_down: object      # [dim, ffn]

    def matrices(self) -> list:
        return [w for w in (self.w_in, self.wq_b, self.wkv_b, self.wo, self.w_gate_up, self.w_down) if w is not None]

    def gains(self) -> list:
        return [g for g in (self.attn_norm, self.q_norm, self.kv_norm, self.mlp_norm) if g is not None]


def host_layer(L, dtype: str) -> MLALayer:
    """One CPU LayerWeights (an MLA, dense-MLP layer) as MLALayer of host arrays: matrices in `dtype`'s
    16-bit storage (stacked where one GEMV serves two), gains fp32. Shared by from_cpu and dev/mla.py's
    NumPy reference (`unsupported` says which layers it takes)."""
    m = L.mla
    w16 = lambda a: to_dtype(np.asarray(a), dtype)
    f32 = lambda a: None if a is None else to_dtype(np.asarray(a), "float32")
    q_in = m.wq if m.wq is not None else m.wq_a
    return MLALayer(attn_norm=f32(L.attn_norm), w_in=np.concatenate([w16(q_in), w16(m.wkv_a)]),
                    q_norm=f32(m.q_norm), wq_b=None if m.wq_b is None else w16(m.wq_b), kv_norm=f32(m.kv_norm),
                    wkv_b=w16(m.wkv_b), wo=w16(m.wo), mlp_norm=f32(L.mlp_norm),
                    w_gate_up=np.concatenate([w16(L.w_gate), w16(L.w_up)]), w_down=w16(L.w_down))


class GPUMLACache(CacheBase):
    """The latent cache on the device: latent [n_layers, capacity, r + rope] 16-bit, each row
    [c_kv | k_rope] (one layer's slice is what mla_attention reads). Holds the decode graph captured for it.
    `append` is MLACache's, so the engine's Transformer on CuPy (device_model) can prefill into it."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: str):
        W = config.kv_lora_rank + config.qk_rope_head_dim
        self.latent = _cp().zeros((config.n_layers, capacity, W), dtype=device_dtype(dtype))
        self.r, self.max_seq_len, self.length = config.kv_lora_rank, capacity, 0
        self.graph = self.graph_key = None      # the decode graph, and the model and settings it was captured with

    def append(self, layer: int, c_kv_new, k_rope_new):
        """MLACache.append on the device: [T, r] and [T, rope] fp32 into rows length .. length + T - 1.
        -> the layer's [length + T, r] and [length + T, rope] so far (16-bit views)"""
        start, end = self.length, self.end_of_write(c_kv_new.shape[0])
        rows, r = self.latent[layer, start:end], self.r
        rows[:, :r], rows[:, r:] = self._narrow(c_kv_new), self._narrow(k_rope_new)
        return self.latent[layer, :end, :r], self.latent[layer, :end, r:]

    def _narrow(self, a):
        """fp32 -> the cache's 16 bits: fp16, or bf16 bits rounded half to even (NaN payloads not kept)."""
        cp = _cp()
        if self.latent.dtype != cp.uint16:
            return a.astype(self.latent.dtype)
        bits = cp.ascontiguousarray(a, dtype=cp.float32).view(cp.uint32)
        return ((bits + (cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1)))) >> 16).astype(cp.uint16)

    def clear(self, start: int, stop: int) -> None:
        self.latent[:, start:stop] = 0
        _cp().cuda.get_current_stream().synchronize()


def prefill_transformer(model, layers: list[MLALayer], embed, final_norm, lm_head, dtype: str):
    """The engine's Transformer over the fast path's own device arrays (device_model's path; nothing
    copied: q_a and kv_a, gate and up are row views of the stacks): prefill's cuBLAS GEMMs, writing
    the same latent cache. model: the CPU Transformer these were made from."""
    from dataclasses import replace
    cp, c = _cp(), model.config
    q_in = c.q_lora_rank or c.n_heads * c.head_dim
    gpu = model.with_options(mla_mode="naive-prefill")   # expanded K and V for T > 1 queries (mla.py)

    def shared(L, d: MLALayer):
        q = dict(wq_a=d.w_in[:q_in], q_norm=d.q_norm, wq_b=d.wq_b) if c.q_lora_rank else dict(wq=d.w_in[:q_in])
        mla = replace(L.mla, **q, wkv_a=d.w_in[q_in:], kv_norm=d.kv_norm, wkv_b=d.wkv_b, wo=d.wo)
        return replace(L, attn_norm=d.attn_norm, mla=mla, mlp_norm=d.mlp_norm, w_gate_up=d.w_gate_up,
                       w_gate=d.w_gate_up[:c.ffn_dim], w_up=d.w_gate_up[c.ffn_dim:], w_down=d.w_down)

    gpu.layers = [shared(L, d) for L, d in zip(model.layers, layers)]
    gpu.embed, gpu.final_norm, gpu.lm_head = embed, final_norm, lm_head
    gpu.inv_freq = cp.asarray(model.inv_freq)
    gpu.cache_dtype, gpu.dtype = cp.float16, dtype
    return gpu


# ---- the model -------------------------------------------------------------------------------------
class GPUMLATransformer(GraphDecode):
    def __init__(self, config: ModelConfig, layers: list[MLALayer], embed, final_norm, lm_head,
                 dtype: str = "float16", use_graph: bool = True):
        cp = _cp()
        check_shape(config)
        self._hold(config, layers, embed, final_norm, lm_head, dtype, use_graph, MLAKernels(dtype))
        c = config
        H, nope, rope, v, r = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        inv_freq, self.rope_gain = mla_rope(c)
        self.inv_freq = cp.asarray(inv_freq, dtype=cp.float32)                    # [rope / 2]
        self.scale = softmax_scale(c)
        f32 = cp.float32                  # the decode step's activations after x (graph._hold)
        self.q_in = c.q_lora_rank or H * (nope + rope)                            # q_a's (or q's) rows of w_in
        self.first = cp.zeros(self.q_in + r + rope, f32)                          # [q_a or q | kv]
        self.q = cp.zeros(H * (nope + rope), f32) if c.q_lora_rank else self.first[:self.q_in]
        self.kv = self.first[self.q_in:]                                          # [r + rope]
        self.q_cat = cp.zeros((H, r + rope), f32)
        self.o_lat = cp.zeros((H, r), f32)
        self.o = cp.zeros(H * v, f32)
        self.act = cp.zeros(c.ffn_dim, f32)
        self.logits = cp.zeros(c.vocab_size, f32)
        self.prefill_model = None      # from_cpu: the engine's Transformer on these arrays (GEMM prefill)
        self.comm = None               # (one GPU: no tensor parallelism)
        cp.cuda.Device().synchronize()

    @classmethod
    def from_cpu(cls, model, dtype: str = "float16", **kw) -> "GPUMLATransformer":
        """Copy a CPU Transformer (an MLA model with dense MLPs, 16-bit or fp32 weights) to the device."""
        cp, why = _cp(), unsupported(model)
        if why is not None:
            raise ValueError(f"{why}: use device_model")
        dev = lambda a: None if a is None else cp.asarray(a)
        layers = []
        for L in model.layers:
            h = host_layer(L, dtype)
            layers.append(MLALayer(**{name: dev(getattr(h, name)) for name in vars(h)}))
        embed = cp.asarray(to_dtype(np.asarray(model.embed), dtype))
        lm_head = embed if model.lm_head is model.embed else cp.asarray(to_dtype(np.asarray(model.lm_head), dtype))
        final_norm = cp.asarray(to_dtype(np.asarray(model.final_norm), "float32"))
        gpu = cls(model.config, layers, embed, final_norm, lm_head, dtype=dtype, **kw)
        gpu.prefill_model = prefill_transformer(model, layers, embed, final_norm, lm_head, dtype)
        return gpu

    @classmethod
    def random(cls, config: ModelConfig, dtype: str = "float16", seed: int = 0, **kw) -> "GPUMLATransformer":
        """Random weights of `config`'s shape made on the device (uniform, variance 1/fan_in; gains 1):
        for speed measurements, where the values do not matter (a DeepSeek-V3 shape never touches the host)."""
        cp, c, dense = _cp(), config, random_matrices(Kernels(dtype), dtype, seed)
        check_shape(config)
        H, nope, rope, v, r = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        ones = lambda n: cp.ones(n, cp.float32)
        q_in = c.q_lora_rank or H * (nope + rope)
        layers = [MLALayer(attn_norm=ones(c.dim), w_in=dense(q_in + r + rope, c.dim),
                           q_norm=ones(c.q_lora_rank) if c.q_lora_rank else None,
                           wq_b=dense(H * (nope + rope), c.q_lora_rank) if c.q_lora_rank else None,
                           kv_norm=ones(r), wkv_b=dense(H * (nope + v), r), wo=dense(c.dim, H * v),
                           mlp_norm=ones(c.dim), w_gate_up=dense(2 * c.ffn_dim, c.dim), w_down=dense(c.dim, c.ffn_dim))
                  for _ in range(c.n_layers)]
        embed = dense(c.vocab_size, c.dim)
        lm_head = embed if c.tie_embeddings else dense(c.vocab_size, c.dim)
        cp.cuda.Device().synchronize()
        return cls(config, layers, embed, ones(c.dim), lm_head, dtype=dtype, **kw)

    def with_options(self, **options) -> "GPUMLATransformer":
        """A copy run another way, sharing weights and buffers (run one at a time): use_graph, and the GEMM
        prefill's mla_mode / prefill_chunk (Transformer.with_options); kv_cache only "auto"."""
        import copy
        unknown = set(options) - {"use_graph", "mla_mode", "prefill_chunk", "kv_cache"}
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}")
        if options.pop("kv_cache", "auto") != "auto":
            raise ValueError("the MLA fast path keeps a 16-bit latent cache: kv_cache='auto' only")
        other = copy.copy(self)
        other.use_graph = bool(options.pop("use_graph", self.use_graph))
        if options and self.prefill_model is not None:
            other.prefill_model = self.prefill_model.with_options(**options)
        return other

    def weights_read_per_token(self) -> list:
        """Every array a decode step reads (each once): the layer matrices and gains, final norm, LM head."""
        return [a for L in self.layers for a in L.matrices() + L.gains()] + [self.final_norm, self.lm_head]

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads from weights (one embedding row left out)."""
        return sum(a.nbytes for a in self.weights_read_per_token())

    def new_cache(self, max_seq_len: int | None = None, spare: int = 0) -> GPUMLACache:
        with self.stream:
            return GPUMLACache(self.config, max_seq_len or self.config.max_seq_len, self.dtype)

    # ---- the two phases --------------------------------------------------------------------------
    def prefill(self, tokens, cache: GPUMLACache, all_logits: bool = False, n_layers: int | None = None,
                by_step: bool = False) -> np.ndarray:
        """Run the prompt, filling the latent cache: by device_model's path on these weights (cuBLAS GEMMs)
        when built by from_cpu and T > 1, else (random models, by_step) one token at a time through the
        decode graph.  -> logits [T, vocab] if all_logits else [vocab] (host fp32)
        n_layers: early exit (the first n_layers layers, then the final norm and head), as on the CPU."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        cache.end_of_write(len(tokens))
        if self.prefill_model is not None and len(tokens) > 1 and not by_step:
            with self.stream:                     # CuPy's cuBLAS calls on our stream, ordered with the graph
                logits = self.prefill_model.prefill(tokens.astype(np.int64), cache, all_logits=all_logits,
                                                    n_layers=n_layers)
                self.stream.synchronize()
            return logits
        rows = []
        for i, t in enumerate(tokens):
            want = all_logits or i == len(tokens) - 1
            logits = self._step(int(t), cache, want, n_layers)
            if want:
                rows.append(logits)
        return np.stack(rows) if all_logits else rows[-1]

    def _decode_parts(self, cache: GPUMLACache) -> tuple:
        """Flash-decoding scratch (m, l [H, S], acc [H, S, r] fp32) for this cache's capacity."""
        cp, c = _cp(), self.config
        S = n_splits_for(c.n_heads, cache.max_seq_len, self.n_sms)
        if S not in self._parts:
            H, r = c.n_heads, c.kv_lora_rank
            self._parts[S] = (cp.zeros((H, S), cp.float32), cp.zeros((H, S), cp.float32),
                              cp.zeros((H, S, r), cp.float32))
        return self._parts[S]

    # ---- decode: one token, our kernels only ---------------------------------------------------
    def decode_step(self, cache: GPUMLACache, n_layers: int | None = None) -> None:
        """Enqueue one decode step: token and position from `self.step`, logits into `self.logits`.
        No allocation, no host sync, no cuBLAS: capturable. n_layers: only the first n_layers layers."""
        c, k = self.config, self.k
        parts = self._decode_parts(cache)
        x = self.x[0]
        k.embed(self.step_tokens, self.embed, self.x)                                     # [1, dim]
        for i, L in enumerate(self.layers[:n_layers]):
            self.attention(i, L, cache.latent[i], parts)                                  # x += o_proj(mla(x))
            k.gemv_swiglu(L.w_gate_up, x, L.mlp_norm, c.norm_eps, self.act, "gate_up")    # [ffn]
            k.gemv(L.w_down, self.act, x, True, "down")                                  # x += down(act)
        k.gemv_rmsnorm(self.lm_head, x, self.final_norm, c.norm_eps, self.logits, "lm_head")

    def attention(self, i: int, L: MLALayer, latent, parts) -> None:
        """Layer i's MLA half: norm, projections, the latent append, absorbed attention, o_proj + residual.
        latent: the layer's cache [capacity, r + rope]."""
        c, k = self.config, self.k
        H, nope, rope, v, r = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        pos, x = self.step_pos, self.x[0]
        k.gemv_rmsnorm(L.w_in, x, L.attn_norm, c.norm_eps, self.first, "q_a|kv_a")   # [q_in + r + rope]
        if L.wq_b is not None:
            k.gemv_rmsnorm(L.wq_b, self.first[:self.q_in], L.q_norm, LATENT_NORM_EPS, self.q, "q_b")
        k.mla_kv_append(self.kv, L.kv_norm, LATENT_NORM_EPS, r, rope, pos, self.inv_freq, self.rope_gain,
                        c.rope_interleave, latent)
        k.mla_q_absorb(self.q, L.wkv_b, H, nope, rope, v, r, pos, self.inv_freq, self.rope_gain, c.rope_interleave,
                       self.q_cat)                                                        # [H, r + rope]
        k.mla_attention(self.q_cat, latent, H, r, pos, self.scale, parts, self.o_lat)    # [H, r]
        k.mla_v_up(self.o_lat, L.wkv_b, H, nope, v, r, self.o)                            # [H * v]
        k.gemv(L.wo, self.o, x, True, "o")                                               # x += W_o · o
