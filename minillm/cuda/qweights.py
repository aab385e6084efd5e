"""Quantized weight matrices on the device: minillm.model.quant's int8 and int4 layouts, uploaded as they are.

    QuantMatrix.upload([wq, wk, wv])    # CPU Int8Weight/Int4Weight parts -> one stacked device matrix
    QuantMatrix.random("int4", rows, cols, group_size=128, seed=1, kernels=k)   # for speed measurements

The decode GEMV (kernels/gemv_quant.cu) reads these bytes directly; prefill widens one matrix at a time
into a reused 16-bit scratch buffer for cuBLAS (`Kernels.dequantize`). The only change to the layout is
for int8 rows whose width is not a multiple of 16: they are padded with zero codes to whole 16-byte
loads (the extra columns meet x = 0 in the kernel, and are dropped by the dequantizer).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from minillm.cuda.gpu_kv_cache import device_dtype

METHODS = ("int8", "int4")


def _cp():
    import cupy
    return cupy


@dataclass
class QuantMatrix:
    """W [rows, in_features] stored narrow on the device (what gemv_quant.cu streams)."""
    method: str              # "int8" or "int4"
    qweight: object          # int8 [rows, in16] | uint8 [rows, in_padded / 2]: rows of whole 16-byte chunks
    scales: object           # fp32 [rows] | fp16 [rows, groups]
    mins: object | None      # int4: fp16 [rows, groups]
    in_features: int
    group_size: int = 0      # int4: inputs per scale/min (a multiple of 32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: codes, scales and mins."""
        return sum(a.nbytes for a in (self.qweight, self.scales, self.mins) if a is not None)

    @property
    def n_chunks(self) -> int:
        """16-byte loads per row."""
        return self.qweight.shape[1] // 16

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1] if self.method == "int4" else 1

    @classmethod
    def upload(cls, parts: list) -> "QuantMatrix":
        """Stack CPU quantized matrices (minillm.model.quant.Int8Weight / Int4Weight, same input width and
        method) row-wise, as q|k|v and gate|up are stacked, and copy them to the device."""
        from minillm.model.quant import Int4Weight, Int8Weight
        cp = _cp()
        first = parts[0]
        if isinstance(first, Int8Weight):
            q = np.concatenate([p.qweight for p in parts])                          # int8 [rows, in]
            q = np.pad(q, ((0, 0), (0, -q.shape[1] % 16)))                          # [rows, in16]
            return cls("int8", cp.asarray(q), cp.asarray(np.concatenate([p.scales for p in parts]).astype(np.float32)),
                       None, first.shape[1])
        if isinstance(first, Int4Weight):
            stack = lambda name: cp.asarray(np.ascontiguousarray(np.concatenate([getattr(p, name) for p in parts])))
            return cls("int4", stack("qweight"), stack("scales"), stack("mins"), first.in_features, first.group_size)
        raise TypeError(f"not a quantized weight: {type(first).__name__}")

    @classmethod
    def random(cls, method: str, rows: int, cols: int, kernels, group_size: int = 128, seed: int = 0) -> "QuantMatrix":
        """Random codes made on the device, scaled like gpu_model's random fp16 weights (uniform,
        variance 1 / cols): for speed measurements, where the values do not matter."""
        cp = _cp()
        bound = (3.0 / cols) ** 0.5
        if method == "int8":
            q = cp.empty((rows, -(-cols // 16) * 16), cp.int8)
            kernels.fill_random_words(q, seed)
            return cls("int8", q, cp.full(rows, bound / 127, cp.float32), None, cols)
        if method != "int4" or group_size <= 0 or group_size % 32:
            raise ValueError(f"random quantized weights: int8, or int4 with a group size multiple of 32 "
                             f"(got {method}, {group_size})")
        groups = -(-cols // group_size)
        q = cp.empty((rows, groups * group_size // 2), cp.uint8)
        kernels.fill_random_words(q, seed)
        return cls("int4", q, cp.full((rows, groups), 2 * bound / 15, cp.float16),
                   cp.full((rows, groups), -bound, cp.float16), cols, group_size)


def is_quantized(w) -> bool:
    return isinstance(w, QuantMatrix)


def random_matrices(kernels, dtype: str, seed: int = 0, quant: str | None = None, group_size: int = 128):
    """matrix(rows, cols, quantize=True): random device matrices for speed measurements, each from its own seed:
    16-bit uniform of variance 1/cols (kernels.fill_uniform), or with `quant` a QuantMatrix of that spread."""
    seeds = itertools.count(seed * 1000 + 1)

    def matrix(rows: int, cols: int, quantize: bool = True):
        if quant is not None and quantize:
            return QuantMatrix.random(quant, rows, cols, kernels, group_size, next(seeds))
        w = _cp().empty((rows, cols), dtype=device_dtype(dtype))
        kernels.fill_uniform(w, next(seeds), (3.0 / cols) ** 0.5)
        return w
    return matrix
