"""Programmatic dependent launch (PDL): a kernel that may start before the one ahead of it has finished.

On a stream each kernel normally starts only once the previous one has drained: between two GEMVs of the decode
step the GPU idles through the last blocks' tail, the launch and the new grid's first HBM round trip, a few µs
each, ~160 times a token. On Hopper a launch may carry CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the
next kernel's blocks are scheduled once every block of the current one has run `griddepcontrol.launch_dependents`
(or exited), and wait in `griddepcontrol.wait` until its writes are visible (kernels/common.cuh: pdl_wait,
pdl_trigger). Before that wait our GEMVs issue their first weight loads, which need nothing from the kernel ahead.

CuPy's kernel call cannot pass launch attributes, so `launch` calls the driver's cuLaunchKernelEx through ctypes
with the CUfunction CuPy loaded; in a stream capture the attribute becomes a programmatic edge of the graph.
`Kernels` uses it only while capturing, and only for kernels that call pdl_wait before reading their inputs
(kernels.PDL_KERNEL): any other would race with the kernel ahead.
"""
from __future__ import annotations

import ctypes

import numpy as np

# cuda.h (CUDA 12.3+, unchanged in 13): CUlaunchAttributeID and the two structs cuLaunchKernelEx takes
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id (padded to 8 bytes) and a 64-byte value union; PDL's value is one int."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig: grid and block dimensions, dynamic shared memory, stream, attributes."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
                ("n_attrs", ctypes.c_uint)]


_driver = None


def driver():
    """libcuda, with cuLaunchKernelEx's signature (the library CuPy already loaded)."""
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        _driver = lib
    return _driver


def kernel_argument(a):
    """One kernel argument as the ctypes value the kernel's parameter expects: a device array -> its
    pointer; NumPy scalars -> their C type (the launchers pass np.int32 / np.float32 / np.uint64)."""
    if hasattr(a, "data") and hasattr(a.data, "ptr"):           # a CuPy array (any dtype)
        return ctypes.c_void_p(a.data.ptr)
    kinds = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
             np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float}
    for numpy_type, c_type in kinds.items():
        if isinstance(a, numpy_type):
            return c_type(a.item())
    raise TypeError(f"a PDL launch takes device arrays and np.int32/uint32/int64/uint64/float32 scalars, "
                    f"not {type(a).__name__}")


def launch_config(grid, block, shared_mem: int, stream_ptr: int, attribute: LaunchAttribute) -> LaunchConfig:
    """The CUlaunchConfig of one launch with the PDL attribute (grid/block: ints or up to 3 dims)."""
    dims = lambda d: (tuple(d) + (1, 1, 1))[:3] if isinstance(d, (tuple, list)) else (int(d), 1, 1)
    return LaunchConfig((ctypes.c_uint * 3)(*dims(grid)), (ctypes.c_uint * 3)(*dims(block)), int(shared_mem),
                        ctypes.c_void_p(stream_ptr), ctypes.pointer(attribute), 1)


def launch(function, grid, block, args, shared_mem: int = 0, stream_ptr: int | None = None) -> None:
    """Launch CuPy's loaded `function` (a RawKernel, or its Function: .ptr is the CUfunction) with programmatic
    stream serialization on `stream_ptr` (default: CuPy's current stream)."""
    if stream_ptr is None:
        import cupy
        stream_ptr = cupy.cuda.get_current_stream().ptr
    attribute = LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)
    config = launch_config(grid, block, shared_mem, stream_ptr, attribute)
    values = [kernel_argument(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    handle = getattr(function, "kernel", function).ptr        # a RawKernel's loaded Function: its CUfunction
    status = driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(handle), params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
