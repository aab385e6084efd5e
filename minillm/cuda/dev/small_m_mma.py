"""The batched decode step's products on the tensor cores, Y [T, rows] = X [T, in] · Wᵀ for T <= 64
(kernels/gemm_small_m_mma.cu, launched by minillm/cuda/gemm_mma.py), against NumPy and cuBLAS.

    check   the kernel vs float64 NumPy over the same 16-bit values: fresh random inputs, NaN-poisoned output,
            with and without accumulate, T = 1 .. 64, shapes with a partial row tile, a partial k stage, a
            k range shorter than a stage, and every cluster size (1, 2, 4, 8); and two runs bit-identical
            (the split-k partials meet in a fixed order)
    sweep   one Mistral-7B layer's four matrices (q|k|v, o, gate|up, down: 436 MB) at T = 1 .. 64: µs a layer,
            GB/s and % of the copy roofline, next to cuBLAS (GPUTransformer.gemm: what the engine used), and
            per matrix at the largest T

    python -m minillm.cuda.dev.small_m_mma [--quick]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from minillm.cuda.dev.common import gemv_tol, narrow, plain_table, poisoned, rel_err, report_checks, require_gpu
from minillm.cuda.dev.small_m import LAYER_MATRICES, _cublas_gemm, mistral_layer, reference
from minillm.cuda.dev.timing import copy_bandwidth, time_gpu
from minillm.cuda.gemm_mma import MAX_T, BatchGemm, Variant, split_for

# (rows, in, accumulate): a partial row tile and a partial k stage; k shorter than a stage; splits 2, 4, 8
SHAPES = ((77, 520, False), (300, 1024, True), (130, 8, False), (512, 4096, True), (1024, 2048, False),
          (4096, 4096, True))


def _cp():
    import cupy
    return cupy


def check_one(gemm: BatchGemm, dtype: str, T: int, rows: int, n_in: int, accumulate: bool, seed: int):
    """(error, tolerance, bit-identical on a second run) of the kernel against `reference`."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    w16 = narrow(rng.standard_normal((rows, n_in)) / np.sqrt(n_in), dtype)
    x16 = narrow(rng.standard_normal((T, n_in)), dtype)
    y0 = rng.standard_normal((T, rows)).astype(np.float32)
    w, x = cp.asarray(w16), cp.asarray(x16)
    runs = []
    for _ in range(2):
        y = cp.asarray(y0) if accumulate else poisoned((T, rows), np.float32)
        gemm(x, w, y, accumulate)
        runs.append(cp.asnumpy(y))
    from minillm.backend import as_f32
    want = reference(w16, as_f32(x16), y0 if accumulate else None)
    return rel_err(runs[0], want), gemv_tol(n_in, None), np.array_equal(runs[0], runs[1])


def checks(dtypes=("float16", "bfloat16"), ts=(1, 3, 8, 13, 16, 24, 33, 48, 64)) -> list[tuple[str, float, float]]:
    out = []
    for dtype in dtypes:
        gemm = BatchGemm(dtype)
        for T in ts:
            for rows, n_in, acc in SHAPES:
                err, tol, same = check_one(gemm, dtype, T, rows, n_in, acc, seed=T * 1000 + rows)
                name = f"{dtype} T={T} [{rows}, {n_in}] S={split_for(rows, n_in, gemm.sms)}{' +=' if acc else ''}"
                out.append((name, err, tol))
                out.append((name + " deterministic", 0.0 if same else 1.0, 0.0))
    return out


def sweep(ts=(1, 8, 16, 32, 48, 64), dtype: str = "float16", reps: int = 20) -> list[list]:
    cp = _cp()
    shapes, ws = mistral_layer(dtype)
    nbytes = sum(w.nbytes for w in ws)
    bw = copy_bandwidth(1 << 30)
    gemm = BatchGemm(dtype)
    gbs = lambda us, b=nbytes: b / (us * 1e-6) / 1e9
    rows_out, per_matrix = [], []
    for T in ts:
        xs = [cp.asarray(narrow(np.random.default_rng(T).standard_normal((T, n)), dtype)) for _, n in shapes]
        ys = [cp.empty((T, r), cp.float32) for r, _ in shapes]
        ours = time_gpu(lambda: [gemm(x, w, y) for w, x, y in zip(ws, xs, ys)], reps) * 1e3
        blas = time_gpu(lambda: [_cublas_gemm(w, x, y) for w, x, y in zip(ws, xs, ys)], reps) * 1e3
        rows_out.append([T, f"{ours:.0f}", f"{gbs(ours):.0f}", f"{gbs(ours) / (bw / 1e9):.0%}", f"{blas:.0f}",
                         f"{gbs(blas):.0f}", f"{blas / ours:.2f}x"])
        if T == ts[-1]:
            for name, w, x, y in zip(LAYER_MATRICES, ws, xs, ys):
                a = time_gpu(lambda: gemm(x, w, y), reps) * 1e3
                b = time_gpu(lambda: _cublas_gemm(w, x, y), reps) * 1e3
                per_matrix.append([name, f"{w.shape[0]}x{w.shape[1]}", split_for(*w.shape, gemm.sms), f"{a:.1f}",
                                   f"{gbs(a, w.nbytes) / (bw / 1e9):.0%}", f"{b:.1f}", f"{gbs(b, w.nbytes) / (bw / 1e9):.0%}"])
    plain_table(f"one Mistral-7B layer's q|k|v, o, gate|up, down ({nbytes / 1e6:.0f} MB, {dtype}); copy roofline "
                f"{bw / 1e12:.2f} TB/s", ["T", "mma µs", "GB/s", "% copy", "cuBLAS µs", "cuBLAS GB/s", "vs cuBLAS"],
                rows_out)
    plain_table(f"per matrix at T = {ts[-1]}", ["matrix", "shape", "S", "mma µs", "% copy", "cuBLAS µs", "% copy"],
                per_matrix)
    return rows_out


VARIANTS = (Variant(), Variant(tw=2), Variant(tw=4), Variant(warps=2, tw=2), Variant(warps=2, tw=4),
            Variant(warps=2, tw=2, stages=6), Variant(warps=8, tw=2), Variant(stages=3, tw=2))


def variants(ts=(1, 16, 64), dtype: str = "float16", reps: int = 10) -> None:
    """Each compile-time shape: µs for one Mistral-7B layer at a few T, and per matrix at the largest."""
    cp = _cp()
    shapes, ws = mistral_layer(dtype)
    nbytes = sum(w.nbytes for w in ws)
    bw = copy_bandwidth(1 << 30) / 1e9
    rows = []
    for v in VARIANTS:
        gemm = BatchGemm(dtype, v)
        worst = max(check_one(gemm, dtype, T, r, n, acc, seed=T)[0] / gemv_tol(n, None)
                    for T in (1, 13, 64) for r, n, acc in SHAPES[:3] + SHAPES[-1:])
        row = [f"{'ok' if worst <= 1 else 'FAIL'} "
               f"warps {v.warps}x{v.tw} bk {v.bk} stages {v.stages} ({v.smem // 1024} KB, {v.blocks_per_sm}/SM)"]
        for T in ts:
            xs = [cp.asarray(narrow(np.random.default_rng(T).standard_normal((T, n)), dtype)) for _, n in shapes]
            ys = [cp.empty((T, r), cp.float32) for r, _ in shapes]
            us = time_gpu(lambda: [gemm(x, w, y) for w, x, y in zip(ws, xs, ys)], reps) * 1e3
            row.append(f"{us:.0f} ({nbytes / us / 1e3 / bw:.0%})")
        for w, x, y in zip(ws, xs, ys):
            us = time_gpu(lambda: gemm(x, w, y), reps) * 1e3
            row.append(f"{us:.1f} ({w.nbytes / us / 1e3 / bw:.0%})")
        rows.append(row)
    plain_table(f"compile-time shapes, one Mistral-7B layer (µs, % of {bw:.0f} GB/s copy)",
                ["variant"] + [f"T={T}" for T in ts] + [f"{n} T={ts[-1]}" for n in ("qkv", "o", "gate_up", "down")],
                rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=f"few-row products on the tensor cores (T <= {MAX_T}): check, sweep")
    parser.add_argument("--quick", action="store_true", help="float16 checks only, fewer repeats")
    parser.add_argument("--variants", action="store_true", help="time each compile-time shape (VARIANTS) instead")
    args = parser.parse_args(argv)
    if not require_gpu("minillm.cuda.dev.small_m_mma"):
        return 1
    if args.variants:
        variants()
        return 0
    passed = report_checks(checks(("float16",) if args.quick else ("float16", "bfloat16")), most=20)
    sweep(reps=5 if args.quick else 20)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
