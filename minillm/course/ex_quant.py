"""Exercises 08-10 and 14, quantization: int8 rows, int4 groups packed two a byte, int8 KV vectors,
and int4 codes read as the GPU kernel's 32-bit words. Each has its cases, its check and its reference."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_close, expect_unchanged


# 08-10: quantization: int8 rows, int4 groups, int8 KV vectors ------------------------------------

def quantize_int8_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The engine's `quant.quantize_int8`, as the exercise's (codes, scales) tuple."""
    from minillm.model.quant import quantize_int8
    q = quantize_int8(w)
    return q.qweight, q.scales


def quantize_int4_reference(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's `quant.quantize_int4`, as the exercise's (packed, scales, mins) tuple."""
    from minillm.model.quant import quantize_int4
    q = quantize_int4(w, group_size)
    return q.qweight, q.scales, q.mins


def quantize_kv_int8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What `kv_cache.Int8KVCache.append` stores for x [n_kv_heads, T, head_dim]: codes and [n_kv_heads, T] scales."""
    from minillm.model.quant import quantize_int8
    n_kv, T, hd = x.shape
    q = quantize_int8(x.reshape(n_kv * T, hd))                             # one scale per vector
    return q.qweight.reshape(n_kv, T, hd), q.scales.reshape(n_kv, T)


def _expect_int8_codes(w: np.ndarray, q, scales, want_q: np.ndarray, want_scales: np.ndarray,
                       scale_of: str) -> str:
    """Shared by exercises 08 and 10: int8 codes and their fp32 scales, one scale per `scale_of`."""
    if scales.shape != want_scales.shape:
        raise CaseFailed(f"scales has shape {list(scales.shape)}, expected {list(want_scales.shape)}: "
                         f"one scale per {scale_of}")
    if not np.all(np.isfinite(scales)):
        raise CaseFailed("scales has NaN/inf values")
    if not np.allclose(scales, want_scales, rtol=1e-5, atol=1e-12):
        flat = w.reshape(want_scales.size, -1)
        for wrong, hint in ((flat.max(axis=1) / 127, "the scale uses max(w); it is max(|w|): a vector whose "
                                                     "largest magnitude is negative must fit too"),
                            (np.abs(flat).max(axis=1) / 128, "divides by 128: the codes are -127..127, "
                                                             "so scale = max|w| / 127")):
            if np.allclose(scales.ravel(), wrong, rtol=1e-5, atol=1e-12):
                raise CaseFailed(hint)
        i = np.unravel_index(int(np.argmax(np.abs(scales - want_scales))), scales.shape)
        raise CaseFailed(f"scale of {scale_of} {list(map(int, i))} is {float(scales[i]):.6g}, expected "
                         f"{float(want_scales[i]):.6g} (= max |w| / 127 over that {scale_of})")
    if q.shape != want_q.shape:
        raise CaseFailed(f"codes have shape {list(q.shape)}, expected {list(want_q.shape)}")
    if q.dtype != np.int8:
        raise CaseFailed(f"codes are {q.dtype}; store them as np.int8, one byte each (that is the point)")
    diff = q.astype(np.int32) - want_q.astype(np.int32)
    if diff.any():
        # A code may differ by one only where w / scale lands on a rounding tie (x.5) within float error.
        safe = np.where(want_scales > 0, want_scales, 1.0)[..., None]
        exact = w.reshape(want_q.shape).astype(np.float64) / safe
        tie = np.abs(np.abs(exact - np.floor(exact)) - 0.5) < 1e-3
        bad = (diff != 0) & ~((np.abs(diff) == 1) & tie)
        if bad.any():
            i = tuple(int(a[0]) for a in np.nonzero(bad))
            raise CaseFailed(f"code at index {list(i)} is {int(q[i])}, expected {int(want_q[i])} "
                             f"(w = {float(w.reshape(want_q.shape)[i]):.6g}, scale {float(want_scales[i[:-1]]):.6g}: "
                             f"round(w / scale), clipped to -127..127)")
    return f"codes {list(q.shape)} and scales {list(scales.shape)} match"


# 08: int8 per output row ------------------------------------------------------------------------------

def _int8_cases() -> list[Case]:
    rng = case_rng(8)

    def normal(*shape, s=0.05):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    negative = normal(4, 32)
    negative[1, 5] = -0.9                         # row 1's largest magnitude is negative
    zero_row = normal(3, 16)
    zero_row[2] = 0.0
    outlier = normal(2, 64)
    outlier[0, 7] = 5.0                           # one weight 100x the rest
    return [Case("8 rows of 64 weights", dict(w=normal(8, 64))),
            Case("SmolLM2's shape: q_proj [576, 576]", dict(w=normal(576, 576, s=0.03))),
            Case("non-square [3, 100]: one scale per row (output channel)", dict(w=normal(3, 100))),
            Case("a row whose largest |w| is negative", dict(w=negative)),
            Case("an all-zero row: scale 0, codes 0 (no NaN)", dict(w=zero_row)),
            Case("an outlier 100x the rest: the row's small weights round to few codes", dict(w=outlier))]


def _check_int8(fn, case: Case) -> str:
    w = case.inputs["w"]
    w_in = w.copy()
    got = _expect_tuple(fn(w_in), 2, "codes, scales")
    expect_unchanged("w", w, w_in)
    want_q, want_s = quantize_int8_reference(w)
    q, scales = got
    if scales.shape == (w.shape[1],) and w.shape[0] != w.shape[1]:
        raise CaseFailed(f"scales has shape {list(scales.shape)} (one per column); expected {[w.shape[0]]}: "
                         f"one scale per row, i.e. per output channel (max over axis 1)")
    return _expect_int8_codes(w, q, scales, want_q, want_s, "row")


# 09: int4 in groups, packed two a byte -------------------------------------------------------------

def _int4_cases() -> list[Case]:
    rng = case_rng(9)

    def normal(*shape, s=0.05, shift=0.0):
        return (rng.standard_normal(shape) * s + shift).astype(np.float32)
    return [Case("one row of 32 weights, groups of 32", dict(w=normal(1, 32), group_size=32)),
            Case("[8, 256] in groups of 128", dict(w=normal(8, 256), group_size=128)),
            Case("SmolLM2's width: [6, 576] in groups of 64", dict(w=normal(6, 576), group_size=64)),
            Case("in = 100, not a multiple of 64: pad the last group", dict(w=normal(4, 100), group_size=64)),
            Case("all weights positive (min > 0): the asymmetric grid starts at the min",
                 dict(w=np.abs(normal(3, 64)) + 0.2, group_size=32)),
            Case("a constant group: scale 0, codes 0 (no NaN)",
                 dict(w=np.concatenate([np.full((2, 32), 0.5, np.float32), normal(2, 32)], axis=1), group_size=32))]


def _check_int4(fn, case: Case) -> str:
    from minillm.model.quant import unpack_int4
    w, g = case.inputs["w"], case.inputs["group_size"]
    w_in = w.copy()
    got = _expect_tuple(fn(w_in, g), 3, "packed, scales, mins")
    expect_unchanged("w", w, w_in)
    want_p, want_s, want_m = quantize_int4_reference(w, g)
    packed, scales, mins = got
    out_dim, in_dim = w.shape
    padded = want_p.shape[1] * 2
    if packed.shape != want_p.shape:
        if packed.shape == (out_dim, padded):
            raise CaseFailed(f"packed has shape {list(packed.shape)}: one code a byte; pack two a byte "
                             f"(expected {list(want_p.shape)})")
        if padded != in_dim and packed.shape[1] * 2 in (in_dim, in_dim - in_dim % g, in_dim + 1):
            raise CaseFailed(f"packed has shape {list(packed.shape)}, expected {list(want_p.shape)}: pad each row "
                             f"to a whole number of groups ({in_dim} -> {padded}) by repeating its last weight")
        raise CaseFailed(f"packed has shape {list(packed.shape)}, expected {list(want_p.shape)}")
    if packed.dtype != np.uint8:
        raise CaseFailed(f"packed is {packed.dtype}; it must be np.uint8 (two 4-bit codes in each byte)")
    for name, got_a, want_a in (("scales", scales, want_s), ("mins", mins, want_m)):
        if got_a.shape != want_a.shape:
            raise CaseFailed(f"{name} has shape {list(got_a.shape)}, expected {list(want_a.shape)}: one per group "
                             f"of {g} weights of a row")
        if got_a.dtype != np.float16:
            raise CaseFailed(f"{name} is {got_a.dtype}; store it as np.float16 (2 bytes a group)")
    # fp16 rounding of the scale and min may differ from the engine's by an ulp or two, no more.
    tol = dict(rtol=3e-3, atol=1e-4 * max(1e-3, float(np.abs(w).max())))
    if not np.allclose(mins.astype(np.float32), want_m.astype(np.float32), **tol):
        if np.allclose(mins.astype(np.float32), 0, atol=1e-6):
            raise CaseFailed("mins are all 0: the grid is asymmetric, each group starts at its own minimum")
        raise CaseFailed(f"mins differ from the groups' minimum: {_worst(mins, want_m)}")
    if not np.allclose(scales.astype(np.float32), want_s.astype(np.float32), **tol):
        raise CaseFailed(f"scales differ from (max - min) / 15 of each group: {_worst(scales, want_s)}")
    codes, want_codes = unpack_int4(packed), unpack_int4(want_p)              # [out, padded]
    diff = np.abs(codes.astype(np.int32) - want_codes)
    if (diff > 1).any() or diff.mean() > 0.05:
        swapped = unpack_int4(((packed & 0x0F) << 4 | packed >> 4).astype(np.uint8))
        if np.abs(swapped.astype(np.int32) - want_codes).max() <= 1:
            raise CaseFailed("the nibbles are swapped: element 2j goes in the LOW 4 bits of byte j, element "
                             "2j+1 in the HIGH 4 bits")
        r, j = (int(a[0]) for a in np.nonzero(diff > 1 if (diff > 1).any() else diff > 0))
        raise CaseFailed(f"code of row {r}, element {j} (group {j // g}) is {int(codes[r, j])}, expected "
                         f"{int(want_codes[r, j])}: round((w - min) / scale), clipped to 0..15")
    # Dequantized with the student's own scales and mins, every weight is within half a step.
    s = np.repeat(scales.astype(np.float32), g, axis=1)[:, :in_dim]
    m = np.repeat(mins.astype(np.float32), g, axis=1)[:, :in_dim]
    err = np.abs(codes[:, :in_dim] * s + m - w)
    if (err > 0.55 * s + 1e-6).any():
        r, j = (int(a[0]) for a in np.nonzero(err > 0.55 * s + 1e-6))
        raise CaseFailed(f"weight [{r}, {j}] comes back {err[r, j]:.3g} off, more than half its group's step "
                         f"{s[r, j]:.3g}: the grid [min, min + 15·scale] must cover the group")
    return f"packed {list(packed.shape)}, {scales.shape[1]} group(s) a row, max error {err.max():.2g} <= scale / 2"


def _worst(got: np.ndarray, want: np.ndarray) -> str:
    i = np.unravel_index(int(np.argmax(np.abs(got.astype(np.float32) - want.astype(np.float32)))), got.shape)
    return f"row {int(i[0])}, group {int(i[1])}: got {float(got[i]):.5g}, expected {float(want[i]):.5g}"


# 10: int8 KV cache vectors --------------------------------------------------------------------------

def _kv_int8_cases() -> list[Case]:
    rng = case_rng(10)

    def normal(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    outlier = normal(3, 6, 64)
    outlier[1, 4] *= 20.0                         # one token of one head is 20x larger
    negative = normal(2, 3, 16)
    negative[0, 2, 9] = -40.0
    padding = normal(3, 5, 64)
    padding[:, 4] = 0.0
    return [Case("decode: one new position, 3 KV heads, head_dim 64 (SmolLM2)", dict(x=normal(3, 1, 64))),
            Case("prefill: 16 positions, 3 KV heads, head_dim 64", dict(x=normal(3, 16, 64, s=2.0))),
            Case("one token 20x larger: only its own scale grows", dict(x=outlier)),
            Case("a vector whose largest |x| is negative", dict(x=negative)),
            Case("an all-zero vector: scale 0, codes 0 (no NaN)", dict(x=padding)),
            Case("Mistral's shape: 8 KV heads, head_dim 128, 4 positions", dict(x=normal(8, 4, 128)))]


def _check_kv_int8(fn, case: Case) -> str:
    x = case.inputs["x"]
    x_in = x.copy()
    q, scales = _expect_tuple(fn(x_in), 2, "codes, scales")
    expect_unchanged("x", x, x_in)
    want_q, want_s = quantize_kv_int8_reference(x)
    n_kv, T, hd = x.shape
    if scales.shape == want_s.shape and T > 1:
        per_head = np.broadcast_to(np.abs(x).max(axis=(1, 2))[:, None] / 127, want_s.shape)
        if np.allclose(scales, per_head, rtol=1e-5) and not np.allclose(want_s, per_head, rtol=1e-5):
            raise CaseFailed("one scale per head for all positions: a large token then coarsens every token's "
                             "grid; give each (head, position) vector of head_dim values its own scale")
    if scales.shape in ((n_kv,), (T,), (hd,), (n_kv, hd), (T, hd)):
        raise CaseFailed(f"scales has shape {list(scales.shape)}, expected {[n_kv, T]}: one scale per "
                         f"(KV head, position), the max over head_dim")
    return _expect_int8_codes(x, q, scales, want_q, want_s, "(KV head, position) vector")


# 14: int4 codes as the GPU kernel reads them: 32-bit words ---------------------------------------------

def dequantize_int4_words_reference(words: np.ndarray, scales: np.ndarray, mins: np.ndarray,
                                    in_features: int) -> np.ndarray:
    """W fp32 [out, in_features] from minillm.model.quant's int4 layout with the packed bytes read 4 at a time as
    little-endian 32-bit words (what kernels/gemv_quant.cu's 16-byte loads hold): the engine's
    Int4Weight.dequantize on the same bytes."""
    from minillm.model.quant import Int4Weight
    packed = np.ascontiguousarray(words).astype("<u4").view(np.uint8).reshape(words.shape[0], -1)
    return Int4Weight(packed, scales, mins, in_features).dequantize()


def _int4_words(rows: int, cols: int, group: int, seed: int, codes: np.ndarray | None = None) -> dict:
    from minillm.model.quant import Int4Weight, pack_int4, quantize_int4
    rng = case_rng(seed)
    q = quantize_int4((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), group)
    if codes is not None:                                  # chosen codes, to expose the order of the nibbles
        q = Int4Weight(pack_int4(codes), q.scales, q.mins, cols)
    return dict(words=q.qweight.view("<u4").copy(), scales=q.scales.copy(), mins=q.mins.copy(), in_features=cols)


def _int4_word_cases() -> list[Case]:
    ramp = np.tile(np.arange(32, dtype=np.uint8) % 16, (2, 2))                   # codes 0, 1, ..., 15, 0, ... [2, 64]
    return [Case("one row, one group of 32 (SmolLM2's Q4_1 grid)", _int4_words(1, 32, 32, 1)),
            Case("codes 0, 1, 2, ..., 15 in order: which nibble is element 0?", _int4_words(2, 64, 32, 2, ramp)),
            Case("4 rows x 256, groups of 128 (the engine's default)", _int4_words(4, 256, 128, 3)),
            Case("in = 200 in groups of 64: the last group is padded, drop columns past in_features",
                 _int4_words(3, 200, 64, 4)),
            Case("3 rows of SmolLM2's width 576 in groups of 128 (4.5 groups)", _int4_words(3, 576, 128, 5))]


def _int4_words_variant(words, scales, mins, in_features, swap_nibbles=False, big_endian=False):
    """The classic wrong readings of the words, for hints."""
    b = np.ascontiguousarray(words).astype(">u4" if big_endian else "<u4").view(np.uint8).reshape(words.shape[0], -1)
    if swap_nibbles:
        b = ((b & 0x0F) << 4) | (b >> 4)
    return dequantize_int4_words_reference(b.view("<u4"), scales, mins, in_features)


def _check_int4_words(fn, case: Case) -> str:
    c = case.inputs
    inputs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in c.items()}
    got = fn(inputs["words"], inputs["scales"], inputs["mins"], inputs["in_features"])
    for name in ("words", "scales", "mins"):
        expect_unchanged(name, c[name], inputs[name])
    want = dequantize_int4_words_reference(c["words"], c["scales"], c["mins"], c["in_features"])
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-5, atol=1e-7):
        for kw, hint in ((dict(swap_nibbles=True), "element 2j is the LOW nibble of byte j (bits 0-3), element "
                                                    "2j+1 the high one: nibble i of a word is element i"),
                         (dict(big_endian=True), "the words are little-endian: byte 0 (elements 0 and 1) is the "
                                                 "least significant byte, bits 0-7")):
            if np.allclose(got, _int4_words_variant(**c, **kw), rtol=1e-5, atol=1e-7):
                raise CaseFailed(hint)
    return expect_close("W", got, want, rtol=1e-5, atol=1e-7)
