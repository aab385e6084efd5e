"""The decode KV cache on the device, one per sequence: 16-bit (the weights' fp16 or bf16) or int8.

    cache = gpu.new_cache(4096)           # GPUKVCache: k, v [n_layers, n_kv_heads, capacity, head_dim]

Contiguous (slot = position; a sliding window is a key range for the attention kernels), with the CPU caches'
contract (minillm.model.kv_cache: `length`, `advance`, `reset`, `end_of_write`, `nbytes`). It keeps the CUDA
graphs captured for it: a graph bakes in the cache's pointers.
"""
from __future__ import annotations

from minillm.model.config import ModelConfig
from minillm.model.kv_cache import CacheBase

DTYPES = ("float16", "bfloat16")
KV_CACHES = ("auto", "int8")     # "auto": the weight dtype (fp16 or bf16), the vocabulary of kv_cache.KV_CACHE_FORMATS


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
    """k, v [n_layers, n_kv_heads, capacity, head_dim] in `dtype`'s 16 bits, or (dtype "int8", kv_int8.cu) int8
    codes with a scale per vector, k_scale, v_scale fp32 [n_layers, n_kv_heads, capacity]."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: str):
        cp = _cp()
        shape = (config.n_layers, config.n_kv_heads, capacity, config.head_dim)
        storage = cp.int8 if dtype == "int8" else device_dtype(dtype)
        self.k, self.v = cp.zeros(shape, dtype=storage), cp.zeros(shape, dtype=storage)
        self.int8 = dtype == "int8"
        if self.int8:
            self.k_scale, self.v_scale = cp.zeros(shape[:3], cp.float32), cp.zeros(shape[:3], cp.float32)
        self.max_seq_len, self.length = capacity, 0
        self.graph = self.graph_key = None    # the decode graph, and the model and settings it was captured with
        self.rows_graphs = {}       # T -> a captured T-row forward (speculative decoding's verify pass; 16-bit only)
        self.rows_key = None        # the model and the settings those were captured with

    def clear(self, start: int, stop: int) -> None:
        """Zero positions start .. stop-1 of every layer (speculative decoding's rolled-back drafts), then wait:
        the zeroing runs on CuPy's current stream, which the model's own (non-blocking) stream does not wait on."""
        for a in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.int8 else ()):
            a[:, :, start:stop] = 0
        _cp().cuda.get_current_stream().synchronize()
