"""The paged KV pool on the device: gpu_batched.py's blocks, in the CPU engine's PagedKVCache layout.

    k, v       [layers, blocks, block_size, n_kv_heads, hd], 16-bit (the weights' dtype), or int8 codes
    k_scale,   [layers, blocks, block_size, n_kv_heads] fp32 (the int8 pool only: paged_kv.PagedKVCache's
    v_scale    int8 format)

kernels/paged_attention.cu writes and reads it through each sequence's block table (GPUBatchedRunner);
PagedKVCache.read copies a sequence's positions back in fp32 (tests, debugging). With xp=numpy the same arrays
live on the host (the kernels' format checked without a GPU).
"""
from __future__ import annotations

import numpy as np

from minillm.engine.paged_kv import DEFAULT_BLOCK_SIZE, PagedKVCache
from minillm.model.kv_cache import int8_kv_bytes_per_token


def _cp():
    import cupy
    return cupy


class DevicePagedKV(PagedKVCache):
    """PagedKVCache's layout and `slots` in the model's 16 bits ("float16", "bfloat16" as uint16 bits) or "int8"
    (codes and an fp32 scale per position and KV head), on the device (or with xp=numpy on the host)."""

    def __init__(self, config, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "float16",
                 xp=None, arrays: dict | None = None):
        """arrays: another (dead) pool's `arrays()` of this geometry, taken over as they are (GPUBatching
        recycles them: stale values are harmless, a sequence reads only positions it wrote)."""
        xp = xp or _cp()
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.decode_graphs: dict = {}    # bucket -> DecodeGraph over these arrays (GPUBatchedRunner fills it)
        if arrays is not None:
            self.__dict__.update(arrays)
            return
        storage = {"float16": xp.float16, "bfloat16": xp.uint16, "int8": xp.int8}[dtype]
        self.k = xp.zeros(shape, dtype=storage)          # [layers, blocks, bs, n_kv, hd]
        self.v = xp.zeros(shape, dtype=storage)
        if dtype == "int8":
            self.k_scale = xp.zeros(shape[:4], dtype=xp.float32)       # [layers, blocks, bs, n_kv]
            self.v_scale = xp.zeros(shape[:4], dtype=xp.float32)
        if xp is not np:     # the fill ran on the current stream; the model's stream does not wait for it
            xp.cuda.Device().synchronize()

    def arrays(self) -> dict:
        """The device memory another pool of this geometry can take over, with the graphs captured over it."""
        names = ("k", "v", "k_scale", "v_scale", "decode_graphs")
        return {name: getattr(self, name) for name in names if hasattr(self, name)}

    @staticmethod
    def bytes_per_block_for(config, block_size: int, dtype: str = "float16") -> int:
        """Keys + values of one block, every layer (2 bytes a value, or 1 and a 4-byte scale a vector for
        int8): to size a pool before allocating it."""
        return block_size * (int8_kv_bytes_per_token(config) if dtype == "int8" else config.kv_bytes_per_token(2))

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.dtype == "int8" else 0
        return self.k.nbytes + self.v.nbytes + scales

    def layer(self, i: int) -> tuple:
        """One layer's pool for the kernels: (k, v, scales), scales = (k_scale, v_scale) or None (16-bit)."""
        return self.k[i], self.v[i], ((self.k_scale[i], self.v_scale[i]) if self.dtype == "int8" else None)

    def write(self, *args, **kw):
        raise NotImplementedError("the device pool is written by paged_kv_write (GPUBatchedRunner)")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """PagedKVCache.copy_blocks on the device. It runs on the current stream, which the model's stream
        does not wait for: synchronize, so the copies land before the next step reads the blocks."""
        super().copy_blocks(pairs)
        if pairs and not isinstance(self.k, np.ndarray):
            _cp().cuda.Device().synchronize()
