"""Batched execution on the GPU: batched.py's forward pass with the weights, the pool and attention on the device.

The same plan as minillm.engine.batched: every sequence's new tokens (prompt chunks and single decode tokens)
packed into one matrix [N, dim], so each projection and the MLP is one cuBLAS GEMM over all N rows
(a decode step of B sequences reads each weight once, not B times: batching's whole gain), and only
attention is per sequence. Here attention is one launch per layer for the whole batch too:
kernels/paged_attention.cu gives every query row its sequence's block table and its position.

    weights      GPUTransformer's own (fused wqkv and gate|up, 16-bit, fp32 norms): nothing re-uploaded
    pool         DevicePagedKV (paged_pool.py): k, v [layers, blocks, block_size, n_kv_heads, hd], 16-bit, on
                 the device; or int8 codes with a scale per position and KV head, PagedKVCache's int8 format
    metadata     BatchMeta (batch_meta.py): each row's token, position, pool slot and block table, int32
    activations  the residual stream fp32; GEMM inputs narrowed to 16 bits, fp32 accumulation (as prefill)
    host         packing, block tables, the scheduler and the sampler stay on the host; one upload of
                 the batch's int32 metadata and one download per step: the logits [B, vocab] fp32, or for a
                 greedy step (forward_greedy) only B int32 token ids, each row's argmax picked on the device

Every step goes through an `ops` object, one interface over two array modules: `DeviceOps` launches the
kernels on CuPy arrays; `CPUOps` does the same steps with the CPU engine's own functions (layers.rmsnorm,
linear, RoPE, PagedKVCache.write/read, grouped_attention) on NumPy arrays, so this very forward pass
runs on the CPU over a CPU Transformer and checks the plumbing (packing, slots, block tables,
positions) against the CPU engine's BatchedRunner, without a GPU. The kernels' NumPy references are
in dev/paged_attention.py. `GPUBatching` is how the Engine gets this runner and its pool (llm.py hands it over).

Decode steps as CUDA graphs: a step whose chunks are all single decode tokens is padded to a bucket of
batch sizes (GRAPH_BUCKETS) and replays that bucket's graph, captured on first use: embed -> layers ->
final norm -> LM head over static buffers (StepBuffers), the metadata uploaded into a static int32 buffer
whose block tables have a fixed width (the most blocks a sequence can have). Padded rows get slot -1 (the
KV write kernels skip negative slots, so they touch no real block) and their logits stay on the device.
The graph ends with argmax_rows (kernels/sampling.cu) over every row into a static ids buffer, so a greedy step
copies back B int32 and a sampled step B logit rows, from the one replay (the argmax is a few µs of the step).
GEMMs inside the capture go through cublas_raw (CuPy refuses cuBLAS under capture). Prefill and mixed steps
run eagerly (their shapes vary), as does everything when use_graph is off or a capture failed (graph_error).

Attention: "head" (paged_attention, a block per query head: a GQA group's heads re-read each K/V row from
L2) or "group" (paged_attention_g{G}: a block per KV head serves its G query heads from one read). A step
with prompt chunks may instead run paged_prefill_attention_mma (prefill_attention_mma.cu: every chunk in one
launch on the tensor cores, K/V tiles through the block tables; prefill="mma", 16-bit pool, head_dim 64 or
128): the paged kernels score each prompt row's keys one at a time, which made them about half of a long
prefill step (lessons/BENCHMARKS.md, "Serving many users"). The engine's default (GPUBatching);
GPUBatching(model, prefill="paged") goes back to the paged kernels.

Greedy sampling on the device: forward_greedy(chunks) -> int32 [B], np.argmax of each chunk's logits row
exactly (the first maximum; a row's first NaN if it has one), picked by argmax_rows after the eager LM head
or inside the graph; the Engine takes it when every request of a step is greedy. Not here yet: sampling
with a temperature on the device (those steps still copy the logits back); graphs for prefill chunks.
"""
from __future__ import annotations

import contextlib
import gc
import math
import weakref
from dataclasses import dataclass

import numpy as np

