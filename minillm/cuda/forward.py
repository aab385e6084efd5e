"""The GPU's layer loop, written once: a prompt chunk of one sequence (GPUTransformer.prefill over its contiguous
cache) and a step of many sequences (the batching engine over the paged pool) run the same ops in the same order.

    run_layers(ops, layers, meta, x)    x [N, dim] fp32: N packed rows (one chunk, or every sequence's new tokens)

Each projection and the MLP is one cuBLAS GEMM over all N rows (16-bit inputs, fp32 accumulation). Only where a
row's keys and values live differs, and that is the ops object: `DeviceOps` the paged pool through block tables,
gpu_model.ContiguousOps one sequence's cache. One sequence's decode step pays for its own code: gpu_model's
decode_step fuses norm, GEMV, RoPE and KV append into 5 launches a layer, replayed as a graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minillm.cuda.gpu_kv_cache import device_dtype
from minillm.cuda.kernels import MM_ROWS, MM_THREADS, module, suffix

PA_WARPS, PA_MAX_HD = 4, 256            # as #defined in paged_attention.cu
PA_GROUPS = (1, 2, 4, 8)                # GQA group sizes paged_attention_g{G} is compiled for
MMA_HDS = (64, 128)                     # head sizes paged_prefill_attention_mma is compiled for
ARGMAX_THREADS = 1024                   # argmax_rows' block (sampling.cu: one block per row)


def run_layers(ops, layers, meta, x, buf: "StepBuffers | None" = None):
    """Every layer over the packed rows, x [N, dim] fp32 updated in place; buf: preallocated outputs (a graph's)."""
    buf = buf or NO_BUFFERS
    for i, layer in enumerate(layers):
        h = ops.rmsnorm(x, layer.attn_norm, out=buf.h)                                # [N, dim] 16-bit
        qkv = ops.gemm(h, layer.wqkv, out=buf.qkv)                                    # [N, qkv_width] fp32
        ops.rope(qkv, meta)                                                           # q and k heads, in place
        ops.kv_write(i, qkv, meta)                                                    # new K/V into the cache
        attn = ops.attention(i, qkv, meta, out=buf.attn)                              # [N, n_heads * hd] fp32
        ops.gemm(ops.cast(attn, out=buf.attn16), layer.wo, out=x, accumulate=True)    # x += o_proj(attn)
        h = ops.rmsnorm(x, layer.mlp_norm, out=buf.h)                                 # [N, dim] 16-bit
        gu = ops.gemm(h, layer.w_gate_up, out=buf.gu)                                 # [N, 2 * ffn] fp32
        ops.gemm(ops.swiglu(gu, out=buf.act), layer.w_down, out=x, accumulate=True)   # x += down(act)
    return x


@dataclass
class StepBuffers:
    """A forward pass's activations, allocated before a capture so the graph's pointers stay valid (eager: none)."""
    x: object = None        # [R, dim]         fp32 residual stream
    h: object = None        # [R, dim]         16-bit, normalized
    qkv: object = None      # [R, qkv_width]   fp32
    attn: object = None     # [R, n_heads*hd]  fp32
    attn16: object = None   # [R, n_heads*hd]  16-bit
    gu: object = None       # [R, 2*ffn]       fp32
    act: object = None      # [R, ffn]         16-bit
    logits: object = None   # [R, vocab]       fp32
    ids: object = None      # [R]              int32, each row's argmax (greedy steps copy back only these)
    tokens: object = None   # [R]              int32, one sequence's rows (a batched step's are in its metadata)

    @classmethod
    def allocate(cls, ops, config, rows: int) -> "StepBuffers":
        c, hd = config, config.head_dim
        f32, narrow = ops.zeros_f32, ops.zeros_narrow
        return cls(f32((rows, c.dim)), narrow((rows, c.dim)), f32((rows, (c.n_heads + 2 * c.n_kv_heads) * hd)),
                   f32((rows, c.n_heads * hd)), narrow((rows, c.n_heads * hd)), f32((rows, 2 * c.ffn_dim)),
                   narrow((rows, c.ffn_dim)), f32((rows, c.vocab_size)), ops.zeros_i32(rows))


NO_BUFFERS = StepBuffers()


def _cp():
    import cupy
    return cupy


class LayerOps:
    """run_layers' ops that do not depend on where keys and values live, launched on a GPUTransformer's stream with
    its weights and kernels (model.k); subclasses add rope, kv_write and attention."""

    def __init__(self, model):
        self.xp, self.model, self.k = _cp(), model, model.k
        self.narrow = device_dtype(model.dtype)

    def stream(self):
        return self.model.stream

    def upload(self, a: np.ndarray):
        return self.xp.asarray(a)

    def zeros_f32(self, shape):
        return self.xp.zeros(shape, self.xp.float32)

    def zeros_narrow(self, shape):
        return self.xp.zeros(shape, self.narrow)

    def zeros_i32(self, n: int):
        return self.xp.zeros(n, self.xp.int32)

    def host_i32(self, n: int) -> np.ndarray:
        """A pinned host buffer: its upload is one async copy on the stream."""
        import cupyx
        return cupyx.zeros_pinned(n, np.int32)

    def copy_in(self, dst, host: np.ndarray) -> None:
        dst.set(host, stream=self.model.stream)

    def embed(self, tokens, out=None):
        x = self.xp.empty((tokens.shape[0], self.model.config.dim), self.xp.float32) if out is None else out
        self.k.embed(tokens, self.model.embed, x)
        return x

    def rmsnorm(self, x, gain, out=None):
        out = self.xp.empty(x.shape, self.narrow) if out is None else out
        self.k.rmsnorm(x, gain, out, self.model.config.norm_eps)
        return out

    def gemm(self, a, w, out=None, accumulate: bool = False):
        """out [N, rows] fp32 (+)= a [N, in] 16-bit @ w [rows, in]ᵀ, on cuBLAS (GPUTransformer.gemm): our small-M
        tensor-core kernel measured slower at these shapes (lessons/BENCHMARKS.md)"""
        if out is None:
            out = self.xp.empty((a.shape[0], w.shape[0]), self.xp.float32)
        self.model.gemm(a, w, out, accumulate)
        return out

    def cast(self, x, out=None):
        out = self.xp.empty(x.shape, self.narrow) if out is None else out
        self.k.cast(x, out)
        return out

    def swiglu(self, gu, out=None):
        out = self.xp.empty((gu.shape[0], gu.shape[1] // 2), self.narrow) if out is None else out
        self.k.swiglu(gu, out)
        return out

    def logits(self, x, out=None, norm_out=None):
        """Final norm (into norm_out [rows, dim] 16-bit if given) + LM head: x [rows, dim] fp32 -> [rows, vocab]
        fp32 on the device (into out if given)."""
        hn = self.rmsnorm(x, self.model.final_norm, out=norm_out)
        return self.gemm(hn, self.model.lm_head, out=out)


class DeviceOps(LayerOps):
    """The layer loop's ops with keys and values in a DevicePagedKV (`pool`): kv_write and attention take a layer of
    the pool, write_kv and attend any pool arrays.

    Attention: paged_attention_g{G}, a block per KV head serving its G query heads (G in PA_GROUPS; the fallback,
    paged_attention, a block per query head). A step with prompt chunks over a 16-bit pool at head_dim 64 or 128
    runs them all in one paged_prefill_attention_mma launch on the tensor cores (the paged kernels score a prompt
    row's keys one at a time: lessons/BENCHMARKS.md, "Serving many users"); else the paged kernels.
    """

    def __init__(self, model, pool=None):
        super().__init__(model)
        self.pool = pool
        c = model.config
        if c.head_dim > PA_MAX_HD or c.n_heads % c.n_kv_heads:
            raise ValueError(f"paged attention needs head_dim <= {PA_MAX_HD} and n_heads % n_kv_heads == 0")
        group = c.n_heads // c.n_kv_heads
        self.group = group if group in PA_GROUPS else None        # None: the per-head fallback
        sfx, mod = suffix(model.dtype), module("paged_attention")
        kernel = f"paged_attention_g{group}" if self.group else "paged_attention"
        self.fn = {"attention": mod.get_function(f"{kernel}_{sfx}"),
                   "attention_int8": mod.get_function(f"{kernel}_int8"),                  # over the int8 pool
                   "kv_write": mod.get_function(f"paged_kv_write_{sfx}"),
                   "kv_write_int8": mod.get_function("paged_kv_write_int8"),
                   "rope": mod.get_function("rope_at_positions"),
                   "argmax": module("sampling").get_function("argmax_rows")}              # greedy steps' pick
        if c.head_dim in MMA_HDS:
            mma = module("prefill_attention_mma")
            self.fn["prefill"] = mma.get_function(f"paged_prefill_attention_mma_hd{c.head_dim}_{sfx}")

    def rope(self, qkv, meta) -> None:
        """RoPE on the q and k heads of each row at its own position (meta.positions [N])."""
        c = self.model.config
        self.fn["rope"]((qkv.shape[0], c.n_heads + c.n_kv_heads), (c.head_dim // 2,),
                        (qkv, np.int32(qkv.shape[1]), np.int32(c.head_dim), meta.positions, self.model.inv_freq))

    def kv_write(self, layer: int, qkv, meta) -> None:
        """Layer `layer`'s new keys and values (rows of qkv [N, width]) into their slots of the pool."""
        k_pool, v_pool, scales = self.pool.layer(layer)
        self.write_kv(qkv, meta.slots, k_pool, v_pool, scales)

    def attention(self, layer: int, qkv, meta, out=None):
        """The queries of qkv [N, width] against their sequences' keys in layer `layer` -> [N, n_heads * hd]"""
        k_pool, v_pool, scales = self.pool.layer(layer)
        return self.attend(qkv, k_pool, v_pool, meta, out=out, scales=scales)

    def write_kv(self, qkv, slots, k_pool, v_pool, scales=None) -> None:
        """Each row's new key and value into its slot; scales = (k_scale, v_scale): the int8 pool (quantized)."""
        c = self.model.config
        head = (qkv, np.int32(qkv.shape[1]), np.int32(c.n_heads), np.int32(c.n_kv_heads), np.int32(c.head_dim),
                slots, k_pool, v_pool)
        if scales is None:
            self.fn["kv_write"]((qkv.shape[0], c.n_kv_heads), (min(c.head_dim, 256),), head)
        else:                                            # a warp for the key, one for the value
            self.fn["kv_write_int8"]((qkv.shape[0], c.n_kv_heads), (64,), head + tuple(scales))

    def attend(self, qkv, k_pool, v_pool, meta, out=None, scales=None):
        """The queries of qkv [N, width] against their sequences' keys in one layer's pool -> [N, n_heads * hd]
        scales = (k_scale, v_scale): k_pool, v_pool are the int8 pool's codes."""
        c, hd = self.model.config, self.model.config.head_dim
        N = qkv.shape[0]
        if out is None:
            out = self.xp.empty((N, c.n_heads * hd), self.xp.float32)
        if scales is None and meta.longest_chunk > 1 and "prefill" in self.fn:
            return self._attend_prefill(qkv, k_pool, v_pool, meta, out)
        pools = (k_pool, v_pool) + (tuple(scales) if scales is not None else ())
        self.fn["attention" if scales is None else "attention_int8"](
            (N, c.n_kv_heads if self.group else c.n_heads), (32 * PA_WARPS,),
            (qkv, np.int32(qkv.shape[1])) + pools + (np.int32(k_pool.shape[1]), np.int32(c.n_heads),
                                                     np.int32(c.n_kv_heads), np.int32(hd), meta.block_tables,
                                                     np.int32(meta.block_tables.shape[1]), meta.seq_of_row,
                                                     meta.positions, np.int32(c.sliding_window or 0),
                                                     np.float32(1.0 / math.sqrt(hd)), out))
        return out

    def _attend_prefill(self, qkv, k_pool, v_pool, meta, out):
        """attend() for a step with prompt chunks, on the tensor cores: grid (row tiles of the longest chunk,
        KV heads, chunks), a block 64 rows of one chunk's GQA group (MM_ROWS there)."""
        c, hd = self.model.config, self.model.config.head_dim
        group = c.n_heads // c.n_kv_heads
        tiles = -(-meta.longest_chunk * group // MM_ROWS)
        self.fn["prefill"]((tiles, c.n_kv_heads, meta.last_rows.shape[0]), (MM_THREADS,),
                           (qkv, np.int32(qkv.shape[1]), k_pool, v_pool, np.int32(k_pool.shape[1]),
                            np.int32(c.n_heads), np.int32(c.n_kv_heads), meta.block_tables,
                            np.int32(meta.block_tables.shape[1]), meta.last_rows, meta.positions,
                            np.int32(c.sliding_window or 0), np.float32(1.0 / math.sqrt(hd)), out))
        return out

    def argmax(self, logits, out=None):
        """Each row's argmax as np.argmax picks it (the first maximum, or NaN): logits [rows, vocab] -> int32 [rows]."""
        rows, vocab = logits.shape
        out = self.xp.empty(rows, self.xp.int32) if out is None else out
        if rows:
            self.fn["argmax"]((rows,), (ARGMAX_THREADS,), (logits, np.int32(vocab), out))
        return out

    def synchronize(self) -> None:
        self.model.stream.synchronize()

    def download(self, a) -> np.ndarray:
        """The step's one device-to-host copy, into pinned memory (8 MB of logits move several times slower pageable,
        staged by the driver); a new array each step (CuPy's pinned pool recycles it), so a caller may keep it."""
        import cupyx
        host = cupyx.empty_pinned(a.shape, a.dtype)
        a.get(out=host)
        self.model.stream.synchronize()
        return host

    def capture(self, step):
        """step() captured as a CUDA graph (GPUTransformer.capture_with_cublas). -> (replay, None), replay() launching
        it and returning step()'s result, or (None, the reason capturing failed)."""
        graph, result, error = self.model.capture_with_cublas(step)
        if error is not None:
            return None, error
        stream = self.model.stream

        def replay():
            graph.launch(stream)
            return result
        return replay, None
