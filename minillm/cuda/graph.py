"""Capturing a stream's launches as a CUDA graph, in one place: the decode steps' graphs (gpu_model,
gpu_mla) and the dev timers' (dev.timing) are made by `capture`. (gpu_model's prefill-rows graph and the
batching engine's graphs try a capture that cuBLAS may refuse, and keep that error instead of raising it:
GPUTransformer.capture_with_cublas.)"""
from __future__ import annotations


def capture(stream, fn):
    """fn()'s launches on `stream` (a cupy.cuda.Stream), captured as a CUDA graph and not run: replay it
    with graph.launch(stream). The capture is ended even when fn raises: a stream left capturing would
    refuse every later launch."""
    stream.begin_capture()
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph
