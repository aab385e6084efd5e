"""The products of a few rows at once, Y [M, rows] = X [M, in] · Wᵀ for M <= 16 (kernels/gemm_small_m.cu):
speculative decoding's verify pass and small decode batches, where cuBLAS streams the weights at ~2.3 TB/s.

    reference   float64 NumPy over the same 16-bit weights
    check       the kernel vs the reference: fresh random inputs, NaN-poisoned output, with and without
                accumulate, every M, shapes with a partial row pair and a partial tile
    sweep       one Mistral-7B layer's four matrices (q|k|v, o, gate|up, down: 436 MB), M = 1 .. 16:
                µs a layer, GB/s and % of the copy roofline, next to cuBLAS (the verify pass's GEMMs
                today) and, at M = 1, the decode GEMV (gemv.cu v4)

    python -m minillm.cuda.dev.small_m [--quick]

Not wired into the engine: on the H200 (BENCHMARKS.md) this first version is right but beats cuBLAS only at
M = 2 (1.14x); from M = 3 its fp32 multiply-adds and shared-memory reads, not the bytes, set its time.
The next version belongs on the tensor cores (mma). Importing this module does not import CuPy.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from minillm.cuda.dev.common import gemv_tol, narrow, plain_table, poisoned, rel_err, report_checks, require_gpu
from minillm.cuda.timing import copy_bandwidth, time_gpu
from minillm.cuda.dev.lab import lab_module
from minillm.cuda.kernels import suffix

SOURCE = "gemm_small_m"                          # dev/kernels/gemm_small_m.cu
MAX_M = 16
KERNELS = {f"m{m}": f"gemm_small_m{m}_{{sfx}}" for m in range(1, MAX_M + 1)}
ROWS_PER_BLOCK, THREADS = 32, 512                # as #defined there: 16 warps, two rows a warp


def _cp():
    import cupy
    return cupy


class SmallMKernels:
    """Launch helper for one weight dtype; launches go on CuPy's current stream."""

    def __init__(self, dtype: str = "float16"):
        sfx = suffix(dtype)
        self.fn = {m: lab_module(SOURCE).get_function(KERNELS[f"m{m}"].format(sfx=sfx)) for m in range(1, MAX_M + 1)}

    def gemm(self, w, x, y, accumulate: bool = False) -> None:
        """y [M, rows] fp32 (+)= x [M, in] fp32 @ w [rows, in]ᵀ (16-bit), M <= 16."""
        rows, n_in = w.shape
        M = x.shape[0]
        if not 1 <= M <= MAX_M or x.shape[1] != n_in or y.shape != (M, rows) or n_in % 8:
            raise ValueError(f"gemm_small_m: x {x.shape}, w {w.shape}, y {y.shape} (M <= {MAX_M}, in % 8 == 0)")
        grid = (rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
        self.fn[M]((grid,), (THREADS,), (w, x, y, np.int32(rows), np.int32(n_in), np.int32(accumulate)))


def reference(w16: np.ndarray, x: np.ndarray, y0: np.ndarray | None = None) -> np.ndarray:
    """float64 x @ wᵀ (+ y0) over the 16-bit weights as stored (uint16 = bf16 bits).   -> [M, rows]"""
    from minillm.backend import as_f32
    out = np.asarray(x, np.float64) @ as_f32(w16).astype(np.float64).T
    return out if y0 is None else out + y0


def check_small_m(dtype: str, M: int, rows: int, n_in: int, accumulate: bool, seed: int) -> tuple[float, float]:
    """(error, tolerance) of the kernel against `reference` on fresh random inputs."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    w16 = narrow(rng.standard_normal((rows, n_in)) / np.sqrt(n_in), dtype)
    x = rng.standard_normal((M, n_in)).astype(np.float32)
    y0 = rng.standard_normal((M, rows)).astype(np.float32)
    y = cp.asarray(y0) if accumulate else poisoned((M, rows), np.float32)
    SmallMKernels(dtype).gemm(cp.asarray(w16), cp.asarray(x), y, accumulate)
    want = reference(w16, x, y0 if accumulate else None)
    return rel_err(cp.asnumpy(y), want), gemv_tol(n_in, None)      # the same weights: summation order only


def checks(dtypes=("float16", "bfloat16")) -> list[tuple[str, float, float]]:
    """Every M on a shape with a partial row pair (rows odd, rows % 32 != 0) and a partial tile (in % 512)."""
    out = []
    for dtype in dtypes:
        for M in range(1, MAX_M + 1):
            for rows, n_in, acc in ((77, 520, False), (64, 1024, True), (33, 8, False)):
                err, tol = check_small_m(dtype, M, rows, n_in, acc, seed=M * 100 + rows)
                out.append((f"{dtype} M={M} [{rows}, {n_in}]{' +=' if acc else ''}", err, tol))
    return out


def _cublas_gemm(w, x16, y) -> None:
    """The verify pass's GEMM today (GPUTransformer.gemm): cuBLAS GemmEx, 16-bit inputs, fp32 out."""
    cp = _cp()
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas
    rows, n_in = w.shape
    M = x16.shape[0]
    ab = runtime.CUDA_R_16F if w.dtype == np.float16 else runtime.CUDA_R_16BF
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rows, M, n_in, one.ctypes.data, w.data.ptr, ab,
                  n_in, x16.data.ptr, ab, n_in, zero.ctypes.data, y.data.ptr, runtime.CUDA_R_32F, rows,
                  cublas.CUBLAS_COMPUTE_32F, -1)


