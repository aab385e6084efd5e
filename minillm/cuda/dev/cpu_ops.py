"""The GPU layer loop's ops done by the CPU engine's own functions on NumPy arrays: forward.run_layers and the
batching runner (gpu_batched.GPUBatchedRunner) run over a CPU Transformer and its PagedKVCache with these, so
their plumbing (packing, slots, block tables, positions, graph buckets and padding) is checked without a GPU.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minillm.backend import as_f32
from minillm.cuda.batch_meta import BatchMeta
from minillm.engine.paged_kv import PagedKVCache, first_needed_block
from minillm.model.attention import grouped_attention
from minillm.model.layers import apply_rope, linear, rmsnorm, rope_tables, silu


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

    def rope(self, qkv, meta) -> None:
        c = self.config
        cos, sin = rope_tables(meta.positions, self.model.inv_freq)                             # [N, hd/2] each
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
