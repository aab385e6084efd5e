"""The array backend: NumPy on the CPU or CuPy on the GPU (`array_module`), and dtype helpers.

The model code is written once: each function asks `array_module(x)` for the module its input lives
in and makes its masks, positions and buffers with that one, so the same lines run on host or device
arrays (NumPy hands `np.exp(x)` and friends to CuPy for a CuPy x by itself: NEP 13/18). CuPy is never
imported here: an array can only be a CuPy array if CuPy is already loaded.

Weights may be stored narrower than they are computed. NumPy has no bfloat16, so a bf16 tensor is
kept as its raw 16-bit pattern in a `np.uint16` array; `as_f32` widens any stored dtype to the fp32
the CPU computes in. Widening only a few MB of rows at a time (`matmul_widening`) is what lets a 7B
bf16 model (14.5 GB) run in 24 GB of RAM: an fp32 copy of the whole model (29 GB) would not fit.
"""
from __future__ import annotations

import sys

import numpy as np

from minillm.errors import MiniLLMError

# Names a user may pass as `dtype=` / `--dtype`, and how each is stored on the host.
STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def array_module(*arrays):
    """numpy, or cupy when any of `arrays` is a CuPy array (the GPU): the module to make new arrays with."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and any(isinstance(a, cupy.ndarray) for a in arrays):
        return cupy
    return np


def to_host(a) -> np.ndarray:
    """A NumPy array of `a`: a device array is copied down, a host one returned as it is."""
    return a.get() if array_module(a) is not np else a


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """Raw bf16 bits (uint16) -> float32: bf16 is the top half of an f32, so shift it back up."""
    xp = array_module(a)
    return (xp.asarray(a, dtype=xp.uint16).astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> raw bf16 bits (uint16), rounding to nearest, ties to even (as torch does)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    # Add 0x7FFF plus the lowest kept bit, then truncate: that is round-half-to-even on the cut bits.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(bits.view(np.float32))
    if nan.any():  # rounding could carry a NaN payload into Inf: keep the sign, force a quiet NaN
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def to_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """Cast a float array (uint16 means bf16) to "float32", "float16" or "bfloat16" (-> uint16)."""
    if dtype not in STORAGE_DTYPES:
        raise MiniLLMError(f"unknown dtype {dtype!r}: use float32, float16 or bfloat16")
    if a.dtype == STORAGE_DTYPES[dtype]:
        return a
    f32 = bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)
    return f32_to_bf16(f32) if dtype == "bfloat16" else f32.astype(STORAGE_DTYPES[dtype])


def as_f32(a: np.ndarray) -> np.ndarray:
    """Widen a stored weight to fp32 (no copy when it already is fp32)."""
    if a.dtype == np.float32:
        return a
    if a.dtype == np.uint16:
        return bf16_to_f32(a)
    return a.astype(np.float32)


WIDEN_BYTES = 4 << 20      # fp32 bytes of a 16-bit weight widened at a time by `matmul_widening`


def blockwise_matmul(x: np.ndarray, n_rows: int, rows_fp32, row_bytes: int, block_bytes: int) -> np.ndarray:
    """x @ Wᵀ for a W [n_rows, in] made as fp32 rows on demand, rows_fp32(start, stop) -> [stop - start, in],
    about block_bytes of them at a time.   x: [T, in] -> [T, n_rows]

    Widening the whole matrix per call would allocate (and page-fault) an fp32 copy of it every
    token: 113 MB for SmolLM2's LM head, 470 MB for Mistral's gate|up. A block stays in cache between
    its widening and its GEMM, so DRAM only sees the stored bytes (lessons/BENCHMARKS.md, "Narrow weights
    on the CPU")."""
    rows = max(1, block_bytes // row_bytes)
    y = np.empty((x.shape[0], n_rows), dtype=np.float32)
    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        y[:, start:stop] = x @ rows_fp32(start, stop).T                  # the hot spot at decode
    return y


def matmul_widening(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ wᵀ for a 16-bit stored w [out, in], widened to fp32 WIDEN_BYTES of rows at a time."""
    return blockwise_matmul(x, w.shape[0], lambda start, stop: widen_16_bit(w[start:stop]), 4 * w.shape[1],
                            WIDEN_BYTES)


def widen_16_bit(block: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) or fp16 -> fp32, the fast way for each: bf16 shifted into an f32's top half, fp16
    through a 65,536-entry table (twice NumPy's own cast here)."""
    if block.dtype == np.uint16:
        return np.left_shift(block, 16, dtype=np.uint32).view(np.float32)
    if block.dtype == np.float16:
        return np.take(_fp16_table(), np.ascontiguousarray(block).view(np.uint16))
    return as_f32(block)


_FP16_TABLE: list[np.ndarray] = []


def _fp16_table() -> np.ndarray:
    """Every fp16 bit pattern's fp32 value (65,536 entries, 256 KB: stays in cache)."""
    if not _FP16_TABLE:
        _FP16_TABLE.append(np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32))
    return _FP16_TABLE[0]

