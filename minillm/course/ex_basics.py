"""Exercises 01-04, the forward pass's basics: RMSNorm, writing into the KV cache, RoPE, top-p.
Each has its cases, its check, and (where it needs an adapter) the engine's reference."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_close, expect_unchanged


# 01: RMSNorm ------------------------------------------------------------------------------------

def _rmsnorm_cases() -> list[Case]:
    rng = case_rng(1)

    def case(name, T, dim, scale=1.0, eps=1e-5):
        x = ((rng.standard_normal((T, dim)) + 0.5) * scale).astype(np.float32)   # mean ≠ 0: not LayerNorm
        weight = (1.0 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
        return Case(name, dict(x=x, weight=weight, eps=eps))
    return [case("4 positions, dim 64", 4, 64),
            case("one position (a decode step), dim 576 like SmolLM2", 1, 576),
            case("tiny activations (|x| ~ 1e-4), where eps matters", 3, 32, scale=1e-4),
            case("large activations (|x| ~ 1e3)", 3, 32, scale=1e3),
            case("eps 1e-2 on small activations: eps goes inside the square root", 2, 16, scale=0.05, eps=1e-2)]


def _check_rmsnorm(fn, case: Case) -> str:
    from minillm.model.layers import rmsnorm
    x, weight, eps = case.inputs["x"], case.inputs["weight"], case.inputs["eps"]
    x_in, w_in = x.copy(), weight.copy()
    got = fn(x_in, w_in, eps)
    expect_unchanged("x", x, x_in)
    expect_unchanged("weight", weight, w_in)
    return expect_close("output", got, rmsnorm(x, weight, eps))


# 02: writing into the KV cache ------------------------------------------------------------------

def kv_cache_update_reference(cache_k, cache_v, k_new, v_new, pos):
    """The engine's KVCache.append, for one layer's arrays given by the caller (the exercise's contract)."""
    from minillm.model.config import ModelConfig
    from minillm.model.kv_cache import KVCache
    n_kv, max_seq, hd = cache_k.shape
    shape = ModelConfig(vocab_size=1, dim=n_kv * hd, n_layers=1, n_heads=n_kv, n_kv_heads=n_kv,
                        ffn_dim=1, head_dim=hd)
    cache = KVCache(shape, 0, dtype=cache_k.dtype)
    cache.k, cache.v = cache_k[None], cache_v[None]        # views: the engine writes into the caller's arrays
    cache.max_seq_len, cache.length = max_seq, pos
    return cache.append(0, k_new, v_new)


def _kv_cases() -> list[Case]:
    def case(name, n_kv, max_seq, hd, T, pos):
        return Case(name, dict(n_kv=n_kv, max_seq=max_seq, hd=hd, T=T, pos=pos))
    return [case("prefill: 5 positions into an empty cache (pos 0)", 3, 16, 8, 5, 0),
            case("decode: one position at pos 7", 3, 16, 8, 1, 7),
            case("a chunk of 4 positions after 9 cached ones", 2, 16, 4, 4, 9),
            case("the last free slot (pos 15 of 16)", 3, 16, 8, 1, 15),
            case("overflow: 3 positions at pos 14 of 16 must raise ValueError", 3, 16, 8, 3, 14)]


def _check_kv(fn, case: Case) -> str:
    c = case.inputs
    rng = case_rng(c["pos"] * 31 + c["T"])
    n_kv, max_seq, hd, T, pos = c["n_kv"], c["max_seq"], c["hd"], c["T"], c["pos"]
    # Stale values everywhere (never zeros), so a write to the wrong place cannot hide.
    cache_k, cache_v = (rng.standard_normal((n_kv, max_seq, hd)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((n_kv, T, hd)).astype(np.float32) + 3.0 for _ in range(2))
    got_k, got_v = cache_k.copy(), cache_v.copy()
    if pos + T > max_seq:
        try:
            fn(got_k, got_v, k_new.copy(), v_new.copy(), pos)
        except ValueError:
            return "raised ValueError"
        raise CaseFailed(f"pos + T = {pos + T} > capacity {max_seq}, but no ValueError was raised")
    want_k, want_v = cache_k.copy(), cache_v.copy()
    ref = kv_cache_update_reference(want_k, want_v, k_new, v_new, pos)
    out = fn(got_k, got_v, k_new.copy(), v_new.copy(), pos)
    for name, got, want in (("cache_k", got_k, want_k), ("cache_v", got_v, want_v)):
        _expect_cache_written(name, got, want, pos, T)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CaseFailed(f"returned {type(out).__name__}, expected a tuple (keys, values)")
    summary = expect_close("returned keys", out[0], ref[0], rtol=0, atol=0)
    expect_close("returned values", out[1], ref[1], rtol=0, atol=0)
    if not (np.shares_memory(out[0], got_k) and np.shares_memory(out[1], got_v)):
        raise CaseFailed("returned copies, not views of the cache: every decode step would copy the "
                         "whole cache (return cache_k[:, :pos + T] and cache_v[:, :pos + T])")
    return summary


def _expect_cache_written(name: str, got: np.ndarray, want: np.ndarray, pos: int, T: int) -> None:
    wrong = np.flatnonzero(np.any(got != want, axis=(0, 2)))       # positions that differ
    if wrong.size == 0:
        return
    inside = [int(p) for p in wrong if pos <= p < pos + T]
    outside = [int(p) for p in wrong if not pos <= p < pos + T]
    if outside:
        raise CaseFailed(f"{name} changed at position(s) {outside}, outside the new positions "
                         f"[{pos}, {pos + T}): write k_new to slots pos .. pos+T-1 only")
    raise CaseFailed(f"{name} does not hold the new values at position(s) {inside}: write them into the "
                     f"caller's array in place (not into a copy)")


# 03: RoPE ------------------------------------------------------------------------------------------

def _rope_cases() -> list[Case]:
    def case(name, T, heads, hd, theta, start):
        return Case(name, dict(T=T, heads=heads, hd=hd, theta=theta, start=start))
    return [case("prefill: positions 0..5, 4 heads, head_dim 16", 6, 4, 16, 1e4, 0),
            case("decode: one position at 37, 9 heads, head_dim 64", 1, 9, 64, 1e5, 37),
            case("keys like SmolLM2: 3 KV heads, head_dim 64, positions 100..107", 8, 3, 64, 1e5, 100),
            case("long context: positions 8000..8002", 3, 2, 32, 1e4, 8000),
            case("smallest head: head_dim 2", 4, 1, 2, 1e4, 3)]


def _check_rope(fn, case: Case) -> str:
    from minillm.model.layers import apply_rope, rope_inv_freq, rope_tables
    c = case.inputs
    rng = case_rng(c["start"] + c["hd"])
    x = rng.standard_normal((c["T"], c["heads"], c["hd"])).astype(np.float32)
    cos, sin = rope_tables(np.arange(c["start"], c["start"] + c["T"]), rope_inv_freq(c["hd"], c["theta"]))
    x_in, cos_in, sin_in = x.copy(), cos.copy(), sin.copy()
    got = fn(x_in, cos_in, sin_in)
    expect_unchanged("x", x, x_in)
    return expect_close("output", got, apply_rope(x, cos, sin))


# 04: top-p ------------------------------------------------------------------------------------------

def _top_p_cases() -> list[Case]:
    rng = case_rng(4)
    return [Case("vocab 50, p 0.9", dict(logits=rng.normal(0, 2, 50), p=0.9)),
            Case("p 1.0 keeps every token", dict(logits=rng.normal(0, 2, 100), p=1.0)),
            Case("the token that crosses p is kept: probs 0.2/0.5/0.3, p 0.6",
                 dict(logits=np.log([0.2, 0.5, 0.3]), p=0.6)),
            Case("p 0.01 keeps only the most likely token", dict(logits=rng.normal(0, 2, 50), p=0.01)),
            Case("one token holds 99% of the mass, p 0.95",
                 dict(logits=np.concatenate([[10.0], rng.normal(0, 0.1, 20)]), p=0.95)),
            Case("negative logits, p 0.5", dict(logits=rng.normal(-20, 1, 30), p=0.5)),
            Case("float32 logits, vocab 49152 like SmolLM2, p 0.8",
                 dict(logits=rng.normal(0, 3, 49152).astype(np.float32), p=0.8))]


def _check_top_p(fn, case: Case) -> str:
    from minillm.engine.sampling import softmax, top_p_filter
    logits, p = case.inputs["logits"], case.inputs["p"]
    logits_in = logits.copy()
    got = fn(logits_in, p)
    expect_unchanged("logits", logits, logits_in)
    want = top_p_filter(logits, p)
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        raise CaseFailed(f"returned {getattr(got, 'shape', type(got).__name__)}, expected an array "
                         f"of shape {list(want.shape)}")
    if np.isnan(got).any():
        raise CaseFailed("returned NaN; dropped tokens should be -inf")
    kept, want_kept = got != -np.inf, want != -np.inf
    if not np.array_equal(kept, want_kept):
        order = np.argsort(-logits, kind="stable")
        probs = softmax(logits[order].astype(np.float64))
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        mass_above = np.cumsum(probs) - probs
        bad = order[(kept != want_kept)[order]][0]                      # the best-ranked wrong token
        r = int(rank[bad])
        what = (f"token {int(bad)} (rank {r + 1}, prob {probs[r]:.3f}, mass of the tokens above it "
                f"{mass_above[r]:.3f})")
        if want_kept[bad]:
            cross = " — it is the token that carries the mass past p" if mass_above[r] + probs[r] >= p else ""
            raise CaseFailed(f"kept {int(kept.sum())} tokens, expected {int(want_kept.sum())}: dropped {what} "
                             f"< p {p}, which must be kept{cross}")
        raise CaseFailed(f"kept {int(kept.sum())} tokens, expected {int(want_kept.sum())}: kept {what} "
                         f">= p {p}, which must be dropped")
    if not np.allclose(got[kept], logits[kept], rtol=1e-6):
        raise CaseFailed("changed the logits it kept: return them as they were, with the dropped ones at -inf")
    return f"kept {int(kept.sum())} of {len(logits)} tokens"
