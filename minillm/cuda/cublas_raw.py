"""cuBLAS's GemmEx called through ctypes, for GEMMs inside a CUDA-graph capture.

cuBLAS supports stream capture, but CuPy's binding refuses every cuBLAS call while a stream is captured
(NotImplementedError, CuPy 14.2). So the captured forwards (gpu_model's verify pass, the batching engine's decode
steps) call the libcublas CuPy loaded (found in /proc/self/maps: one library, one handle) directly, its workspace
set once before any capture to a buffer that lives as long as the process: a capture must not allocate.
"""
from __future__ import annotations

import ctypes

WORKSPACE_BYTES = 32 << 20          # cuBLAS's recommendation for Hopper is 32 MiB

_lib = None
_workspace: dict[int, object] = {}  # handle -> the device buffer it was given (kept alive)


def library():
    """The libcublas this process already loaded (CuPy loads it with its first handle)."""
    global _lib
    if _lib is None:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
        if not paths:
            raise RuntimeError("libcublas is not loaded in this process (create a cuBLAS handle first)")
        lib = ctypes.CDLL(sorted(paths)[0])
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasSetStream_v2.argtypes = [p, p]
        lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        for f in (lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2, lib.cublasGemmEx):
            f.restype = i
        _lib = lib
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def prepare(handle: int) -> None:
    """Give `handle` a workspace of its own (once), so GEMMs captured into a graph never allocate."""
    if handle in _workspace:
        return
    import cupy as cp
    buf = cp.empty(WORKSPACE_BYTES, cp.uint8)
    _check(library().cublasSetWorkspace_v2(handle, buf.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
    _workspace[handle] = buf


def gemm_ex(handle: int, stream_ptr: int, transa: int, transb: int, m: int, n: int, k: int, alpha_ptr: int,
            a_ptr: int, a_type: int, lda: int, b_ptr: int, b_type: int, ldb: int, beta_ptr: int, c_ptr: int,
            c_type: int, ldc: int, compute_type: int, algo: int) -> None:
    """cublasGemmEx on `stream_ptr` (the arguments as cuBLAS takes them; host-pointer scalars)."""
    lib = library()
    _check(lib.cublasSetStream_v2(handle, stream_ptr), "cublasSetStream")
    _check(lib.cublasGemmEx(handle, transa, transb, m, n, k, alpha_ptr, a_ptr, a_type, lda, b_ptr, b_type, ldb,
                            beta_ptr, c_ptr, c_type, ldc, compute_type, algo), "cublasGemmEx")
