"""Exercise 29, QK-norm (Qwen3, Gemma 3): each head's query and key brought to unit RMS over its own
head_dim, times a learned gain, before RoPE. The engine does it in `Transformer.qkv` with `layers.rmsnorm`
over the last axis of [T, heads, head_dim]."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_close, expect_unchanged


def qk_norm_reference(q, k, q_gain, k_gain, eps):
    """What Transformer.qkv does to q and k when config.qk_norm: RMSNorm over each head's vector.

    q: [T, n_heads, hd]   k: [T, n_kv_heads, hd]   q_gain, k_gain: [hd]   -> (q, k) of the same shapes"""
    from minillm.model.layers import rmsnorm
    return rmsnorm(q, q_gain, eps), rmsnorm(k, k_gain, eps)


def _whole_row_norm(x, gain, eps):
    """The usual mistake: one RMS over all the heads of a token (a Llama input norm's axis)."""
    T, heads, hd = x.shape
    flat = x.reshape(T, heads * hd)
    rms = np.sqrt(np.square(flat).mean(axis=-1, keepdims=True) + eps)
    return (flat / rms).reshape(T, heads, hd) * gain


def _qk_cases() -> list[Case]:
    rng = case_rng(29)

    def case(name, T, heads, kv_heads, hd, eps=1e-6, head_scales=None, gain_offset=1.0):
        q = rng.standard_normal((T, heads, hd)).astype(np.float32)
        k = rng.standard_normal((T, kv_heads, hd)).astype(np.float32)
        if head_scales is not None:                  # heads of very different sizes: per-head RMS matters
            q *= np.asarray(head_scales, np.float32)[None, :, None]
            k *= np.asarray(head_scales[:kv_heads], np.float32)[None, :, None]
        q_gain = (gain_offset + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        k_gain = (gain_offset + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        return Case(name, dict(q=q, k=k, q_gain=q_gain, k_gain=k_gain, eps=eps))
    return [case("Qwen3-0.6B's heads: 16 query, 8 KV, head_dim 128, 5 tokens", 5, 16, 8, 128),
            case("one token (a decode step), MQA: 4 query heads, 1 KV head", 1, 4, 1, 32),
            case("heads 1000x apart in size: each is normed on its own", 3, 4, 2, 16,
                 head_scales=[1000.0, 0.001, 1.0, 30.0]),
            case("Gemma-style gains near 2 (1 + w, added at load): the gain multiplies as given", 4, 8, 4, 64,
                 gain_offset=2.0),
            case("tiny activations: eps keeps the norm finite (eps = 1e-5)", 2, 2, 2, 8, eps=1e-5,
                 head_scales=[1e-6, 1e-6])]


def _check_qk_norm(fn, case: Case) -> str:
    x = case.inputs
    given = {name: (a.copy() if isinstance(a, np.ndarray) else a) for name, a in x.items()}
    got = _expect_tuple(fn(given["q"], given["k"], given["q_gain"], given["k_gain"], given["eps"]), 2, "q, k")
    for name in ("q", "k", "q_gain", "k_gain"):
        expect_unchanged(name, x[name], given[name])
    want_q, want_k = qk_norm_reference(x["q"], x["k"], x["q_gain"], x["k_gain"], x["eps"])
    whole_row = _whole_row_norm(x["q"], x["q_gain"], x["eps"])
    if isinstance(got[0], np.ndarray) and got[0].shape == want_q.shape and \
            not np.allclose(got[0], want_q, rtol=1e-4, atol=1e-5) and np.allclose(got[0], whole_row, rtol=1e-4, atol=1e-5):
        raise CaseFailed("q was normed over all the heads of a token at once: QK-norm takes the RMS of each head's "
                         "head_dim values on its own (the last axis of [T, heads, head_dim])")
    return "; ".join([expect_close("q", got[0], want_q), expect_close("k", got[1], want_k)])
