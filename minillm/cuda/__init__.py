"""The GPU backend: CuPy glue around the hand-written kernels in `kernels/*.cu`.

`kernels.py` compiles the sources (NVRTC, through CuPy's RawModule) and wraps each launch;
`gpu_model.py` is the Transformer on the device: cuBLAS prefill, and a decode step made only of
our kernels and preallocated buffers, so it can be captured once in a CUDA graph and replayed
per token. `qweights.py` holds int8/int4 matrices on the device (minillm.model.quant's layout, read by
kernels/gemv_quant.cu); `qbench.py` times them (`minillm bench --device cuda --quant ...`).
`python -m minillm.cuda.selfcheck` checks every kernel and times a 7B-shaped model.

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
