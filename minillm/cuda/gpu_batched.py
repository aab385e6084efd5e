"""Batched execution on the GPU: many sequences' new tokens (prompt chunks and decode tokens) in one step.

minillm.engine.batched's plan on the device: every sequence's new tokens packed into one matrix [N, dim] through
forward.run_layers, so each projection is one GEMM over all N rows (B sequences read each weight once, not B
times: batching's whole gain) and attention one launch a layer, each row reading its sequence's keys through its
block table. The weights are GPUTransformer's own; the pool a DevicePagedKV (paged_pool.py, 16-bit or int8); the
metadata a BatchMeta (batch_meta.py). Packing, the scheduler and the sampler stay on the host: one upload of the
step's int32 metadata, one download of the logits [B, vocab] (a greedy step: B token ids, argmax on the device).

A decode-only step is padded to a bucket of batch sizes (GRAPH_BUCKETS) and replays that bucket's CUDA graph,
captured on first use over static buffers; padded rows get slot -1 (the KV write kernels skip them). Steps with
prompt chunks run eagerly (their shapes vary), as does every step when use_graph is off or a capture failed
(graph_error says why). `GPUBatching` is how the Engine gets this runner and its pool.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import numpy as np

from minillm.cuda.batch_meta import (GRAPH_BUCKETS, batch_meta, bucket_for,  # noqa: F401 (re-exported)
                                     decode_meta_into, meta_size, meta_views)
from minillm.cuda.forward import DeviceOps, StepBuffers, run_layers
from minillm.cuda.paged_pool import DevicePagedKV
from minillm.engine.batched import SeqChunk


@dataclass
class DecodeGraph:
    """One bucket's captured decode step: replay() runs it over `meta` (upload into it first), -> logits, ids."""
    replay: object          # () -> (logits [bucket, vocab] fp32, ids [bucket] int32) on the device (its buffers)
    host: np.ndarray        # [meta_size] int32 host staging (pinned on the device)
    flat: object            # [meta_size] int32: the metadata the graph reads
    buffers: StepBuffers


class GPUBatchedRunner:
    """A GPUTransformer's weights over many sequences at once, their KV in a DevicePagedKV: batched.BatchedRunner's
    contract, forward(chunks) -> logits [B, vocab] fp32 on the host."""

    def __init__(self, model, pool: DevicePagedKV, ops=None, use_graph: bool | None = None):
        """ops: DeviceOps(model, pool) by default (tests pass one that runs the same steps on NumPy).
        use_graph: default the model's own (GPUTransformer.use_graph; off for a CPU model)."""
        c = model.config
        self.model, self.pool = model, pool
        self.ops = ops or DeviceOps(model, pool)
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
        x = run_layers(ops, self.model.layers, meta, ops.embed(meta.tokens))                  # [N, dim] fp32
        if rows is not None:
            x = x[ops.upload(np.asarray(rows, np.int32))]                                # [len(rows), dim]
        elif not all_logits:
            x = x[meta.last_rows]                                                         # [B, dim]
        return ops.logits(x)

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
                    x = run_layers(ops, self.model.layers, meta, ops.embed(meta.tokens, out=buf.x), buf)
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



class GPUBatching:
    """How an Engine batches a GPUTransformer: its pool is a DevicePagedKV (16-bit, the weights' dtype, or
    int8) and its runner a GPUBatchedRunner. The same protocol as engine.batched.CPUBatching."""
    device = "cuda"
    default_kv_bytes = 8 << 30          # 64k tokens of a Mistral-7B (128 KB each)
    # tokens a step computes at most: prompt chunks of 2048 rows keep cuBLAS's GEMMs efficient and the eager
    # prefill steps few (64 prompts of 128: 4 steps, not 16 at the CPU's 512)
    default_batch_tokens = 2048
    cap_to_max_batch = True             # by default no more than max_batch full contexts (small models)

    def __init__(self, model, use_graph: bool | None = None):
        """use_graph: decode steps as bucket graphs (default: the model's use_graph)."""
        self.model = model
        self._spares: dict[tuple, tuple] = {}     # (blocks, block_size, storage) -> (weakref to the pool, its arrays)
        self.use_graph = model.use_graph if use_graph is None else use_graph

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
        return GPUBatchedRunner(self.model, pool, use_graph=self.use_graph)

