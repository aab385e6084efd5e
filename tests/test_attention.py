"""Attention pieces on their own: masks, and blocked prefill equal to one-shot attention."""
import numpy as np
import pytest

from minillm.attention import attend, attention_mask, grouped_attention


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
