"""Low-bit float formats (fp8 E4M3/E5M2, NF4, MXFP4): exact references, the error bound each format
implies, matmul equal to dequantize-then-matmul, and quantize -> save -> load round trips."""
import numpy as np
import pytest

from minillm.model import formats
from minillm.model.formats import (encode_mx_block, float_grid, nf4_codebook, quantize_fp8, quantize_mxfp4,
                                   quantize_nf4)

# QLoRA's published NF4 table (bitsandbytes), the reference our construction must reproduce.
NF4_PUBLISHED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def _w(rows=24, cols=200, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[3, 7] = 0.9                                        # an outlier: stretches its row / block
    w[5] = 0.0                                           # an all-zero row stays exactly zero
    return w


def test_grids_come_from_ml_dtypes():
    assert formats.largest("e4m3") == 448 and formats.largest("e5m2") == 57344
    assert float_grid("e2m1").tolist() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert len(float_grid("e4m3")) == 253                 # 256 patterns - 2 NaNs - the duplicate -0
    np.testing.assert_allclose(nf4_codebook(), NF4_PUBLISHED, atol=2e-7)


def test_fp8_error_within_half_an_ulp():
    w = _w()
    for kind, mant, sub in (("e4m3", 3, -9), ("e5m2", 2, -16)):
        q = quantize_fp8(w, kind)
        d = q.dequantize()
        s = q.scales[:, None]
        bound = s * np.maximum(np.abs(w / np.where(s > 0, s, 1)) * 2.0 ** -(mant + 1), 2.0 ** (sub - 1))
        assert (np.abs(d - w) <= bound * 1.0001 + 1e-12).all(), kind
        assert np.abs(d).max(axis=1)[3] == pytest.approx(0.9, rel=1e-6)      # the row max is on the grid
        assert (d[5] == 0).all()


def test_nf4_picks_the_nearest_code_of_each_block():
    w = _w()
    q = quantize_nf4(w)
    d = q.dequantize()
    padded = np.pad(w, ((0, 0), (0, -w.shape[1] % 64))).reshape(w.shape[0], -1, 64)
    absmax = np.abs(padded).max(-1, keepdims=True)
    candidates = np.array(NF4_PUBLISHED, np.float32) * absmax[..., None]          # [out, blocks, 1, 16]
    best = np.abs(padded[..., None] - candidates).min(-1)                         # brute force: nearest
    err = np.abs(d - w)
    np.testing.assert_allclose(err, best.reshape(w.shape[0], -1)[:, :w.shape[1]], atol=1e-6)
    assert (err <= absmax.max() * 0.1609 / 2 + 1e-7).all()                        # half the widest gap
    assert q.nbytes * 8 / w.size < 4.5 * 256 / 200 + 0.01                        # 4.5 bits, padding aside


def test_mxfp4_matches_a_brute_force_reference():
    w = _w(cols=96)
    q = quantize_mxfp4(w)
    d = q.dequantize()
    grid = float_grid("e2m1")
    blocks = w.reshape(w.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    scale = 2.0 ** e[..., None]
    ref = grid[np.abs(blocks[..., None] / scale[..., None] - grid).argmin(-1)] * scale   # nearest, clipped at 6
    np.testing.assert_array_equal(d, ref.reshape(w.shape).astype(np.float32))
    steps = np.diff(grid).max() / 2 * scale                                               # half the coarsest step
    clipped = np.maximum(np.abs(blocks) - 6 * scale, 0)
    assert (np.abs(d - w).reshape(blocks.shape) <= np.maximum(steps, clipped) + 1e-9).all()
    assert np.array_equal(q.scales, (e + 127).astype(np.uint8))


def test_encode_one_mx_block():
    block = np.array([0.1, -0.3, 7.5, 2.0] + [0.0] * 28, np.float32)    # amax 7.5: e = floor(log2 7.5) - 2 = 0
    codes, scale = encode_mx_block(block)
    assert scale == 127
    assert formats.value_table("e2m1")[codes[:4]].tolist() == [0.0, -0.5, 6.0, 2.0]   # 7.5 clips to 6


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_nf4, quantize_mxfp4], ids=["fp8", "nf4", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_equals_dequantize_then_matmul(quantize, rows):
    w = _w()
    q = quantize(w)
    x = np.random.default_rng(1).standard_normal((rows, w.shape[1])).astype(np.float32)
    np.testing.assert_allclose(q.matmul(x), x @ q.dequantize().T, rtol=1e-5, atol=1e-6)


def test_fp8_block_scales_dequantize_per_tile():
    rng = np.random.default_rng(2)
    codes = quantize_fp8(rng.standard_normal((6, 10)).astype(np.float32)).qweight
    scales = rng.uniform(0.5, 2, (2, 3)).astype(np.float32)                 # tiles of 4 rows x 4 columns
    q = formats.Fp8Weight(codes, scales, "e4m3", (4, 4))
    expected = formats.value_table("e4m3")[codes] * np.kron(scales, np.ones((4, 4)))[:6, :10]
    np.testing.assert_allclose(q.dequantize(), expected, rtol=1e-6)
    x = rng.standard_normal((3, 10)).astype(np.float32)
    np.testing.assert_allclose(q.matmul(x), x @ expected.T, rtol=1e-5, atol=1e-6)
