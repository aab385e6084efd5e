"""kernels/prefill_attention_mma.cu's layouts, without a GPU: minillm.cuda.dev.prefill_mma models the kernel lane
by lane (the PTX fragment tables for mma.m16n8k16 and ldmatrix, the kernel's addresses, tile walk, masks and
online softmax), and its attention must match minillm.model.attention.attend. The GPU checks of the kernel
itself are `python -m minillm.cuda.dev.attention --prefill`."""
from __future__ import annotations

import re

import numpy as np
import pytest

from minillm.backend import as_f32, to_dtype
from minillm.cuda import kernels
from minillm.cuda.dev import prefill_mma as pm
from minillm.model.attention import attend

SOURCE = (kernels.KERNEL_DIR / "prefill_attention_mma.cu").read_text()
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}          # as minillm.cuda.dev.common.TOL: 16-bit Q and P roundings


def define(name: str) -> str:
    return re.search(rf"^#define {name} (\S+)", SOURCE, re.M).group(1)


def test_constants_match_the_kernel():
    assert int(define("MM_WARPS")) == pm.WARPS and int(define("MM_KT")) == pm.KT
    assert pm.ROWS == kernels.MM_ROWS and 32 * pm.WARPS == kernels.MM_THREADS
    stamped = set(re.findall(r"^PREFILL_ATTENTION_MMA_KERNEL\(prefill_attention_mma_hd(\d+)_f16,", SOURCE, re.M))
    assert {int(h) for h in stamped} == set(kernels.MM_HDS)


def test_fragment_tables_cover_each_element_once():
    """A 16x16, B 16x8 and C 16x8: the 32 lanes' registers hold every element exactly once."""
    for rows, cols, shape in ((pm.A_ROW, pm.A_COL, (16, 16)), (pm.B_K, pm.B_N, (16, 8)), (pm.C_ROW, pm.C_COL, (16, 8))):
        count = np.zeros(shape, int)
        np.add.at(count, (rows.ravel(), cols.ravel()), 1)
        assert (count == 1).all()


def test_mma_model_multiplies():
    rng = np.random.default_rng(0)
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    d = pm.mma(A[pm.A_ROW, pm.A_COL], B[pm.B_K, pm.B_N], C[pm.C_ROW, pm.C_COL].astype(np.float32))
    np.testing.assert_allclose(d, (A @ B + C)[pm.C_ROW, pm.C_COL], rtol=1e-5, atol=1e-5)


def test_ldmatrix_feeds_the_mma_b_operand():
    """The kernel's two uses of ldmatrix give B fragments of the right matrices: K's rows (keys) as the columns
    of Kᵀ (plain), V's rows (keys) as the k of P·V (.trans)."""
    rng = np.random.default_rng(1)
    tile = rng.standard_normal((pm.KT, 128)).astype(np.float32)                  # [keys, dims]
    n, kk = 2, 4                     # S n-tile 2 (keys 16..23), k-steps 4 and 5 (dims 64..95)
    b = pm.ldmatrix_x4(tile, 8 * n + (pm.LANE & 7), 16 * kk + 8 * (pm.LANE >> 3))
    kt = tile.T                                                                  # B = Kᵀ [dims, keys]
    for step in range(2):
        want = kt[16 * (kk + step):16 * (kk + step) + 16, 8 * n:8 * n + 8]
        np.testing.assert_array_equal(b[:, 2 * step:2 * step + 2], want[pm.B_K, pm.B_N])
    ks, j = 1, 6                     # P·V k-step 1 (keys 16..31), O n-tiles 6, 7 (dims 48..63)
    b = pm.ldmatrix_x4(tile, 16 * ks + (pm.LANE & 7) + 8 * ((pm.LANE >> 3) & 1), 8 * j + 8 * (pm.LANE >> 4),
                       trans=True)
    for half in range(2):
        want = tile[16 * ks:16 * ks + 16, 8 * (j + half):8 * (j + half) + 8]     # B = V [keys, dims]
        np.testing.assert_array_equal(b[:, 2 * half:2 * half + 2], want[pm.B_K, pm.B_N])


