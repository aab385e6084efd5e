"""The one GPU timer (CUDA events: time_gpu, graph_us inside a graph, EventTimer per launch), the one bandwidth
probe (copy_bandwidth, the memory roofline) and a model's decode and prefill measures (decode_bytes, prefill_ttft,
decode_tok_s): `minillm bench --device cuda`, the selfcheck, the lessons and every dev module time with these.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from minillm.cuda.graph import capture

BANDWIDTH: dict[str, float] = {}


def time_gpu(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() on the current stream, by CUDA events."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(cp.cuda.get_current_stream())        # explicit: record() alone may mean the null stream
        fn()
        end.record(cp.cuda.get_current_stream())
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def graph_us(fn, n: int, reps: int = 5) -> float:
    """µs per call of fn(i), i = 0 .. n-1, captured as one CUDA graph and replayed (median of `reps`): no
    host launch cost, the gaps between dependent kernels stay, as in the decode step's own graph."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn(0)                                               # load / warm outside the capture
        graph = capture(stream, lambda: [fn(i) for i in range(n)])
        ms = time_gpu(lambda: graph.launch(stream), reps)
    return ms * 1e3 / n


class EventTimer:
    """Kernels.timer: CUDA events around every launch, summed per kernel name."""

    def __init__(self):
        self.records = []

    def __call__(self, name, launch):
        import cupy as cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(cp.cuda.get_current_stream())
        launch()
        end.record(cp.cuda.get_current_stream())
        self.records.append((name, start, end))

    def totals(self) -> dict[str, tuple[int, float]]:
        import cupy as cp
        self.records[-1][2].synchronize()
        out: dict[str, list] = {}
        for name, s, e in self.records:
            n, ms = out.get(name, (0, 0.0))
            out[name] = (n + 1, ms + cp.cuda.get_elapsed_time(s, e))
        return out


def device_name() -> str:
    """The current GPU as its driver names it ("NVIDIA H200", "NVIDIA H100 80GB HBM3")."""
    import cupy as cp
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (the memory roofline)."""
    import cupy as cp
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    ms = time_gpu(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                      cp.cuda.runtime.memcpyDeviceToDevice,
                                                      cp.cuda.get_current_stream().ptr), reps=10)
    return 2 * nbytes / (ms / 1e3)


def decode_bytes(cfg, weight_bytes: int, prompt_len: int, n_new: int) -> tuple[float, float]:
    """(bytes a decode token reads, the 16-bit KV cache's share), at the mean context of n_new after prompt_len."""
    kv_read = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2 * (prompt_len + n_new / 2)
    return weight_bytes + kv_read, kv_read


def prefill_ttft(gpu, cache, prompt, repeats: int = 3) -> float:
    """Seconds to prefill `prompt` into an emptied cache, host logits included: median of `repeats` after a warm-up."""
    times = []
    for _ in range(repeats + 1):
        cache.reset()
        start = time.perf_counter()
        gpu.prefill(prompt, cache)                         # returns host logits: includes the copy back
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def decode_tok_s(gpu, cache, prompt, n_new: int) -> tuple[float, list[int]]:
    """(tok/s, tokens) of n_new greedy steps after `prompt`, host argmax each step; a warm-up run first (it also
    recaptures the cache's graph for the model's settings)."""
    for attempt in ("warm-up", "timed"):
        cache.reset()
        cache.graph = None if attempt == "warm-up" else cache.graph
        logits = gpu.prefill(prompt, cache)
        tokens = []
        start = time.perf_counter()
        for _ in range(n_new):
            tokens.append(int(np.argmax(logits)))
            logits = gpu.decode(tokens[-1], cache)
        elapsed = time.perf_counter() - start
    return n_new / elapsed, tokens