from minillm.backend import as_f32
from minillm.cuda.batch_meta import (GRAPH_BUCKETS, BatchMeta, batch_meta, bucket_for,  # noqa: F401 (re-exported)
                                     decode_meta_into, meta_size, meta_views)
from minillm.cuda.kernels import MM_ROWS, MM_THREADS
from minillm.cuda.paged_pool import DevicePagedKV
from minillm.engine.batched import SeqChunk
from minillm.errors import MiniLLMError
from minillm.engine.paged_kv import PagedKVCache, first_needed_block
from minillm.model.attention import grouped_attention
from minillm.model.layers import apply_rope, linear, rmsnorm, rope_tables, silu

PA_WARPS, PA_MAX_HD = 4, 256            # as #defined in paged_attention.cu
PA_GROUPS = (1, 2, 4, 8)                # GQA group sizes paged_attention_g{G} is compiled for
PREFILL_KERNELS = ("paged", "mma")      # a prefill step's attention: the paged kernels, or the tensor-core one
ARGMAX_THREADS = 1024                   # argmax_rows' block (sampling.cu: one block per row)


def _cp():
    import cupy
    return cupy


@dataclass
class StepBuffers:
    """A forward pass's activations, allocated before a capture so the graph's pointers stay valid
    (the eager path passes NO_BUFFERS: every op allocates its own output)."""
    x: object = None        # [R, dim]         fp32 residual stream
    h: object = None        # [R, dim]         16-bit, normalized
    qkv: object = None      # [R, qkv_width]   fp32
    attn: object = None     # [R, n_heads*hd]  fp32
    attn16: object = None   # [R, n_heads*hd]  16-bit
    gu: object = None       # [R, 2*ffn]       fp32
    act: object = None      # [R, ffn]         16-bit
    logits: object = None   # [R, vocab]       fp32
    ids: object = None      # [R]              int32, each row's argmax (greedy steps copy back only these)

    @classmethod
    def allocate(cls, ops, config, rows: int) -> "StepBuffers":
        c, hd = config, config.head_dim
        f32, narrow = ops.zeros_f32, ops.zeros_narrow
        return cls(f32((rows, c.dim)), narrow((rows, c.dim)), f32((rows, (c.n_heads + 2 * c.n_kv_heads) * hd)),
                   f32((rows, c.n_heads * hd)), narrow((rows, c.n_heads * hd)), f32((rows, 2 * c.ffn_dim)),
                   narrow((rows, c.ffn_dim)), f32((rows, c.vocab_size)), ops.zeros_i32(rows))


NO_BUFFERS = StepBuffers()


@dataclass
class DecodeGraph:
    """One bucket's captured decode step: replay() runs it over `meta` (upload into it first), -> logits, ids."""
    replay: object          # () -> (logits [bucket, vocab] fp32, ids [bucket] int32) on the device (its buffers)
    host: np.ndarray        # [meta_size] int32 host staging (pinned on the device)
    flat: object            # [meta_size] int32: the metadata the graph reads
    buffers: StepBuffers


