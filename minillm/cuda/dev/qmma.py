"""The quantized decode GEMV v3 on tensor cores (dev/kernels/gemv_quant_mma.cu) against v2 (gemv_quant.cu).

    emulate(...)   NumPy, no GPU: the kernel's exact data flow (x staged and scaled in fp16 in the mma's k
                   order, codes widened by the same bit operations into A fragments, mma.m16n8k16 fragments
                   placed by the PTX layout, the codes' offsets and int4's group fold); exact=True keeps
                   every sum in fp64 and must reproduce W·x_h (the x the kernel multiplies) to fp64 rounding,
                   exact=False rounds where the kernel rounds (fp32) to estimate its error
    checks         v3 on the GPU vs float64 NumPy on the same quantized weights: every epilogue (plain,
                   += residual, RMSNorm, SwiGLU, RoPE + KV append), odd widths, rows not a multiple of 16,
                   and Mistral-7B's four matrices; exits non-zero on an error over QUANT_TOL
    timings        each Mistral-7B matrix as a plain GEMV, v2 vs v3: µs a launch in a CUDA graph (over
                   enough copies that none stays in L2), GB/s and % of the copy roofline; v3 also with
                   its other grids (one block a tile; 2 blocks an SM instead of 3) and with 4 sub-steps
                   a warp step instead of 2 (twice the bytes in flight, 2 blocks an SM)
    decode         (--decode) tok/s of a random Mistral-7B, int8 and int4, v2 vs v3, with the CUDA graph

    python -m minillm.cuda.dev.qmma [--no-timing] [--decode]

Importing this module does not import CuPy (tests/test_qmma_emulation.py runs `emulate` on the CPU).
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

SOURCE = "gemv_quant_mma"                          # dev/kernels/gemv_quant_mma.cu
KERNELS = {f"{e}{m}": f"gemv_{e}{m}_v3_{{sfx}}" for m in ("int8", "int4")
           for e in ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_", "qkv_", "rmsnorm_qkv_")}
KERNELS.update({f"{m} u4": f"gemv_{m}_v3u4_{{sfx}}" for m in ("int8", "int4")})   # U = 4: plain only
X_TOP = 14                                         # as #defined there (M_X_TOP): x's top exponent


# ---- the NumPy emulation ---------------------------------------------------------------------------------
def _halves(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f16x2 words -> (low half, high half) as float64."""
    w = np.asarray(words, np.uint32)
    lo = (w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (w >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """fp32 pairs -> f16x2 words (round to nearest even, as cvt.rn.f16x2.f32)."""
    bits = lambda v: np.asarray(v, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    return bits(lo) | (bits(hi) << 16)


def stage(x: np.ndarray, gain, n_pad: int, int4: bool, exact: bool, step: int = 8) -> dict:
    """stage_x_mma: x (times gain) scaled by 2^e, in fp16, in the k order of the mma fragments.
    -> {"words": uint32 [n_pad, 8 or 16], "down": 2^-e, "offsets": [n_pad / step] (int8: 1152·Σ of a warp
    step's values), "quad": [n_pad / 4, 2] (int4: Z, X of 4 chunks)}"""
    C = 32 if int4 else 16
    v = np.asarray(x, np.float32) * (np.float32(1) if gain is None else np.asarray(gain, np.float32))
    mx = float(np.abs(v).max()) if v.size else 0.0
    e = min(max(X_TOP - math.frexp(mx)[1] + 1, -100), 100) if mx > 0 else 0     # frexp: mx = f·2^E, f in [.5, 1)
    vals = np.zeros(n_pad * C, np.float32)
    vals[:v.size] = v * np.float32(2.0 ** e)
    ch = vals.reshape(n_pad, C // 8, 8)                         # [chunk, code word, value]
    out = {"down": 2.0 ** -e}
    if int4:                                                     # (v0, v4), (v1/16, v5/16), (v2, v6), (v3/16, v7/16)
        sixteenth = np.float32(0.0625)
        words = np.stack([_pack(ch[..., 0], ch[..., 4]), _pack(ch[..., 1] * sixteenth, ch[..., 5] * sixteenth),
                          _pack(ch[..., 2], ch[..., 6]), _pack(ch[..., 3] * sixteenth, ch[..., 7] * sixteenth)], -1)
        lo = sum(_halves(words[..., i])[h] for i in (0, 2) for h in (0, 1)).sum(-1)    # [n_pad] Σ stored, low
        hi = sum(_halves(words[..., i])[h] for i in (1, 3) for h in (0, 1)).sum(-1)
        lo, hi = lo.reshape(-1, 4).sum(1), hi.reshape(-1, 4).sum(1)                       # per quad
        quad = np.stack([1024.0 * (lo + hi), lo + 16.0 * hi], 1)                          # (Z, X)
        out["quad"] = quad if exact else quad.astype(np.float32).astype(np.float64)
    else:                                                        # natural order, two values a word
        words = _pack(ch[..., 0::2], ch[..., 1::2])
        offsets = 1152.0 * sum(_halves(words)).reshape(n_pad // step, -1).sum(1)
        out["offsets"] = offsets if exact else offsets.astype(np.float32).astype(np.float64)
    out["words"] = words.reshape(n_pad, -1)
    return out


def x_used(st: dict, n_in: int, int4: bool) -> np.ndarray:
    """The x the tensor cores multiply, unscaled (what W·x_h means), from the staged words. -> [n_in]"""
    lo, hi = _halves(st["words"])                                # [n_pad, words]
    if int4:   # words per code word: (v0, v4), (v1, v5)/16, (v2, v6), (v3, v7)/16 -> v0..v7
        lo, hi = lo.reshape(-1, 4, 4), hi.reshape(-1, 4, 4)
        mult = np.array([1.0, 16.0, 1.0, 16.0])
        v = np.concatenate([lo[..., [0, 1, 2, 3]] * mult, hi[..., [0, 1, 2, 3]] * mult], -1)   # v0..v3, v4..v7
    else:
        v = np.stack([lo, hi], -1)
    return v.reshape(-1)[:n_in] * st["down"]


def _words(q: np.ndarray) -> np.ndarray:
    """Rows of 16-byte chunks -> uint32 [rows, n_chunks, 4] (little-endian: byte 0 is the low byte)."""
    q = np.ascontiguousarray(q).view(np.uint8)
    return q.view("<u4").reshape(q.shape[0], -1, 4).astype(np.uint32)


_G, _T = np.meshgrid(np.arange(8), np.arange(4), indexing="ij")   # lane (g, t) = (l // 4, l % 4) as [8, 4]


def _a_matrix(a0, a1, a2, a3) -> np.ndarray:
    """A fragments [tiles, 8 (g), 4 (t)] -> A [tiles, 16, 16] (PTX mma.m16n8k16, .f16 A, row-major)."""
    A = np.zeros(a0.shape[:1] + (16, 16))
    for reg, row, col in ((a0, 0, 0), (a1, 8, 0), (a2, 0, 8), (a3, 8, 8)):
        lo, hi = _halves(reg)
        A[:, row + _G, col + 2 * _T] = lo
        A[:, row + _G, col + 2 * _T + 1] = hi
    return A


def _b_matrix(b0, b1) -> np.ndarray:
    """B fragments [8 (g), 4 (t)] -> B [16, 8] (.col: lane (g, t) holds k 2t, 2t+1 and 2t+8, 2t+9 of column g)."""
    B = np.zeros((16, 8))
    for reg, k in ((b0, 0), (b1, 8)):
        lo, hi = _halves(reg)
        B[k + 2 * _T, _G] = lo
        B[k + 2 * _T + 1, _G] = hi
    return B


def _prmt(u: np.ndarray, b_lo: int, b_hi: int) -> np.ndarray:
    """__byte_perm(u, 0x64646464, 0x4<b_hi>4<b_lo>): bytes b_lo, b_hi of u under the exponent byte 0x64."""
    return (((u >> (8 * b_lo)) & 0xFF) | 0x6400 | (((u >> (8 * b_hi)) & 0xFF) << 16) | 0x64000000).astype(np.uint32)


def _lop(w: np.ndarray, mask: int) -> np.ndarray:
    return ((w & mask) | 0x64006400).astype(np.uint32)


def emulate(method: str, q: np.ndarray, scales: np.ndarray, mins, group: int, x: np.ndarray, gain=None,
            exact: bool = True, U: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """y = W·x as gemv_{method}_v3 computes it (plain epilogue, rows in pairs (2p, 2p+1)), U sub-steps a
    warp step (4 U chunks of each row: U = 2, or 4 for the _v3u4 kernels).
    q: int8 [rows, in16] or uint8 [rows, in_pad / 2] (the device layouts); scales fp32 [rows] or fp16
    [rows, groups]; mins fp16 [rows, groups]; x [in]. -> (y [rows] float64, x_used [in]: what it multiplied)"""
    int4 = method == "int4"
    rows, n_in = q.shape[0], x.shape[0]
    words = _words(q)
    n_chunks = words.shape[1]
    STEP = 4 * U
    n_steps = -(-n_chunks // STEP)
    cpg = group // 32 if int4 else 1
    if int4 and cpg % 4:
        raise ValueError(f"v3 needs int4 groups of a multiple of 128 (got {group})")
    st = stage(x, gain, n_steps * STEP, int4, exact, STEP)
    xw = st["words"]
    pairs = -(-rows // 2)
    tiles = -(-pairs // 8)
    p = np.arange(tiles)[:, None] * 8 + np.arange(8)             # [tiles, 8 (g)]
    ra = np.where(2 * p < rows, 2 * p, 0)
    rb = np.where(2 * p + 1 < rows, 2 * p + 1, ra)
    dt = np.float64 if exact else np.float32
    acc_ab = np.zeros((tiles, 16))                               # int8: D's column 0, rows g and g + 8
    acc4 = np.zeros((tiles, 8, 4))                               # int4: lane (g, t)'s fold
    for s in range(n_steps):
        D = [np.zeros((tiles, 16, 8), dt) for _ in range(U)]
        for u in range(U):
            c = s * STEP + 4 * u + np.arange(4)                  # lane t's chunk
            ok = c < n_chunks
            wa = np.where(ok[None, None, :, None], words[ra[:, :, None], np.minimum(c, n_chunks - 1)], 0)
            wb = np.where(ok[None, None, :, None], words[rb[:, :, None], np.minimum(c, n_chunks - 1)], 0)
            xl = np.broadcast_to(xw[c][None], (8,) + xw[c].shape)   # [8 (g), 4 (t), words]: every g reads it
            mmas = []
            if not int4:
                for j in range(4):
                    ua, ub = wa[..., j] ^ 0x80808080, wb[..., j] ^ 0x80808080
                    mmas.append(((_prmt(ua, 0, 1), _prmt(ub, 0, 1), _prmt(ua, 2, 3), _prmt(ub, 2, 3)),
                                 (xl[..., 2 * j], xl[..., 2 * j + 1])))
            else:
                for w in range(4):
                    la, lb = wa[..., w], wb[..., w]
                    for half in range(2):
                        sa, sb = la >> (8 * half), lb >> (8 * half)
                        b = 4 * w + 2 * half                     # x words (v0, v4), (v1, v5)/16 or the next two
                        mmas.append(((_lop(sa, 0x000F000F), _lop(sb, 0x000F000F), _lop(sa, 0x00F000F0),
                                      _lop(sb, 0x00F000F0)), (xl[..., b], xl[..., b + 1])))
            for a, b in mmas:
                prod = _a_matrix(*a).astype(dt) @ _b_matrix(*b).astype(dt)
                D[u] = (D[u] + prod).astype(dt)
        if not int4:             # less the step's offset, as the lanes do after the step's mma
            acc_ab += np.concatenate([sum(d[:, :8, 0] for d in D), sum(d[:, 8:, 0] for d in D)], 1) - st["offsets"][s]
            continue
        # the fold: lane (g, t) takes quads t >> 1, t >> 1 + 2, ... of the step and row (t & 1 ? b : a); it
        # reads column 2t
        for t, i in ((t, i) for t in range(4) for i in range(U // 2)):
            quad, rsel = (t >> 1) + 2 * i, t & 1
            cq = s * STEP + 4 * quad
            if cq >= n_chunks:
                continue
            v = D[quad][:, 8 * rsel + np.arange(8), 2 * t].astype(np.float64)      # [tiles, 8]
            row = rb if rsel else ra
            sc = scales[row, cq // cpg].astype(np.float64)
            mn = mins[row, cq // cpg].astype(np.float64)
            z, xs = st["quad"][s * U + quad]
            acc4[:, :, t] += sc * (v - z) + mn * xs
    if int4:
        both = acc4 + acc4[:, :, [2, 3, 0, 1]]                   # lanes t and t ^ 2: the row's two quads
        ya, yb = both[:, :, 0], both[:, :, 1]
    else:
        ya = acc_ab[:, :8] * scales[ra]
        yb = acc_ab[:, 8:] * scales[rb]
    y = np.zeros(2 * tiles * 8)
    y[2 * p + 1] = yb * st["down"]                               # rb = ra for a missing row b: a wins below
    y[2 * p] = ya * st["down"]
    return y[:rows], x_used(st, n_in, int4)


def dequantized(method: str, q: np.ndarray, scales, mins, group: int, n_in: int) -> np.ndarray:
    """W [rows, in] float64 from the device layouts (minillm.model.quant's formulas)."""
    if method == "int8":
        return q[:, :n_in].astype(np.float64) * np.asarray(scales, np.float64)[:, None]
    b = np.asarray(q, np.uint8)
    codes = np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1).astype(np.float64)    # element 2j, 2j+1
    rep = lambda a: np.repeat(np.asarray(a, np.float64), group, axis=1)
    return (codes * rep(scales) + rep(mins))[:, :n_in]


def random_layout(method: str, rows: int, n_in: int, group: int, rng) -> tuple:
    """Random device-layout weights, every code value reachable, scales ~ 1/sqrt(in): (q, scales, mins)."""
    bound = (3.0 / n_in) ** 0.5
    if method == "int8":
        q = rng.integers(-128, 128, (rows, -(-n_in // 16) * 16), dtype=np.int8)
        return q, (bound / 127 * rng.uniform(0.5, 1.5, rows)).astype(np.float32), None
    groups = -(-n_in // group)
    q = rng.integers(0, 256, (rows, groups * group // 2), dtype=np.uint8)
    s = (2 * bound / 15 * rng.uniform(0.5, 1.5, (rows, groups))).astype(np.float16)
    m = (-7.5 * s.astype(np.float32) * rng.uniform(0.8, 1.2, (rows, groups))).astype(np.float16)
    return q, s, m


# ---- on the GPU ------------------------------------------------------------------------------------------
def _mistral_shapes() -> dict:
    from minillm.cuda.dev.gemv import matrix_shapes
    from minillm.model.config import PRESETS
    return matrix_shapes(PRESETS["mistral-7b"].config)


def _device_matrix(method: str, rows: int, n_in: int, group: int, seed: int):
    """A QuantMatrix of random codes with random scales (and mins), made on the device ("float16": a plain
    fp16 matrix of the same spread, for the 16-bit kernels)."""
    import cupy as cp
    from minillm.cuda.qweights import QuantMatrix
    rs = cp.random.RandomState(seed)
    bound = (3.0 / n_in) ** 0.5
    if method == "float16":
        return rs.uniform(-bound, bound, (rows, n_in)).astype(cp.float16)
    if method == "int8":
        q = rs.randint(-128, 128, (rows, -(-n_in // 16) * 16)).astype(cp.int8)
        return QuantMatrix("int8", q, (bound / 127 * rs.uniform(0.5, 1.5, rows)).astype(cp.float32), None, n_in)
    groups = -(-n_in // group)
    q = rs.randint(0, 256, (rows, groups * group // 2)).astype(cp.uint8)
    s = (2 * bound / 15 * rs.uniform(0.5, 1.5, (rows, groups))).astype(cp.float16)
    m = (-7.5 * s.astype(cp.float32) * rs.uniform(0.8, 1.2, (rows, groups))).astype(cp.float16)
    return QuantMatrix("int4", q, s, m, n_in, group)


def _device_reference(w, x):
    """float64 W·x on the device from w's own codes, scales and mins. -> host [rows]"""
    import cupy as cp
    x64 = x.astype(cp.float64)
    if w.method == "int8":
        return cp.asnumpy((w.qweight[:, :w.in_features].astype(cp.float64) @ x64) * w.scales.astype(cp.float64))
    rows, g = w.shape[0], w.group_size
    b = w.qweight
    codes = cp.stack([b & 15, b >> 4], -1).reshape(rows, -1)[:, :w.in_features].astype(cp.float64)
    xp = cp.zeros(w.n_groups * g, cp.float64)
    xp[:w.in_features] = x64
    codes_x = cp.zeros((rows, w.n_groups * g), cp.float64)
    codes_x[:, :w.in_features] = codes
    per_group = cp.einsum("rgk,gk->rg", codes_x.reshape(rows, w.n_groups, g), xp.reshape(w.n_groups, g))
    sums = xp.reshape(w.n_groups, g).sum(1)
    return cp.asnumpy((per_group * w.scales.astype(cp.float64)).sum(1) + w.mins.astype(cp.float64) @ sums)


def check_large(k, method: str, rows: int, n_in: int, group: int = 128, seed: int = 0) -> tuple[float, float]:
    """One big plain GEMV (the Mistral-7B shapes) against the device float64 reference."""
    import cupy as cp
    from minillm.cuda.dev.common import QUANT_TOL, poisoned, rel_err
    w = _device_matrix(method, rows, n_in, group, seed)
    x = cp.asarray(np.random.default_rng(seed).standard_normal(n_in).astype(np.float32))
    y = poisoned(rows, np.float32)
    k.gemv(w, x, y)
    cp.cuda.Device().synchronize()
    return rel_err(cp.asnumpy(y), _device_reference(w, x)), QUANT_TOL


def _cases() -> list:
    """(label, check(k3)) pairs for v3 (k3: Kernels with quant_version=3): gemv.py's checks, then the
    Mistral-7B shapes. Each check -> (error, tolerance)."""
    from minillm.cuda.dev.gemv import check_gemv, check_gemv_qkv, check_gemv_rmsnorm, check_gemv_swiglu
    out = []
    for m in ("int8", "int4"):
        out += [
            (f"{m} 257x4096 accumulate", lambda k3, m=m: check_gemv(k3, 257, 4096, 4, True, quant=m)),
            (f"{m} 13x201 (odd in, rows % 16)", lambda k3, m=m: check_gemv(k3, 13, 201, 4, quant=m)),
            (f"{m} 1x16", lambda k3, m=m: check_gemv(k3, 1, 16, 4, quant=m)),
            (f"{m} 77x1000", lambda k3, m=m: check_gemv(k3, 77, 1000, 4, quant=m, seed=3)),
            (f"{m} 64x14336 accumulate", lambda k3, m=m: check_gemv(k3, 64, 14336, 4, True, quant=m)),
            (f"{m} g256 40x1030", lambda k3, m=m: check_gemv(k3, 40, 1030, 4, quant=m, group_size=256)),
            (f"{m} g32 (int4: v2) 33x300", lambda k3, m=m: check_gemv(k3, 33, 300, 4, quant=m, group_size=32)),
            (f"{m} +rmsnorm 101x4096", lambda k3, m=m: check_gemv_rmsnorm(k3, 101, 4096, version=4, quant=m)),
            (f"{m} +rmsnorm 7x14336", lambda k3, m=m: check_gemv_rmsnorm(k3, 7, 14336, version=4, quant=m)),
            (f"{m} swiglu ffn 300 in 4096", lambda k3, m=m: check_gemv_swiglu(k3, 300, 4096, False, quant=m)),
            (f"{m} +rmsnorm+swiglu ffn 1000 in 576",
             lambda k3, m=m: check_gemv_swiglu(k3, 1000, 576, True, quant=m)),
            (f"{m} +rmsnorm+qkv+rope+kv 32+8x128",
             lambda k3, m=m: check_gemv_qkv(k3, 32, 8, 128, 4096, 4000, 4100, True, quant=m)),
            (f"{m} qkv+rope+kv 9+3x64 in 576",
             lambda k3, m=m: check_gemv_qkv(k3, 9, 3, 64, 576, 17, 40, False, quant=m)),
        ]
        for name, (rows, n_in) in _mistral_shapes().items():
            out.append((f"{m} Mistral-7B {name} {rows}x{n_in}",
                        lambda k3, m=m, rows=rows, n_in=n_in: check_large(k3, m, rows, n_in)))
        u4 = lambda k3: k3.with_settings(quant_mma_substeps=4)
        out += [(f"{m} U=4 257x4200 accumulate", lambda k3, m=m: check_gemv(u4(k3), 257, 4200, 4, True, quant=m)),
                (f"{m} U=4 Mistral-7B down", lambda k3, m=m: check_large(u4(k3), m, 4096, 14336))]
    return out


CASE_LABELS = [label for label, _ in _cases()]


def check_case(k, label: str) -> tuple[float, float]:
    """The v3 check named `label` (one of CASE_LABELS) on Kernels k. -> (error, tolerance)"""
    from minillm.cuda.dev.lab import as_lab
    return dict(_cases())[label](as_lab(k).with_settings(quant_version=3))


def cases(k) -> list:
    """(label, check) pairs for dev.common.run_cases."""
    return [(f"v3 {label}", lambda label=label: check_case(k, label)) for label in CASE_LABELS]


def matrix_us(versions: dict, method: str, rows: int, n_in: int, group: int = 128) -> tuple[dict, int]:
    """One Mistral-7B-sized quantized matrix as a plain GEMV under each of `versions` ({label: Kernels}): µs a
    launch in a CUDA graph over enough copies (>= 160 MB) that none is still in L2 when its turn comes again.
    -> ({label: µs}, the matrix's bytes)"""
    import cupy as cp
    from minillm.cuda.timing import graph_us
    first = _device_matrix(method, rows, n_in, group, 7)
    copies = [first] + [_device_matrix(method, rows, n_in, group, 8 + j)
                        for j in range(min(15, -(-(160 << 20) // first.nbytes)))]
    x = cp.asarray(np.random.default_rng(0).standard_normal(n_in).astype(np.float32))
    y = cp.empty(rows, cp.float32)
    us = {v: graph_us(lambda i, kv=kv, copies=copies: kv.gemv(copies[i % len(copies)], x, y), 2 * len(copies))
          for v, kv in versions.items()}
    nbytes = first.nbytes
    del copies, first
    cp.get_default_memory_pool().free_all_blocks()
    return us, nbytes


def timings(group: int = 128) -> list[list]:
    """Each Mistral-7B matrix, int8 and int4, v2 vs v3 as a plain GEMV (matrix_us)."""
    from minillm.cuda.dev.common import plain_table
    from minillm.cuda.timing import copy_bandwidth
    from minillm.cuda.dev.lab import LabKernels
    k = LabKernels("float16")
    versions = {"v2": k.with_settings(quant_version=2), "v3": k.with_settings(quant_version=3),
                "v3 1/tile": k.with_settings(quant_version=3, quant_mma_blocks_per_sm=0),   # grid variants
                "v3 2/SM": k.with_settings(quant_version=3, quant_mma_blocks_per_sm=2),
                "v3 U=4": k.with_settings(quant_version=3, quant_mma_substeps=4, quant_mma_blocks_per_sm=2)}
    bw = copy_bandwidth(1 << 30)
    table = []
    for method in ("int8", "int4"):
        for name, (rows, n_in) in _mistral_shapes().items():
            us, nbytes = matrix_us(versions, method, rows, n_in, group)
            gbs = {v: nbytes / (t * 1e-6) / 1e9 for v, t in us.items()}
            table.append([method, name, f"{rows}x{n_in}", f"{nbytes / 1e6:.1f}", f"{us['v2']:.1f}",
                          f"{us['v3']:.1f}", f"{gbs['v2']:.0f}", f"{gbs['v3']:.0f}", f"{gbs['v3'] / (bw / 1e9):.0%}",
                          f"{us['v2'] / us['v3']:.2f}x", f"{us['v3 1/tile']:.1f}", f"{us['v3 2/SM']:.1f}",
                          f"{us['v3 U=4']:.1f}"])
    plain_table(f"plain y = W·x, µs a launch in a CUDA graph; copy roofline {bw / 1e12:.2f} TB/s",
                ["method", "matrix", "shape", "MB", "v2 µs", "v3 µs", "v2 GB/s", "v3 GB/s", "v3 % copy", "v2/v3",
                 "v3 µs, a block a tile", "v3 µs, 2 blocks/SM", "v3 U=4 µs (2 blocks/SM)"],
                table)
    return table


def quantized_mistrals(prompt_len: int, n_new: int, methods=("int8", "int4")):
    """(method, a random Mistral-7B in fp16 with `method` layer weights ("float16": none quantized), a cache for
    prompt_len + n_new tokens, a random prompt) for each method in turn (its cached blocks are released once
    the caller's loop has moved on to the next: ~7.5 + 4 GB at most for int8, int4)."""
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.model.config import PRESETS
    cfg = PRESETS["mistral-7b"].config
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len)
    for method in methods:
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=None if method == "float16" else method)
        yield method, gpu, gpu.new_cache(prompt_len + n_new + 8), prompt
        del gpu
        cp.get_default_memory_pool().free_all_blocks()


def decode(n_new: int = 128, prompt_len: int = 16, variants: dict | None = None,
           methods=("int8", "int4")) -> list[list]:
    """Batch-1 decode of a random Mistral-7B (layer weights in each of `methods`) with the CUDA graph under each
    of `variants` ({label: KernelSettings changes}; default v2 vs v3): tok/s against the first, and how many
    greedy tokens each agrees with the first on (random weights: a near-tie may part them; a broken kernel
    parts at once)."""
    from minillm.cuda.dev.common import TARGETS, plain_table
    from minillm.cuda.timing import decode_tok_s
    from minillm.cuda.dev.lab import as_lab_model
    variants = variants or {"v2": {}, "v3": {"quant_version": 3}}
    base = next(iter(variants))
    table = []
    for method, gpu, cache, prompt in quantized_mistrals(prompt_len, n_new, methods):
        runs = {v: decode_tok_s(as_lab_model(gpu).with_settings(**changes), cache, prompt, n_new)
                for v, changes in variants.items()}
        tps0, tok0 = runs[base]
        for v, (tps, tok) in runs.items():
            same = next((i for i, (a, b) in enumerate(zip(tok0, tok)) if a != b), len(tok0))
            table.append([method, v, f"{tps:.1f}", f"{tps / tps0:.2f}x", TARGETS[method], f"{same} of {len(tok0)}"])
    plain_table(f"decode, random Mistral-7B, batch 1, {n_new} new tokens after {prompt_len}, CUDA graph",
                ["method", "kernels", "tok/s", f"vs {base}", "H200 target", f"greedy tokens equal to {base}'s"], table)
    return table


def main(argv=None) -> int:
    from minillm.cuda.dev.common import finish, require_gpu, run_cases
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.qmma", description=__doc__.split("\n")[0])
    ap.add_argument("--no-timing", action="store_true", help="checks only")
    ap.add_argument("--decode", action="store_true", help="also decode tok/s of a random Mistral-7B, v2 vs v3")
    args = ap.parse_args(argv)
    if not require_gpu("qmma"):
        return 2
    run_cases(cases, dtypes=("float16",))
    if not args.no_timing:
        timings()
    if args.decode:
        decode()
    return finish("qmma")


if __name__ == "__main__":
    sys.exit(main())
