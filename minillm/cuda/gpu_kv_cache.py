"""The decode KV caches on the device, one per sequence: 16-bit (the weights' fp16 or bf16) or int8.

    cache = gpu.new_cache(4096)           # GPUKVCache, or GPUInt8KVCache for kv_cache="int8"

Both are contiguous (slot = position; a sliding window is a key range for the attention kernels) and
keep the CUDA graph captured for them: the graph bakes in the cache's pointers. Same contract as the
CPU caches (minillm.model.kv_cache): `length`, `advance`, `reset`, `end_of_write`, `nbytes`.
"""
from __future__ import annotations

from minillm.model.config import ModelConfig
from minillm.model.kv_cache import CacheBase

DTYPES = ("float16", "bfloat16")


def _cp():
    import cupy
    return cupy


def device_dtype(dtype: str):
    """How a 16-bit weight dtype is held in CuPy: fp16 as float16, bf16 as its raw uint16 bits."""
    cp = _cp()
    if dtype not in DTYPES:
        raise ValueError(f"GPU weights are float16 or bfloat16, not {dtype!r}")
    return cp.float16 if dtype == "float16" else cp.uint16


class GPUKVCache(CacheBase):
    """Contiguous 16-bit KV cache on the device: k, v [n_layers, n_kv_heads, capacity, head_dim].

    Same contract as kv_cache.KVCache (length, advance, reset); a sliding window is applied by the
    attention kernel as a key range. Holds the CUDA graph captured for it (the graph bakes in its
    pointers)."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: str):
        cp = _cp()
        shape = (config.n_layers, config.n_kv_heads, capacity, config.head_dim)
        self.k = cp.zeros(shape, dtype=device_dtype(dtype))
        self.v = cp.zeros(shape, dtype=device_dtype(dtype))
        self.max_seq_len = capacity
        self.length = 0
        self.graph = None
        self.graph_key = None       # the model and the settings the graph was captured with
        self.rows_graphs = {}       # T -> a captured T-row forward (speculative decoding's verify pass)
        self.rows_key = None        # the model and the settings those were captured with

    def clear(self, start: int, stop: int) -> None:
        """Zero positions start .. stop-1 of every layer (speculative decoding's rolled-back drafts)."""
        _zero_positions(start, stop, self.k, self.v)


class GPUInt8KVCache(CacheBase):
    """Contiguous int8 KV cache on the device (kv_int8.cu): k, v int8 [n_layers, n_kv_heads, capacity, hd]
    and a scale per vector, k_scale, v_scale fp32 [n_layers, n_kv_heads, capacity]. Same contract as
    GPUKVCache; its graph reads codes and scales."""

    def __init__(self, config: ModelConfig, capacity: int):
        cp = _cp()
        shape = (config.n_layers, config.n_kv_heads, capacity, config.head_dim)
        self.k = cp.zeros(shape, dtype=cp.int8)
        self.v = cp.zeros(shape, dtype=cp.int8)
        self.k_scale = cp.zeros(shape[:3], dtype=cp.float32)
        self.v_scale = cp.zeros(shape[:3], dtype=cp.float32)
        self.max_seq_len = capacity
        self.length = 0
        self.graph = None
        self.graph_key = None
        self.rows_graphs = {}       # (the int8 cache's verify pass runs eagerly: this stays empty)
        self.rows_key = None

    def clear(self, start: int, stop: int) -> None:
        """Zero positions start .. stop-1 of every layer: codes and scales."""
        _zero_positions(start, stop, self.k, self.v, self.k_scale, self.v_scale)


def _zero_positions(start: int, stop: int, *arrays) -> None:
    """arrays [n_layers, n_kv_heads, capacity, ...]: zero the positions start .. stop-1, then wait for it.
    The zeroing runs on CuPy's current stream and the model's kernels on the model's own (non-blocking)
    stream, which does not wait on it: the synchronize keeps a later step from overtaking the zeros."""
    for a in arrays:
        a[:, :, start:stop] = 0
    _cp().cuda.get_current_stream().synchronize()


KV_CACHES = ("auto", "int8")     # "auto": the weight dtype (fp16 or bf16), the vocabulary of kv_cache.KV_CACHE_FORMATS
