"""Attention pieces on their own: masks, and blocked prefill equal to one-shot attention (plus SiLU,
and bench's account of where prefill time goes)."""
import numpy as np
import pytest

from minillm.model.attention import attend, attention_mask, grouped_attention


def test_causal_mask_with_a_cache_offset():
    # 2 new queries at positions 3 and 4 of 5 keys
    assert attention_mask(2, 5).astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_sliding_window_keeps_the_last_w_keys_self_included():
    assert attention_mask(1, 6, sliding_window=3).astype(int).tolist() == [[0, 0, 0, 1, 1, 1]]


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("cached", [0, 7])
def test_blocked_prefill_equals_attention_in_one_piece(window, cached):
    rng = np.random.default_rng(0)
    T, n_heads, n_kv, hd = 37, 6, 2, 16
    q = rng.standard_normal((T, n_heads, hd), dtype=np.float32)
    k = rng.standard_normal((n_kv, cached + T, hd), dtype=np.float32)
    v = rng.standard_normal((n_kv, cached + T, hd), dtype=np.float32)
    whole = attend(q, k, v, window)
    blocked = grouped_attention(q, k, v, window, block=8)
    np.testing.assert_allclose(blocked, whole, atol=1e-6)


def test_attention_matches_a_per_head_reference():
    """GQA's grouped matmuls give what a plain loop over heads, repeating KV heads, gives."""
    rng = np.random.default_rng(1)
    T, n_heads, n_kv, hd = 5, 4, 2, 8
    q = rng.standard_normal((T, n_heads, hd))
    k = rng.standard_normal((n_kv, T, hd))
    v = rng.standard_normal((n_kv, T, hd))
    expected = np.zeros((T, n_heads, hd))
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        s = q[:, h] @ k[kv].T / np.sqrt(hd) + np.where(np.tril(np.ones((T, T))) > 0, 0, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        expected[:, h] = (p / p.sum(-1, keepdims=True)) @ v[kv]
    np.testing.assert_allclose(attend(q, k, v), expected.reshape(T, -1), atol=1e-10)


def _reference(q, k, v, window=None):
    """Per-head softmax attention in float64 with attention_mask's rule: the ground truth."""
    from minillm.model.attention import attention_mask
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    allowed = attention_mask(T, L, window)
    out = np.zeros((T, n_heads, hd))
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        s = q[:, h].astype(np.float64) @ k[kv].T.astype(np.float64) / np.sqrt(hd)
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[kv].astype(np.float64)
    return out.reshape(T, -1)


@pytest.mark.parametrize("window,cached", [(None, 0), (None, 50), (9, 0), (40, 13), (200, 7)])
def test_blocked_attention_matches_the_float64_reference(window, cached):
    """Blocks of queries, masks applied only to the columns where they can bite: same answer."""
    rng = np.random.default_rng(2)
    T, n_heads, n_kv, hd = 70, 6, 2, 16
    q = rng.standard_normal((T, n_heads, hd), dtype=np.float32) * 2
    k = rng.standard_normal((n_kv, cached + T, hd), dtype=np.float32) * 2
    v = rng.standard_normal((n_kv, cached + T, hd), dtype=np.float32)
    got = grouped_attention(q, k, v, window, block=16)
    assert got.dtype == np.float32 and got.shape == (T, n_heads * hd)
    np.testing.assert_allclose(got, _reference(q, k, v, window), atol=1e-5)       # float32 vs float64


def test_decode_against_a_long_cache_with_a_window():
    """One query (decode) over 300 keys with a window of 50: only the last 50 keys count."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 8), dtype=np.float32)
    k, v = rng.standard_normal((2, 2, 300, 8), dtype=np.float32)
    got = grouped_attention(q, k, v, sliding_window=50)
    np.testing.assert_allclose(got, _reference(q, k, v, 50), atol=1e-6)
    np.testing.assert_allclose(got, grouped_attention(q, k[:, -50:], v[:, -50:]), atol=1e-6)


@pytest.mark.parametrize("shape", [(600, 1536), (7,), (3, 5)])
def test_silu_is_the_plain_formula_bit_for_bit(shape):
    from minillm.model.layers import silu
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32) * 4
    x[..., 0] = -100.0                                             # exp(100) overflows to inf: silu is -0
    with np.errstate(over="ignore"):
        expected = x / (1.0 + np.exp(-x))
        got = silu(x)
    assert got.dtype == np.float32 and np.array_equal(got, expected)
    gate = np.random.default_rng(6).standard_normal((700, 2 * 400)).astype(np.float32)[:, :400]   # a strided view
    assert np.array_equal(silu(gate), gate / (1.0 + np.exp(-gate)))
    assert silu(np.arange(4, dtype=np.float16)).dtype == np.float16
