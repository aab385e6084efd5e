"""The GPU backend: what is GPU-specific and nothing else.

`kernels.py` compiles kernels/*.cu (NVRTC, through CuPy's RawModule) and wraps each launch;
`gpu_model.py` is the fast path for Llama-family models: cuBLAS prefill, and a decode step made only of
our kernels and preallocated buffers, captured once in a CUDA graph and replayed per token;
`gpu_kv_cache.py` holds its device caches and `qweights.py` its int8/int4 matrices (minillm.model.quant's
layout, read by kernels/gemv_quant.cu). `gpu_batched.py` is the engine's batched runner on the device
(the paged pool, paged attention) and `GPUBatching`, what `minillm.load` hands the Engine. Every model
without kernels (MLA) runs as the engine's own Transformer on CuPy arrays (`device_model.py`).
Each operation ships one kernel, the fastest measured, and a named fallback only for the shapes it cannot
take (kernels.py says which). Earlier versions, losing experiments and the measuring code (references,
checks, sweeps, benchmarks) live apart, in the laboratory `dev/` (its entry point `dev/lab.py`; nothing here
imports it); `python -m minillm.cuda.selfcheck` checks every kernel and times a 7B-shaped model. No
environment variable is read here: choices are constructor arguments.

Importing this package does not import CuPy; `available()` says whether a GPU can be used.
"""
from __future__ import annotations


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