@pytest.mark.parametrize("hd", [64, 128])
def test_ldmatrix_rows_have_no_bank_conflicts(hd):
    """Tile rows HD + 8 halves apart: each 8-lane phase of every ldmatrix the kernel issues touches 8 distinct
    16-byte bank groups (rows HD apart would put all 8 in one)."""
    assert "constexpr int KS = HD + 8;" in SOURCE
    stride = hd + 8
    addresses = [(8 * n + (pm.LANE & 7), 16 * kk + 8 * (pm.LANE >> 3)) for n in range(4) for kk in range(0, hd // 16, 2)]
    addresses += [(16 * ks + (pm.LANE & 7) + 8 * ((pm.LANE >> 3) & 1), 8 * j + 8 * (pm.LANE >> 4))
                  for ks in range(2) for j in range(0, hd // 8, 2)]
    for rows, cols in addresses:
        assert all(len(set(groups)) == 8 for groups in pm.bank_groups(rows, cols, stride))
    assert len(set(pm.bank_groups(pm.LANE & 7, 0 * pm.LANE, hd)[0])) == 1      # what the padding avoids


# (T, n_heads, n_kv_heads, hd, cached keys before the chunk, window, dtype)
CASES = [
    (1, 4, 1, 64, 0, None, "float16"),              # one token, MQA, most of the warp idle
    (37, 8, 2, 64, 0, None, "float16"),             # ragged last block and tile
    (9, 9, 3, 64, 31, None, "float16"),             # group 3 (rows cross token bounds mid-quad), chunk after 31
    (20, 8, 2, 128, 100, 40, "float16"),            # window, chunk after 100: tiles start mid-cache
    (70, 4, 4, 64, 5, 16, "float16"),               # MHA, window smaller than a tile
    (150, 8, 2, 128, 200, 120, "float16"),          # many blocks, a window across several tiles
    (40, 8, 2, 128, 60, None, "bfloat16"),
    (33, 8, 1, 64, 17, 20, "bfloat16"),
]


@pytest.mark.parametrize("T,n_heads,n_kv,hd,before,window,dtype", CASES)
def test_model_of_the_kernel_matches_attend(T, n_heads, n_kv, hd, before, window, dtype):
    """Cache slots no query may see (past the chunk, before the first query's window) are NaN, and the output
    starts as NaN: reading one of them, letting a masked key through or not writing an element shows."""
    rng = np.random.default_rng(T)
    length, capacity = before + T, before + T + 7
    qkv = rng.standard_normal((T, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    kc, vc = (as_f32(to_dtype(rng.standard_normal((n_kv, capacity, hd)).astype(np.float32), dtype)) for _ in range(2))
    want = attend(qkv[:, :n_heads * hd].reshape(T, n_heads, hd), kc[:, :length], vc[:, :length], window)
    first_visible = max(0, before - window + 1) if window else 0
    for c in (kc, vc):
        c[:, length:] = np.nan
        c[:, :first_visible] = np.nan
    got = pm.attention(qkv, kc, vc, T, n_heads, n_kv, before, window, dtype)
    assert not np.isnan(got).any()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOL[dtype] / 2, err                  # half the GPU check's tolerance: the same roundings


def test_a_wrong_layout_is_caught(monkeypatch):
    """The check above can fail: V's ldmatrix without .trans (a plausible slip) is far off."""
    rng = np.random.default_rng(5)
    T, n_heads, n_kv, hd = 16, 4, 1, 64
    qkv = rng.standard_normal((T, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    kc, vc = (as_f32(to_dtype(rng.standard_normal((n_kv, T, hd)).astype(np.float32), "float16")) for _ in range(2))
    want = attend(qkv[:, :n_heads * hd].reshape(T, n_heads, hd), kc, vc)
    right = pm.ldmatrix_x4
    monkeypatch.setattr(pm, "ldmatrix_x4", lambda tile, rows, cols, trans=False: right(tile, rows, cols, False))
    got = pm.attention(qkv, kc, vc, T, n_heads, n_kv, 0, None, "float16")
    assert np.abs(got - want).max() / np.abs(want).max() > 0.1
