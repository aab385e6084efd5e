"""Exercise 02.2, attention over the KV cache: T new queries against every cached key and value,
causal, with grouped KV heads. The reference is the engine's `minillm.model.attention.attend`."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_close, expect_unchanged


def attend_over_cache_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The engine's `attention.attend` (no sliding window)."""
    from minillm.model.attention import attend
    return attend(q, keys, values)


def _cache_attention_cases() -> list[Case]:
    rng = case_rng(2, 2)

    def case(name, T, L, n_heads, n_kv, hd, scale=1.0):
        q = (rng.standard_normal((T, n_heads, hd)) * scale).astype(np.float32)
        k = (rng.standard_normal((n_kv, L, hd)) * scale).astype(np.float32)
        v = rng.standard_normal((n_kv, L, hd)).astype(np.float32)
        return Case(name, dict(q=q, keys=k, values=v))
    return [case("decode: one query over 9 cached positions (4 heads, 2 KV heads)", 1, 9, 4, 2, 8),
            case("prefill of an empty cache: 6 queries over their own 6 keys (MHA)", 6, 6, 3, 3, 8),
            case("a chunk of 3 new queries over 5 cached keys (MQA: one KV head)", 3, 8, 4, 1, 16),
            case("SmolLM2's heads: 9 query heads in 3 groups, head_dim 64", 4, 7, 9, 3, 64),
            case("large scores (x30): the softmax must not overflow", 2, 5, 2, 1, 8, scale=30.0)]


def _check_cache_attention(fn, case: Case) -> str:
    q, k, v = (case.inputs[n] for n in ("q", "keys", "values"))
    qc, kc, vc = q.copy(), k.copy(), v.copy()
    got = fn(qc, kc, vc)
    for name, before, after in (("q", q, qc), ("keys", k, kc), ("values", v, vc)):
        expect_unchanged(name, before, after)
    want = attend_over_cache_reference(q, k, v)
    if isinstance(got, np.ndarray) and got.shape == want.shape and not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        for wrong, hint in ((_attend(q, k, v, causal=False), "every query saw every key: mask the keys after "
                             "each query's own position (the queries are the LAST T of the L positions)"),
                            (_attend(q, k, v, scale=1.0), "scores not divided by sqrt(head_dim)"),
                            (_attend(q, k, v, interleaved=True), "query head h used KV head h % n_kv_heads; "
                             "heads come in groups: head h uses KV head h // (n_heads // n_kv_heads)")):
            if np.allclose(got, wrong, rtol=1e-4, atol=1e-5):
                raise CaseFailed(hint)
    if isinstance(got, np.ndarray) and got.ndim == 3 and got.shape[0] == want.shape[0]:
        raise CaseFailed(f"returned shape {list(got.shape)}: flatten the heads, [T, n_heads * head_dim]")
    return expect_close("attention output", got, want)


def _attend(q, k, v, causal=True, scale=None, interleaved=False):
    """A plain loop over heads, with one mistake switched on: what the hints compare with."""
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    out = np.empty((T, n_heads, hd), dtype=np.float64)
    for h in range(n_heads):
        g = h % n_kv if interleaved else h // (n_heads // n_kv)
        s = q[:, h].astype(np.float64) @ k[g].T.astype(np.float64) / (np.sqrt(hd) if scale is None else scale)
        if causal:
            s = np.where(np.arange(L)[None, :] <= np.arange(L - T, L)[:, None], s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h] = (w / w.sum(axis=-1, keepdims=True)) @ v[g]
    return out.reshape(T, n_heads * hd)
