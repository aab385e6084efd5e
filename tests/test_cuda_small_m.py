"""kernels/gemm_small_m.cu (M <= 16 rows of x at once) against float64 NumPy over the same 16-bit weights:
every M, partial row pairs and tiles, accumulate; NaN-poisoned outputs (minillm.cuda.dev.small_m)."""
import numpy as np
import pytest

from gpu_skip import DTYPES, cupy_with_a_device, ok

cp = cupy_with_a_device()

from minillm.cuda.dev.small_m import MAX_M, SmallMKernels, check_small_m  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", range(1, MAX_M + 1))
@pytest.mark.parametrize("rows,n_in,accumulate", [(77, 520, False), (64, 1024, True), (33, 8, False), (300, 4096, True)])
def test_small_m_matches_numpy(dtype, M, rows, n_in, accumulate):
    ok(check_small_m(dtype, M, rows, n_in, accumulate, seed=M * 1000 + rows))


def test_bad_shapes_are_refused():
    k = SmallMKernels("float16")
    w = cp.zeros((8, 12), cp.float16)
    with pytest.raises(ValueError, match="in % 8"):
        k.gemm(w, cp.zeros((2, 12), cp.float32), cp.zeros((2, 8), cp.float32))
    with pytest.raises(ValueError, match="M <= 16"):
        k.gemm(cp.zeros((8, 16), cp.float16), cp.zeros((17, 16), cp.float32), cp.zeros((17, 8), cp.float32))
