"""A NumPy model of kernels/prefill_attention_mma.cu, lane by lane, to check its fragment layouts without a GPU.

The tensor-core instructions are modelled from their PTX ISA definitions (the tables below: which lane holds
which (row, col) of mma.m16n8k16's A, B and C fragments, and what ldmatrix hands each lane); the kernel's own
choices (which address each lane gives ldmatrix, how Q is loaded, how S's accumulators become P's A fragment,
the tile walk, the masks, the online softmax) are written here line for line as the kernel makes them. If the
kernel put a value in the wrong lane, `attention` here, run on the same inputs, would differ from
minillm.model.attention.attend. 16-bit roundings (Q, P) and the zero-filled tile rows are modelled too, so the
error measured here is the kernel's (up to fp32 summation order and ex2.approx).

    attention(qkv, k_cache, v_cache, T, n_heads, n_kv_heads, pos0, window, dtype)   the kernel's whole launch
    bank_groups(rows, cols, stride)   the 16-byte bank groups one ldmatrix phase touches (for a conflict check)

No CuPy: tests/test_prefill_mma.py runs it on the CPU.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.backend import as_f32, to_dtype

WARPS, KT = 4, 32                 # as #defined in prefill_attention_mma.cu (MM_WARPS, MM_KT)
ROWS = 16 * WARPS                 # query rows per block
LOG2E = np.float32(1.4426950408889634)

LANE = np.arange(32)
G, TQ = LANE >> 2, LANE & 3       # groupID, thread-in-group

# ---- PTX fragment layouts (mma.m16n8k16, .f16 / .bf16 inputs, .f32 accumulators) -------------------------
# A (16 x 16, row-major): register i of lane (g, tq) holds 2 elements, (row, col) below, element 0 in the low half.
A_ROW = np.stack([G, G + 8, G, G + 8], 1)[:, :, None].repeat(2, 2)                    # [32 lanes, 4 regs, 2]
A_COL = np.stack([2 * TQ, 2 * TQ, 2 * TQ + 8, 2 * TQ + 8], 1)[:, :, None] + np.arange(2)
# B (16 x 8, "col": k x n): register i holds (k = 2tq + 8i + e, n = g)
B_K = np.stack([2 * TQ, 2 * TQ + 8], 1)[:, :, None] + np.arange(2)                    # [32, 2, 2]
B_N = G[:, None, None].repeat(2, 1).repeat(2, 2)
# C / D (16 x 8 fp32): element i is (row g + 8 (i >> 1), col 2tq + (i & 1))
C_ROW = np.stack([G, G, G + 8, G + 8], 1)                                             # [32, 4]
C_COL = np.stack([2 * TQ, 2 * TQ + 1, 2 * TQ, 2 * TQ + 1], 1)


def mma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """d = A·B + C by fragments: a [32, 4, 2], b [32, 2, 2] (16-bit values held as float32), c [32, 4] -> d."""
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    A[A_ROW, A_COL] = a
    B[B_K, B_N] = b
    D = A @ B                                             # products of 16-bit values are exact; the sum in fp64
    return (D[C_ROW, C_COL] + c).astype(np.float32)


def ldmatrix_x4(tile: np.ndarray, rows: np.ndarray, cols: np.ndarray, trans: bool = False) -> np.ndarray:
    """ldmatrix.m8n8.x4 (.trans) from tile[row, col]: lane 8m + r gives the address of row r of matrix m (8
    consecutive 16-bit values from (rows[lane], cols[lane])). Lane i gets, per matrix m, register m: elements
    (row i // 4, cols 2 (i % 4) + e) of it, or with .trans (rows 2 (i % 4) + e, col i // 4).  -> [32, 4, 2]"""
    mats = np.stack([tile[rows[l], cols[l]:cols[l] + 8] for l in range(32)]).reshape(4, 8, 8)   # [m, row, col]
    e = np.arange(2)
    if trans:
        return mats[:, 2 * TQ[:, None] + e, G[:, None]].transpose(1, 0, 2)
    return mats[:, G[:, None], 2 * TQ[:, None] + e].transpose(1, 0, 2)


def bank_groups(rows: np.ndarray, cols: np.ndarray, stride: int) -> list[np.ndarray]:
    """For each of ldmatrix.x4's 4 phases (8 lanes, one 8x8 matrix), the 16-byte bank groups (of 8: 128 bytes of
    32 banks) its row addresses fall in, for a tile of 16-bit values `stride` apart. Distinct = no conflict."""
    byte = (rows * stride + cols) * 2
    return [(byte[8 * m:8 * m + 8] // 16) % 8 for m in range(4)]


def round16(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> the nearest fp16 / bf16 value (cvt.rn), held as fp32."""
    return as_f32(to_dtype(np.asarray(x, np.float32), dtype))


def pack(lo: np.ndarray, hi: np.ndarray, dtype: str) -> np.ndarray:
    """Mma<W>::pack: two fp32 per lane -> one register of two 16-bit values.   -> [32, 2]"""
    return round16(np.stack([lo, hi], -1), dtype)


def shfl_xor(v: np.ndarray, mask: int) -> np.ndarray:
    return v[LANE ^ mask]


def first_key(p, window: int):
    return np.maximum(p - window + 1, 0) if window > 0 else np.zeros_like(p)


# ---- the kernel -------------------------------------------------------------------------------------------
def attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, T: int, n_heads: int, n_kv_heads: int,
              pos0: int, window: int | None, dtype: str) -> np.ndarray:
    """The launch Kernels.prefill_attention makes with version 2: qkv [T, q_stride] fp32, k_cache and v_cache
    [n_kv_heads, capacity, hd] (16-bit values, held as fp32), queries at pos0 + t.  -> out [T, n_heads * hd] fp32
    (NaN where the kernel writes nothing)."""
    hd = k_cache.shape[2]
    group = n_heads // n_kv_heads
    out = np.full((T, n_heads * hd), np.nan, np.float32)
    scale = np.float32(1.0 / math.sqrt(hd))
    n_blocks = -(-T * group // ROWS)
    for kvh in range(n_kv_heads):
        for bx in range(n_blocks):
            block(qkv, k_cache[kvh], v_cache[kvh], out, kvh, (n_blocks - 1 - bx) * ROWS, T, n_heads, group, pos0,
                  window or 0, scale, dtype)
    return out


def block(qkv, K, V, out, kvh, row0, T, n_heads, group, p0, window, scale, dtype) -> None:
    """One block: rows row0 .. row0 + 63 of KV head kvh. K, V: that head's [capacity, hd]."""
    hd = K.shape[1]
    n_rows = T * group
    last_row = min(n_rows, row0 + ROWS) - 1
    k_begin, k_end = int(first_key(np.array(p0 + row0 // group), window)), p0 + last_row // group + 1
    warps = [Warp(qkv, kvh, row0 + 16 * w, n_rows, group, p0, window, scale, hd, dtype) for w in range(WARPS)]
    for kb in range(k_begin, k_end, KT):
        keys = np.arange(kb, kb + KT)
        ok = (keys < k_end)[:, None]                          # cp.async with src-size 0: zero-filled rows
        k_tile = np.where(ok, K[np.minimum(keys, k_end - 1)], 0).astype(np.float32)
        v_tile = np.where(ok, V[np.minimum(keys, k_end - 1)], 0).astype(np.float32)
        for w in warps:
            if kb <= w.w_hi and kb + KT - 1 >= w.w_lo:
                w.tile(kb, k_tile, v_tile)
    for w in warps:
        w.write(out, n_heads, kvh)


class Warp:
    """One warp's registers, as [32 lanes, ...] arrays: qa (Q's A fragments), o (O's C fragments), m, l."""

    def __init__(self, qkv, kvh, wrow0, n_rows, group, p0, window, scale, hd, dtype):
        self.wrow0, self.n_rows, self.group, self.hd, self.dtype = wrow0, n_rows, group, hd, dtype
        rows = wrow0 + G[:, None] + 8 * np.arange(2)              # [32, 2]: this lane's rows g, g + 8
        self.valid = rows < n_rows
        self.p = np.where(self.valid, p0 + rows // group, -1)
        self.lo = first_key(self.p, window)
        w_last = min(n_rows, wrow0 + 16) - 1
        any_row = wrow0 < n_rows
        # the warp's key range, to skip tiles none of its rows sees
        self.w_lo = int(first_key(np.array(p0 + wrow0 // group), window)) if any_row else 0
        self.w_hi = p0 + w_last // group if any_row else -1
        qscale = scale * LOG2E
        # qa[kk][lane, r + 2 half] = q[row r][16kk + 8 half + 2tq + e] * qscale, 16-bit
        self.qa = np.zeros((hd // 16, 32, 4, 2), np.float32)
        for r in range(2):
            row = rows[:, r]
            t, h = row // group, kvh * group + row % group
            for kk in range(hd // 16):
                for half in range(2):
                    col = h[:, None] * hd + 16 * kk + 8 * half + 2 * TQ[:, None] + np.arange(2)
                    v = np.where(self.valid[:, r:r + 1], qkv[np.minimum(t, len(qkv) - 1)[:, None], col], 0)
                    self.qa[kk][:, r + 2 * half] = round16(v.astype(np.float32) * qscale, dtype)
        self.o = np.zeros((hd // 8, 32, 4), np.float32)
        self.m = np.full((32, 2), -np.inf, np.float32)
        self.l = np.zeros((32, 2), np.float32)

    def tile(self, kb, k_tile, v_tile) -> None:
        hd, dtype = self.hd, self.dtype
        # S = Q·Kᵀ: ldmatrix of K's rows 8n + (lane & 7), dims 16kk + 8 (lane >> 3): b0, b1 of k-steps kk, kk + 1
        s = np.zeros((4, 32, 4), np.float32)
        for kk in range(0, hd // 16, 2):
            b = [ldmatrix_x4(k_tile, 8 * n + (LANE & 7), 16 * kk + 8 * (LANE >> 3)) for n in range(4)]
            for n in range(4):
                s[n] = mma(self.qa[kk], b[n][:, 0:2], s[n])
            for n in range(4):
                s[n] = mma(self.qa[kk + 1], b[n][:, 2:4], s[n])
        # mask: element e of n-tile n is key kb + 8n + 2tq + (e & 1) of row e >> 1
        e = np.arange(4)
        for n in range(4):
            key = kb + 8 * n + 2 * TQ[:, None] + (e & 1)          # [32, 4]
            r = e >> 1
            masked = (key < self.lo[:, r]) | (key > self.p[:, r])
            s[n] = np.where(masked, -np.inf, s[n])
        # online softmax per row: quad max, rescale, exp2, partial sums
        for r in range(2):
            mx = s[:, :, 2 * r:2 * r + 2].max(axis=(0, 2))        # [32]
            mx = np.maximum(mx, shfl_xor(mx, 1))
            mx = np.maximum(mx, shfl_xor(mx, 2))
            m_new = np.maximum(self.m[:, r], mx)
            base = np.where(m_new == -np.inf, np.float32(0), m_new)
            corr = np.exp2(self.m[:, r] - base)
            self.m[:, r] = m_new
            self.l[:, r] *= corr
            self.o[:, :, 2 * r:2 * r + 2] *= corr[None, :, None]
            s[:, :, 2 * r:2 * r + 2] = np.exp2(s[:, :, 2 * r:2 * r + 2] - base[None, :, None])
            for n in range(4):                                     # the kernel's order: n, then the 2 elements
                for i in range(2 * r, 2 * r + 2):
                    self.l[:, r] += s[n][:, i]
        # O += P·V: P's A fragment for keys 16ks.. = S's n-tiles 2ks, 2ks + 1; V by ldmatrix.trans
        for ks in range(2):
            pa = np.stack([pack(s[2 * ks][:, 0], s[2 * ks][:, 1], dtype), pack(s[2 * ks][:, 2], s[2 * ks][:, 3], dtype),
                           pack(s[2 * ks + 1][:, 0], s[2 * ks + 1][:, 1], dtype),
                           pack(s[2 * ks + 1][:, 2], s[2 * ks + 1][:, 3], dtype)], 1)     # [32, 4, 2]
            for j in range(0, hd // 8, 2):
                b = ldmatrix_x4(v_tile, 16 * ks + (LANE & 7) + 8 * ((LANE >> 3) & 1), 8 * j + 8 * (LANE >> 4),
                                trans=True)
                self.o[j] = mma(pa, b[:, 0:2], self.o[j])
                self.o[j + 1] = mma(pa, b[:, 2:4], self.o[j + 1])

    def write(self, out, n_heads, kvh) -> None:
        """l summed over the quad; out[t, h, 8j + 2tq + e] = O / l for the valid rows."""
        l = self.l + self.l[LANE ^ 1]
        l = l + l[LANE ^ 2]
        hd, group = self.hd, self.group
        for r in range(2):
            for lane in range(32):
                row = self.wrow0 + G[lane] + 8 * r
                if row >= self.n_rows:
                    continue
                t, h = row // group, kvh * group + row % group
                inv_l = np.float32(1) / l[lane, r]
                for j in range(hd // 8):
                    d = h * hd + 8 * j + 2 * TQ[lane]
                    out[t, d:d + 2] = self.o[j][lane, 2 * r:2 * r + 2] * inv_l