LAYER_MATRICES = ("q|k|v", "o", "gate|up", "down")


def mistral_layer(dtype: str) -> tuple[list[tuple[int, int]], list]:
    """One Mistral-7B layer's four matrices (LAYER_MATRICES, 436 MB in 16 bits): their (rows, in) shapes and
    random device weights of the given 16-bit dtype, the same values on every call."""
    from minillm.model.config import PRESETS
    cp = _cp()
    c = PRESETS["mistral-7b"].config
    shapes = [((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), (c.dim, c.n_heads * c.head_dim),
              (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    ws = [cp.asarray(narrow(np.random.default_rng(i).standard_normal((r, n)).astype(np.float32) * 0.02, dtype))
          for i, (r, n) in enumerate(shapes)]
    return shapes, ws


def sweep(ms=(1, 2, 3, 5, 9, 16), dtype: str = "float16", reps: int = 20) -> list[list]:
    """µs for one Mistral-7B layer's four products at each M: this kernel, cuBLAS, the decode GEMV (M = 1)."""
    from minillm.cuda.kernels import Kernels
    cp = _cp()
    shapes, ws = mistral_layer(dtype)
    k16 = cp.float16 if dtype == "float16" else cp.uint16
    nbytes = sum(w.nbytes for w in ws)
    bw = copy_bandwidth(1 << 30)
    small, kern = SmallMKernels(dtype), Kernels(dtype)
    rows_out = []
    for M in ms:
        xs = [cp.asarray(np.random.default_rng(M).standard_normal((M, n)).astype(np.float32)) for _, n in shapes]
        x16s = [x.astype(k16) if dtype == "float16" else cp.asarray(narrow(cp.asnumpy(x), dtype)) for x in xs]
        ys = [cp.empty((M, r), cp.float32) for r, _ in shapes]
        ours = time_gpu(lambda: [small.gemm(w, x, y) for w, x, y in zip(ws, xs, ys)], reps) * 1e3
        blas = time_gpu(lambda: [_cublas_gemm(w, x, y) for w, x, y in zip(ws, x16s, ys)], reps) * 1e3
        gemv = (time_gpu(lambda: [kern.gemv(w, x[0], y[0], False, "sweep") for w, x, y in zip(ws, xs, ys)], reps)
                * 1e3 if M == 1 else None)
        gbs = lambda us: nbytes / (us * 1e-6) / 1e9
        rows_out.append([M, f"{ours:.0f}", f"{gbs(ours):.0f}", f"{gbs(ours) / (bw / 1e9):.0%}", f"{blas:.0f}",
                         f"{gbs(blas):.0f}", f"{blas / ours:.2f}x", "-" if gemv is None else f"{gemv:.0f}"])
    plain_table(f"one Mistral-7B layer's q|k|v, o, gate|up, down ({nbytes / 1e6:.0f} MB, {dtype}); copy "
                f"roofline {bw / 1e12:.2f} TB/s",
                ["M", "small-M µs", "GB/s", "% copy", "cuBLAS µs", "cuBLAS GB/s", "vs cuBLAS", "GEMV v4 µs"], rows_out)
    return rows_out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="few-row products (M <= 16): check vs NumPy, sweep vs cuBLAS")
    parser.add_argument("--quick", action="store_true", help="float16 checks only, fewer repeats")
    args = parser.parse_args(argv)
    if not require_gpu("minillm.cuda.dev.small_m"):
        return 1
    passed = report_checks(checks(("float16",) if args.quick else ("float16", "bfloat16")))
    sweep(reps=5 if args.quick else 20)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
