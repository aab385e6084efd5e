"""kernels/sampling.cu: greedy sampling on the device (argmax_rows), its NumPy model and test inputs.

    argmax_rows    logits [rows, vocab] fp32 -> ids [rows] int32, one block per row

Its contract is np.argmax on each row (the Sampler's greedy pick): the first index of the maximum; in a row
with a NaN, the first NaN's index. `argmax_rows_reference` computes it the way the kernel does (each thread's
strided scan, then the warp butterflies and the warp over the warps' winners, under the kernel's one order),
so the CPU tests hold that order to np.argmax on the rows `tricky_logits` makes (ties across threads and
warps, NaNs, infinities, signed zeros); tests/test_gpu_engine.py holds the kernel to np.argmax on the GPU.
"""
from __future__ import annotations

import numpy as np

from minillm.cuda.forward import ARGMAX_THREADS      # the block DeviceOps.argmax launches

NO_INDEX = 0x7fffffff           # as #defined in sampling.cu: a thread that saw no entry


def beats(a, ia, b, ib):
    """sampling.cu's argmax_beats, elementwise: does (a, ia) come before (b, ib)? NaN first (lower index
    first among NaNs), then the larger value, then the lower index."""
    a_nan, b_nan = np.isnan(a), np.isnan(b)
    with np.errstate(invalid="ignore"):
        numbers = (a > b) | ((a == b) & (ia < ib))
    return np.where(a_nan | b_nan, a_nan & (~b_nan | (ia < ib)), numbers)


def _butterfly(v: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """warp_argmax over the last axis (32 lanes): each lane takes its xor-partner's pair when that beats its own."""
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        ov, oi = v[..., lanes ^ o], i[..., lanes ^ o]
        take = beats(ov, oi, v, i)
        v, i = np.where(take, ov, v), np.where(take, oi, i)
    return v, i


def argmax_rows_reference(logits: np.ndarray, threads: int = ARGMAX_THREADS) -> np.ndarray:
    """argmax_rows step by step, every row at once.   logits [R, V] fp32 -> [R] int32"""
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"the block is a multiple of 32 threads, at most 1024, not {threads}")
    R, V = logits.shape
    v = np.full((R, threads), -np.inf, np.float32)                    # each thread's best so far
    i = np.full((R, threads), NO_INDEX, np.int64)
    for start in range(0, V, threads):                                # thread t reads start + t
        k = start + np.arange(threads)
        seen = k < V
        x = np.where(seen, logits[:, np.minimum(k, V - 1)], -np.inf)
        take = seen & beats(x, k, v, i)
        v, i = np.where(take, x, v), np.where(take, k, i)
    v, i = _butterfly(v.reshape(R, -1, 32), i.reshape(R, -1, 32))      # [R, warps, 32]: every lane the same
    warps = threads // 32
    wv = np.full((R, 32), -np.inf, np.float32)                       # warp 0 over the warps' winners
    wi = np.full((R, 32), NO_INDEX, np.int64)
    wv[:, :warps], wi[:, :warps] = v[:, :, 0], i[:, :, 0]
    return _butterfly(wv, wi)[1][:, 0].astype(np.int32)


def tricky_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """[rows, vocab] fp32 of random logits, most rows poisoned one way np.argmax has a rule for: the maximum
    tied at several places, one or more NaNs, all NaN, all -inf, +inf tied, a maximum of -0.0 tied with 0.0."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):
        where = rng.choice(vocab, size=min(vocab, int(rng.integers(1, 5))), replace=False)
        kind = r % 8
        if kind == 1:                                     # the max at several places
            x[r, where] = x[r].max() + 1.0
        elif kind == 2:                                   # NaNs (np.argmax: the first of them)
            x[r, where] = np.nan
        elif kind == 3:
            x[r] = np.nan
        elif kind == 4:
            x[r] = -np.inf
        elif kind == 5:                                   # +inf tied
            x[r, where] = np.inf
        elif kind == 6:                                   # every logit < 0 but a -0.0 and a 0.0: equal, the first wins
            x[r] = -np.abs(x[r]) - 1.0
            x[r, where] = -0.0
            x[r, where[-1]] = 0.0
        elif kind == 7:                                   # a NaN after a +inf: the NaN still wins
            x[r, where[0]] = np.inf
            x[r, where[-1]] = np.nan
    return x