class GPUBatchedRunner:
    """Runs a GPUTransformer's weights over many sequences at once, their KV in a DevicePagedKV.
    Same contract as batched.BatchedRunner: forward(chunks) -> logits [B, vocab] fp32 on the host.

    A decode-only step (every chunk one token) replays a CUDA graph captured once per bucket of batch sizes
    (GRAPH_BUCKETS), the batch padded to its bucket; mixed and prefill steps run eagerly. use_graph=False
    (or a failed capture: graph_error says why) runs every step eagerly."""

    def __init__(self, model, pool: DevicePagedKV, ops=None, use_graph: bool | None = None,
                 attention: str = "head", prefill: str = "paged"):
        """ops: DeviceOps(model, pool) by default; CPUOps(model, pool) runs it over a CPU Transformer and a
        PagedKVCache. use_graph: default the model's own (GPUTransformer.use_graph; off for a CPU model).
        attention: "head" (a block per query head) or "group" (a block per GQA group: each K/V row read once).
        prefill: "paged" or "mma", the attention of steps with prompt chunks (DeviceOps)."""
        c = model.config
        if c.head_dim > PA_MAX_HD or c.n_heads % c.n_kv_heads:
            raise ValueError(f"paged attention needs head_dim <= {PA_MAX_HD} and n_heads % n_kv_heads == 0")
        self.model, self.pool = model, pool
        self.ops = ops or DeviceOps(model, pool, attention=attention, prefill=prefill)
        self.use_graph = getattr(model, "use_graph", False) if use_graph is None else use_graph
        # the widest block table a sequence can need: the graphs' tables have this many columns
        self.table_width = min(-(-c.max_seq_len // pool.block_size), pool.num_blocks)
        # bucket -> DecodeGraph. A DevicePagedKV keeps them, per model and attention kernel: captured over its
        # arrays, they serve whichever runner recycles those (GPUBatching.new_pool)
        shared = getattr(pool, "decode_graphs", None)
        self.graphs: dict[int, DecodeGraph] = ({} if shared is None else
                                               shared.setdefault((model, getattr(self.ops, "group", None)), {}))
        self.graph_error = None          # why a decode step could not be captured (then steps run eagerly)

    def forward(self, chunks: list[SeqChunk], all_logits: bool = False, rows=None) -> np.ndarray:
        """Run every chunk; -> logits [len(chunks), vocab] at each chunk's last token (all_logits:
        [N, vocab], every token, in chunk order; rows: those rows of the N). Host fp32."""
        if not all_logits and rows is None and self._graphable(chunks):
            return self.forward_graph(chunks)
        with self.ops.stream():
            return self.ops.download(self._eager(chunks, all_logits, rows))              # [B or N, vocab] host

    def forward_greedy(self, chunks: list[SeqChunk]) -> np.ndarray:
        """Run every chunk; -> int32 [len(chunks)] on the host: each chunk's next token by greedy sampling,
        np.argmax of the row forward() would return, picked on the device so only these ids come back."""
        if self._graphable(chunks):
            return self.forward_graph(chunks, greedy=True)
        with self.ops.stream():
            return self.ops.download(self.ops.argmax(self._eager(chunks)))                # [B] host

    def _eager(self, chunks: list[SeqChunk], all_logits: bool = False, rows=None):
        """The step without a graph (inside ops.stream()); -> logits [B or N, vocab] fp32 on the device."""
        ops = self.ops
        meta = batch_meta(chunks, self.pool.block_size, ops.upload)
        x = self._layers(meta, ops.embed(meta.tokens))                                   # [N, dim] fp32
        if rows is not None:
            x = x[ops.upload(np.asarray(rows, np.int32))]                                # [len(rows), dim]
        elif not all_logits:
            x = x[meta.last_rows]                                                         # [B, dim]
        return ops.logits(x)

    def _layers(self, meta: BatchMeta, x, buf: StepBuffers = NO_BUFFERS):
        """Every layer over the packed rows, x [N, dim] fp32 updated in place; buf: preallocated outputs."""
        ops = self.ops
        for i, layer in enumerate(self.model.layers):
            h = ops.rmsnorm(x, layer.attn_norm, out=buf.h)                                # [N, dim] 16-bit
            qkv = ops.gemm(h, layer.wqkv, out=buf.qkv)                                    # [N, qkv_width] fp32
            ops.rope(qkv, meta.positions)                                                 # q and k heads, in place
            ops.kv_write(i, qkv, meta)                                                    # new K/V into their slots
            attn = ops.attention(i, qkv, meta, out=buf.attn)                              # [N, n_heads * hd] fp32
            ops.gemm(ops.cast(attn, out=buf.attn16), layer.wo, out=x, accumulate=True)    # x += o_proj(attn)
            h = ops.rmsnorm(x, layer.mlp_norm, out=buf.h)                                 # [N, dim] 16-bit
            gu = ops.gemm(h, layer.w_gate_up, out=buf.gu)                                 # [N, 2 * ffn] fp32
            ops.gemm(ops.swiglu(gu, out=buf.act), layer.w_down, out=x, accumulate=True)   # x += down(act)
        return x

    # ---- decode steps as CUDA graphs, one per bucket of batch sizes ------------------------------------
    def _graphable(self, chunks: list[SeqChunk]) -> bool:
        return (self.use_graph and self.graph_error is None and bucket_for(len(chunks)) is not None
                and all(len(c.token_ids) == 1 for c in chunks)
                and max(c.end for c in chunks) <= self.table_width * self.pool.block_size)

    def forward_graph(self, chunks: list[SeqChunk], greedy: bool = False) -> np.ndarray:
        """A decode-only step by its bucket's graph (captured on first use; eager if that fails).
        -> logits [B, vocab] fp32 on the host, only the real rows copied back; greedy: their argmax,
        int32 [B] (the graph computed every row's; the padded rows' stay on the device)."""
        B, bucket = len(chunks), bucket_for(len(chunks))
        g = self.graph_for(bucket)
        if g is None:                                        # graph_error is set: eager from now on
            return self.forward_greedy(chunks) if greedy else self.forward(chunks)
        with self.ops.stream():
            decode_meta_into(g.host, chunks, self.pool.block_size, bucket, self.table_width)
            self.ops.copy_in(g.flat, g.host)
            logits, ids = g.replay()                                      # [bucket, vocab] fp32, [bucket] int32
            return self.ops.download(ids[:B] if greedy else logits[:B])   # [B] int32 or [B, vocab] fp32, host

    def capture_buckets(self, max_batch: int) -> None:
        """Capture every bucket up to max_batch rows now rather than on first use (a benchmark's warm-up)."""
        top = bucket_for(max_batch) or GRAPH_BUCKETS[-1]
        for bucket in GRAPH_BUCKETS:
            if not self.use_graph or bucket > top or self.graph_for(bucket) is None:
                return

    def graph_for(self, bucket: int) -> DecodeGraph | None:
        """The bucket's DecodeGraph, captured on first use (None if the capture failed: graph_error says why)."""
        if bucket not in self.graphs:
            ops, width = self.ops, self.table_width
            host = ops.host_i32(meta_size(bucket, width))
            decode_meta_into(host, [], self.pool.block_size, bucket, width)   # every row padded: slot -1
            with ops.stream():
                # allocated on the model's stream: its zero-fills come before the upload below. On the default
                # stream (which a non-blocking stream does not wait for) a late fill could zero `flat` after the
                # upload, and the warm-up step would write row 0's K/V into slot 0 of a live block
                flat = ops.zeros_i32(meta_size(bucket, width))
                buf = StepBuffers.allocate(ops, self.model.config, bucket)
                meta = meta_views(flat, bucket, width)

                def step():                                  # embed -> layers -> final norm + LM head -> argmax
                    x = self._layers(meta, ops.embed(meta.tokens, out=buf.x), buf)
                    logits = ops.logits(x, out=buf.logits, norm_out=buf.h)  # h is free by now
                    return logits, ops.argmax(logits, out=buf.ids)
                ops.copy_in(flat, host)
                step()           # once eagerly, writing no KV: modules and cuBLAS kernels load outside the capture
                ops.synchronize()                # and the pinned `host` is free to rewrite
                replay, error = ops.capture(step)
            if error is not None:
                self.graph_error = error
                return None
            self.graphs[bucket] = DecodeGraph(replay, host, flat, buf)
        return self.graphs[bucket]


class DeviceOps:
    """The forward pass's steps as launches on the model's stream: minillm.cuda.kernels for what the
    single-sequence path already has, paged_attention.cu for the three paged steps, cuBLAS for GEMMs.
    kv_write and attention take a layer of `pool` (a DevicePagedKV); write_kv and attend, any pool arrays."""

    def __init__(self, model, pool: DevicePagedKV | None = None, attention: str = "head", prefill: str = "paged"):
        """attention: "head", paged_attention (a block per query row and head), or "group",
        paged_attention_group (a block per query row and KV head: the GQA group's heads share each K/V read).
        prefill: "paged" (those kernels for every step) or "mma": a step with a chunk of more than one row, over
        a 16-bit pool with head_dim 64 or 128, runs paged_prefill_attention_mma for all its rows instead."""
        from minillm.cuda.kernels import module, suffix
        from minillm.cuda.gpu_kv_cache import device_dtype
        cp = _cp()
        if attention not in ("head", "group"):
            raise ValueError(f"attention is 'head' or 'group', not {attention!r}")
        if prefill not in PREFILL_KERNELS:
            raise ValueError(f"prefill is 'paged' or 'mma', not {prefill!r}")
        self.xp, self.model, self.k, self.pool = cp, model, model.k, pool
        self.narrow = device_dtype(model.dtype)
        c = model.config
        group = c.n_heads // c.n_kv_heads
        # the group kernel is compiled for groups of 1, 2, 4 and 8 query heads; others use the per-head one
        self.group = group if attention == "group" and group in PA_GROUPS else None
        sfx = suffix(model.dtype)
        mod = module("paged_attention")
        self.fn = {"attention": mod.get_function(f"paged_attention_{sfx}"),
                   "kv_write": mod.get_function(f"paged_kv_write_{sfx}"),
                   "attention_int8": mod.get_function("paged_attention_int8"),      # over the int8 pool
                   "kv_write_int8": mod.get_function("paged_kv_write_int8"),
                   "rope": mod.get_function("rope_at_positions")}
        if self.group:
            self.fn["attention"] = mod.get_function(f"paged_attention_g{self.group}_{sfx}")
            self.fn["attention_int8"] = mod.get_function(f"paged_attention_g{self.group}_int8")
        self.fn["argmax"] = module("sampling").get_function("argmax_rows")             # greedy steps' pick
        if prefill == "mma" and c.head_dim in (64, 128):           # the head sizes it is compiled for
            mma = module("prefill_attention_mma")
            self.fn["prefill"] = mma.get_function(f"paged_prefill_attention_mma_hd{c.head_dim}_{sfx}")

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
        """out [N, rows] fp32 (+)= a [N, in] 16-bit @ w [rows, in]ᵀ (GPUTransformer.gemm: cuBLAS, fp32 accumulate;
        a tensor-core small-M kernel measured slower at these shapes: lessons/BENCHMARKS.md)"""
        if out is None:
            out = self.xp.empty((a.shape[0], w.shape[0]), self.xp.float32)
        self.model.gemm(a, w, out, accumulate)
        return out

    def rope(self, qkv, positions) -> None:
        c = self.model.config
        self.fn["rope"]((qkv.shape[0], c.n_heads + c.n_kv_heads), (c.head_dim // 2,),
                        (qkv, np.int32(qkv.shape[1]), np.int32(c.head_dim), positions, self.model.inv_freq))

    def kv_write(self, layer: int, qkv, meta: BatchMeta) -> None:
        """Layer `layer`'s new keys and values (rows of qkv [N, width]) into their slots of the pool."""
        k_pool, v_pool, scales = self.pool.layer(layer)
        self.write_kv(qkv, meta.slots, k_pool, v_pool, scales)

    def attention(self, layer: int, qkv, meta: BatchMeta, out=None):
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

    def attend(self, qkv, k_pool, v_pool, meta: BatchMeta, out=None, scales=None):
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

    def _attend_prefill(self, qkv, k_pool, v_pool, meta: BatchMeta, out):
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

    def argmax(self, logits, out=None):
        """Each row's argmax as np.argmax picks it (the first maximum; the first NaN in a row with one):
        logits [rows, vocab] fp32 -> int32 [rows] on the device (into out if given). kernels/sampling.cu."""
        rows, vocab = logits.shape
        out = self.xp.empty(rows, self.xp.int32) if out is None else out
        if rows:
            self.fn["argmax"]((rows,), (ARGMAX_THREADS,), (logits, np.int32(vocab), out))
        return out

    def synchronize(self) -> None:
        self.model.stream.synchronize()

    def download(self, a) -> np.ndarray:
        """The one device-to-host copy of the step (then wait for it), into pinned memory: logits [64, 32000]
        fp32 are 8 MB, which a pageable copy moves several times slower (staged by the driver); a greedy step's
        ids, int32 [64], are 256 bytes. A new array each step (CuPy's pinned pool recycles the memory), so a
        caller may keep it."""
        import cupyx
        host = cupyx.empty_pinned(a.shape, a.dtype)
        a.get(out=host)
        self.model.stream.synchronize()
        return host

    def capture(self, step):
        """step()'s launches captured as a CUDA graph on the model's stream (GPUTransformer.capture_with_cublas:
        its GEMMs through cublas_raw). -> (replay, None), replay() launching it and returning step()'s result,
        or (None, the reason) when capturing failed."""
        graph, result, error = self.model.capture_with_cublas(step)
        if error is not None:
            return None, error
        stream = self.model.stream

        def replay():
            graph.launch(stream)
            return result
        return replay, None


class CPUOps:
    """DeviceOps' interface done by the CPU engine's own functions on NumPy arrays, over a CPU Transformer
    (fused q|k|v and gate|up) and its paged pool (a PagedKVCache): the same steps, fp32 throughout, so
    GPUBatchedRunner's forward over these equals the CPU engine's BatchedRunner up to summation order."""
    xp = np

    def __init__(self, model, pool: PagedKVCache):
        self.model, self.pool, self.config = model, pool, model.config

    def stream(self):
        return contextlib.nullcontext()

    def upload(self, a: np.ndarray) -> np.ndarray:
        return a

    def zeros_f32(self, shape):
        return np.zeros(shape, np.float32)

    zeros_narrow = zeros_f32                     # fp32 throughout

    def zeros_i32(self, n: int):
        return np.zeros(n, np.int32)

    host_i32 = zeros_i32

    def copy_in(self, dst, host: np.ndarray) -> None:
        dst[...] = host

    def capture(self, step):
        """No graphs on the host: the "replay" reruns step(), which reads the same static buffers a graph
        would, so the bucket and padding logic runs here as on the device."""
        return step, None

    def embed(self, tokens, out=None):
        return as_f32(self.model.embed[tokens])                                            # [N, dim]

    def rmsnorm(self, x, gain, out=None):
        return rmsnorm(x, gain, self.config.norm_eps)

    def gemm(self, a, w, out=None, accumulate: bool = False):
        y = linear(a, w)                                                                   # [N, rows]
        if out is None:
            return y
        if accumulate:
            out += y
        else:
            out[...] = y
        return out

    def rope(self, qkv, positions) -> None:
        c = self.config
        cos, sin = rope_tables(positions, self.model.inv_freq)                             # [N, hd/2] each
        width = (c.n_heads + c.n_kv_heads) * c.head_dim
        heads = qkv[:, :width].reshape(len(qkv), c.n_heads + c.n_kv_heads, c.head_dim)    # [N, H + n_kv, hd]
        qkv[:, :width] = apply_rope(heads, cos, sin).reshape(len(qkv), width)

    def _kv(self, qkv):
        """The k and v heads of each row.   qkv [N, width] -> k, v [N, n_kv, hd]"""
        c = self.config
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        shape = (len(qkv), c.n_kv_heads, c.head_dim)
        return qkv[:, nq:nq + nkv].reshape(shape), qkv[:, nq + nkv:nq + 2 * nkv].reshape(shape)

    def kv_write(self, layer: int, qkv, meta: BatchMeta) -> None:
        """As the kernels: a row whose slot is negative (a padded row) writes nothing."""
        slots = np.asarray(meta.slots, dtype=np.int64)
        real = slots >= 0
        k, v = self._kv(qkv)
        self.pool.write(layer, slots[real] // self.pool.block_size, slots[real] % self.pool.block_size, k[real],
                        v[real])

    def attention(self, layer: int, qkv, meta: BatchMeta, out=None):
        """Each sequence's rows against its keys, read through its block table as the CPU engine reads them."""
        c, bs = self.config, self.pool.block_size
        q = qkv[:, :c.n_heads * c.head_dim].reshape(len(qkv), c.n_heads, c.head_dim)     # [N, H, hd]
        out = np.empty((len(qkv), c.n_heads * c.head_dim), np.float32) if out is None else out
        for b, table in enumerate(np.asarray(meta.block_tables).tolist()):
            rows = np.flatnonzero(np.asarray(meta.seq_of_row) == b)
            start, end = int(meta.positions[rows[0]]), int(meta.positions[rows[-1]]) + 1
            first = first_needed_block(start, c.sliding_window, bs)
            keys, values = self.pool.read(layer, table, end, first)                       # [n_kv, L, hd] each
            out[rows] = grouped_attention(q[rows], keys, values, c.sliding_window)
        return out

    def cast(self, x, out=None):
        return x

    def swiglu(self, gu, out=None):
        ffn = gu.shape[1] // 2
        return silu(gu[:, :ffn]) * gu[:, ffn:]                                             # [N, ffn]

    def logits(self, x, out=None, norm_out=None):
        return self.model.head(x)                                                          # [rows, vocab]

    def synchronize(self) -> None:
        pass

    def argmax(self, logits, out=None):
        """np.argmax of each row (what argmax_rows computes).   logits [rows, vocab] -> int32 [rows]"""
        ids = np.argmax(logits, axis=-1).astype(np.int32)
        if out is None:
            return ids
        out[:len(ids)] = ids
        return out

    def download(self, a) -> np.ndarray:
        return np.array(a)                                                                 # a copy, as .get()


class GPUBatching:
    """How an Engine batches a GPUTransformer: its pool is a DevicePagedKV (16-bit, the weights' dtype, or
    int8) and its runner a GPUBatchedRunner. The same protocol as engine.batched.CPUBatching."""
    device = "cuda"
    default_kv_bytes = 8 << 30          # 64k tokens of a Mistral-7B (128 KB each)
    # tokens a step computes at most: prompt chunks of 2048 rows keep cuBLAS's GEMMs efficient and the eager
    # prefill steps few (64 prompts of 128: 4 steps, not 16 at the CPU's 512)
    default_batch_tokens = 2048
    cap_to_max_batch = True             # by default no more than max_batch full contexts (small models)

    def __init__(self, model, use_graph: bool | None = None, attention: str | None = None,
                 prefill: str | None = None):
        """use_graph: decode steps as bucket graphs (default: the model's use_graph); attention: "head" or
        "group" (default "group": faster, lessons/BENCHMARKS.md); prefill: "paged" or "mma" for steps with prompt
        chunks (default "mma": faster). A benchmark compares them by passing them (LLM(..., batching=...))."""
        self.model = model
        self._spares: dict[tuple, tuple] = {}     # (blocks, block_size, storage) -> (weakref to the pool, its arrays)
        self.use_graph = model.use_graph if use_graph is None else use_graph
        self.attention = attention or "group"
        if self.attention not in ("head", "group"):
            raise MiniLLMError(f"paged attention is 'head' or 'group', not {self.attention!r}")
        self.prefill = prefill or "mma"
        if self.prefill not in PREFILL_KERNELS:
            raise MiniLLMError(f"the prefill attention is 'paged' or 'mma', not {self.prefill!r}")

    def storage(self, kv_cache: str) -> str:
        """The pool's storage for a kv_cache format: int8 codes, or the weights' 16 bits for "auto"."""
        return "int8" if kv_cache == "int8" else self.model.dtype

    def bytes_per_block(self, config, block_size: int, kv_cache: str) -> int:
        return DevicePagedKV.bytes_per_block_for(config, block_size, self.storage(kv_cache))

    def new_pool(self, config, num_blocks: int, block_size: int, kv_cache: str) -> DevicePagedKV:
        """A pool; the device memory (and decode graphs) of an earlier one of the same geometry if its engine is
        gone: `minillm bench serve` builds an engine per run, and re-capturing every bucket (~0.1 s each) and
        re-zeroing gigabytes each time would be measured as serving time. One spare per geometry is kept."""
        key = (num_blocks, block_size, self.storage(kv_cache))
        spare = self._spares.get(key)
        if spare is not None and spare[0]() is not None:
            gc.collect()                     # an engine in a reference cycle may be unreachable but not yet freed
        if spare is not None and spare[0]() is None:
            pool = DevicePagedKV(config, num_blocks, block_size, key[2], arrays=spare[1])
        else:
            pool = DevicePagedKV(config, num_blocks, block_size, key[2])
        self._spares[key] = (weakref.ref(pool), pool.arrays())
        return pool

    def new_runner(self, pool: DevicePagedKV) -> GPUBatchedRunner:
        return GPUBatchedRunner(self.model, pool, use_graph=self.use_graph, attention=self.attention,
                                prefill=self.prefill)
