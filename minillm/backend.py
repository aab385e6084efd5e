"""The array backend: NumPy on the CPU (CuPy on the GPU in a later issue), and dtype helpers.

Weights may be stored narrower than they are computed. NumPy has no bfloat16, so a bf16 tensor is
kept as its raw 16-bit pattern in a `np.uint16` array; `as_f32` widens any stored dtype to the fp32
the CPU computes in. Widening one layer at a time is what lets a 7B bf16 model (14.5 GB) run in
24 GB of RAM: an fp32 copy of the whole model (29 GB) would not fit.
"""
from __future__ import annotations

import numpy as np

# Names a user may pass as `dtype=` / `--dtype`, and how each is stored on the host.
STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32: shift the 16 stored bits into place."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round fp32 to the nearest bf16 (ties to even); return the 16-bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + 0x7FFF
    return ((u + rounding) >> 16).astype(np.uint16)


def as_f32(a: np.ndarray) -> np.ndarray:
    """Widen a stored weight to fp32 (no copy when it already is fp32)."""
    if a.dtype == np.float32:
        return a
    if a.dtype == np.uint16:
        return bf16_bits_to_f32(a)
    return a.astype(np.float32)


def to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """Convert an fp32/fp16/bf16-bits array to the storage dtype named by `dtype`."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")
    target = STORAGE_DTYPES[dtype]
    if a.dtype == target:
        return a
    if dtype == "bfloat16":
        return f32_to_bf16_bits(as_f32(a))
    return as_f32(a).astype(target)


def storage_dtype_name(a: np.ndarray) -> str:
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(np.uint16): "bfloat16"}.get(a.dtype, str(a.dtype))
