"""Exercise 24, FlashAttention's online softmax: merge two partial attention results, each over its
own keys, into the result over all of them (the combine of decode_attention.cu's key splits, and the
step lesson 24's tile loop takes once per tile)."""
from __future__ import annotations

import math

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_close, expect_unchanged


def merge_partials_reference(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """attention_combine of minillm/cuda/dev/kernels/attention_v1.cu in NumPy, for two partials.

    m: [...] the largest score a part saw (-inf: it saw no key), l: [...] its sum of exp(score - m),
    acc: [..., hd] its sum of exp(score - m)·v.   -> (m, l, acc) of the keys of both parts."""
    m = np.maximum(m_a, m_b)                                           # [...]
    # A part that saw no key (m = -inf) weighs 0; when neither did, m stays -inf and e^(-inf - -inf)
    # would be NaN, so the weight is taken as 0 rather than computed.
    w_a = np.where(m_a == -np.inf, 0.0, np.exp(m_a - np.where(m == -np.inf, 0.0, m))).astype(np.float32)
    w_b = np.where(m_b == -np.inf, 0.0, np.exp(m_b - np.where(m == -np.inf, 0.0, m))).astype(np.float32)
    return m, l_a * w_a + l_b * w_b, acc_a * w_a[..., None] + acc_b * w_b[..., None]


def partial_attention(q, k, v):
    """The (m, l, acc) of rows q over keys k, values v, no mask: what one split or tile leaves behind.

    q: [rows, hd] (already scaled by 1/√hd)   k, v: [n_keys, hd]   -> m [rows], l [rows], acc [rows, hd]"""
    rows, hd = q.shape
    if k.shape[0] == 0:                                                # a part with no keys
        return (np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32), np.zeros((rows, hd), np.float32))
    s = q @ k.T                                                        # [rows, n_keys]
    m = s.max(axis=1)                                                  # [rows]
    p = np.exp(s - m[:, None])                                         # [rows, n_keys], each ≤ 1
    return m, p.sum(axis=1), p @ v                                     # [rows], [rows], [rows, hd]


def _merge_cases() -> list[Case]:
    rng = case_rng(24)

    def split(name, rows, hd, n_a, n_b, shift=0.0, scale=1.0):
        q = (rng.standard_normal((rows, hd)) * scale / math.sqrt(hd)).astype(np.float32)
        k = rng.standard_normal((n_a + n_b, hd)).astype(np.float32)
        v = rng.standard_normal((n_a + n_b, hd)).astype(np.float32)
        a, b = partial_attention(q, k[:n_a], v[:n_a]), partial_attention(q, k[n_a:], v[n_a:])
        if shift:                     # the same keys' scores all moved by `shift`: m moves, l and acc do not
            a = (a[0] + np.float32(shift), a[1], a[2])
            b = (b[0] + np.float32(shift), b[1], b[2])
        return Case(name, dict(parts=a + b, q=q, k=k, v=v))

    def empty_both(name, rows, hd):
        nothing = (np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32), np.zeros((rows, hd), np.float32))
        return Case(name, dict(parts=nothing + nothing))
    return [split("two halves of 64 keys, 4 rows, hd 16", 4, 16, 32, 32),
            split("uneven parts: 3 keys and 61 keys", 5, 8, 3, 61),
            split("part a's max is far above part b's (sharp scores)", 6, 16, 40, 24, scale=12.0),
            split("scores near 1000: exp(m) overflows float32 unless you subtract the new max", 3, 8, 16, 16,
                  shift=1000.0),
            split("part b saw no key (m = -inf, l = 0, acc = 0: a masked tile)", 4, 8, 20, 0),
            split("part a saw no key", 4, 8, 0, 20),
            empty_both("neither part saw a key (a row the mask hides entirely): m -inf, l 0, acc 0, no NaN", 3, 8)]


def _check_merge(fn, case: Case) -> str:
    parts = case.inputs["parts"]
    given = tuple(p.copy() for p in parts)
    got = _expect_tuple(fn(*given), 3, "m, l, acc")
    for name, before, after in zip(("m_a", "l_a", "acc_a", "m_b", "l_b", "acc_b"), parts, given):
        expect_unchanged(name, before, after)
    want = merge_partials_reference(*parts)
    if np.any(np.isnan(got[0]) | np.isnan(got[1])) or np.any(np.isnan(got[2])):
        raise CaseFailed("returned NaN: a part with m = -inf has weight 0 (and exp(-inf - (-inf)) is NaN: "
                         "test for it instead of computing it)")
    m_ok = np.array_equal(got[0], want[0])
    if not m_ok:
        raise CaseFailed(f"m: expected the larger of m_a and m_b per row, e.g. {want[0][:3].tolist()}, "
                         f"got {np.asarray(got[0])[:3].tolist()}")
    summary = [expect_close("l", got[1], want[1]), expect_close("acc", got[2], want[2])]
    if "q" in case.inputs:       # the merged state normalizes to attention over all the keys
        q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
        s = q @ k.T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        # Loose: scores near 1000 keep only ~6e-5 of float32 resolution in m, and so in every weight.
        expect_close("acc / l (the attention output)", got[2] / got[1][:, None], (p / p.sum(1, keepdims=True)) @ v,
                     rtol=1e-3, atol=1e-4)
    return "; ".join(summary)
