"""kernels/gemm_small_m_mma.cu (the batched decode step's products on the tensor cores, T <= 64 rows) against
float64 NumPy over the same 16-bit values: partial row tiles and k stages, every cluster size, accumulate,
NaN-poisoned outputs, two runs bit-identical (minillm.cuda.dev.small_m_mma). Eager launches only: the
engine does not use it (slower than cuBLAS at these shapes; see lessons/BENCHMARKS.md)."""
import numpy as np
import pytest

from gpu_skip import DTYPES, cupy_with_a_device, ok

cp = cupy_with_a_device()

from minillm.cuda.dev.small_m_mma import SHAPES, check_one  # noqa: E402
from minillm.cuda.gemm_mma import BatchGemm, Variant  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 7, 8, 9, 16, 24, 33, 48, 64])
@pytest.mark.parametrize("rows,n_in,accumulate", SHAPES)
def test_mma_product_matches_numpy_and_repeats_exactly(dtype, T, rows, n_in, accumulate):
    err, tol, same = check_one(BatchGemm(dtype), dtype, T, rows, n_in, accumulate, seed=T * 1000 + rows)
    ok((err, tol))
    assert same, "two runs of the split-k product differ"


@pytest.mark.parametrize("variant", [Variant(tw=2), Variant(warps=2, tw=4, stages=3)])
def test_other_compile_time_shapes_match_numpy(variant):
    gemm = BatchGemm("float16", variant)
    for T in (5, 64):
        for rows, n_in, acc in SHAPES:
            err, tol, _ = check_one(gemm, "float16", T, rows, n_in, acc, seed=T)
            ok((err, tol))


def test_unfit_products_are_refused():
    g = BatchGemm("float16")
    w = cp.zeros((8, 16), cp.float16)
    assert not g.usable(cp.zeros((65, 16), cp.float16), w)          # more rows than the kernel holds
    assert not g.usable(cp.zeros((2, 16), cp.float32), w)           # x not 16-bit
    assert not g.usable(cp.zeros((2, 12), cp.float16), cp.zeros((8, 12), cp.float16))   # in % 8
    with pytest.raises(ValueError, match="T <= 64"):
        g(cp.zeros((65, 16), cp.float16), w, cp.zeros((65, 8), cp.float32))

