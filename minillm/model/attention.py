"""Causal self-attention with grouped KV heads (MHA, GQA and MQA are one code path).

n_heads query heads share n_kv_heads key/value heads in groups of n_heads // n_kv_heads:
MHA is n_kv_heads == n_heads, MQA is n_kv_heads == 1, GQA anything between. Grouping the query
heads by their KV head lets one batched matmul serve the whole group without copying K and V.

CPU prefill, where the time goes (SmolLM2, 512 tokens, ~0.25 s of ~1 s): per layer and block of
128 queries, two small matmuls (head_dim 64 is a thin inner dimension: ~100 GFLOP/s, half of what
BLAS reaches on the weight matmuls) and between them a softmax over [heads, block, L] scores
(mask, max, exp, sum: ~44 million exps for 30 layers) on one core. Splitting that softmax over a
second thread was measured and dropped: after every matmul OpenBLAS's idle workers keep spinning
for a while and hold the second core, so the split made attention 15% slower on this 2-core VM
(lessons/BENCHMARKS.md, "CPU decode and prefill").
"""
from __future__ import annotations

import math

import numpy as np

from minillm.backend import array_module


def attention_mask(n_queries: int, n_keys: int, sliding_window: int | None = None, xp=np) -> np.ndarray:
    """Which keys each query may see: causal, optionally only the last `sliding_window` positions.

    The queries are the last `n_queries` of the `n_keys` positions.  -> bool [n_queries, n_keys], made
    with xp (numpy, or cupy for scores on the device: a host mask cannot be added to a device array)
    """
    return _allowed(n_keys - n_queries, n_queries, 0, n_keys, sliding_window, xp)


def _allowed(first_query: int, n_queries: int, first_key: int, end_key: int,
             sliding_window: int | None, xp=np) -> np.ndarray:
    """attention_mask's rows for queries at positions first_query.., columns for keys first_key..end_key-1."""
    q_pos = xp.arange(first_query, first_query + n_queries)[:, None]   # [Tq, 1] absolute positions
    k_pos = xp.arange(first_key, end_key)[None, :]                      # [1, Tk]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window              # Mistral: a window of W keys, self included
    return allowed


def mask_bias(n_queries: int, n_keys: int, sliding_window: int | None = None, xp=np) -> np.ndarray:
    """The mask as an additive bias: 0 where allowed, -inf where not.   -> float32 [Tq, Tk] (in xp)"""
    allowed = attention_mask(n_queries, n_keys, sliding_window, xp)
    return xp.where(allowed, xp.float32(0.0), xp.float32(-np.inf))


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      sliding_window: int | None = None, block: int = 128, sinks=None) -> np.ndarray:
    """softmax(q·kᵀ/√d + mask)·v for the new queries against every cached key.

    q: [T, n_heads, hd]   k, v: [n_kv_heads, L, hd] (L = cached + new)   -> [T, n_heads * hd]
    sinks: [n_heads] or None. GPT-OSS's attention sinks: each head's learned logit s joins the softmax's
    denominator as one more score, with no value behind it: weights exp(score) / (Σ exp(scores) + exp(s)),
    so a head can attend to "nothing" (its weights then sum to less than 1).

    Long prefills go `block` queries at a time, each against only the keys it can see: causal
    masking hides every key after a block's last query, so skipping them halves the work, and
    [block, L] score tables stay in cache where [T, L] ones would not.
    """
    T, n_heads, hd = q.shape
    L = k.shape[1]
    q = q * (1.0 / math.sqrt(hd))                  # scale T·hd query values once, not T·L scores per block
    if T <= block:
        return _attend_scaled(q, k, v, sliding_window, sinks)
    first = L - T                                                     # absolute position of q[0]
    out = array_module(q).empty((T, n_heads * hd), dtype=np.result_type(q.dtype, k.dtype, v.dtype))

    for start in range(0, T, block):
        end = min(start + block, T)
        k_end = first + end                                           # keys after the block's last query: masked
        k_start = 0 if sliding_window is None else max(0, first + start - sliding_window + 1)
        out[start:end] = _attend_scaled(q[start:end], k[:, k_start:k_end], v[:, k_start:k_end], sliding_window, sinks)
    return out                                                        # [T, n_heads * hd]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, sliding_window: int | None = None) -> np.ndarray:
    """Attention of T queries that are the last T of the L key positions.

    q: [T, n_heads, hd]   k, v: [n_kv_heads, L, hd]   -> [T, n_heads * hd]
    """
    return _attend_scaled(q * (1.0 / math.sqrt(q.shape[-1])), k, v, sliding_window)


def _attend_scaled(q: np.ndarray, k: np.ndarray, v: np.ndarray, sliding_window: int | None,
                   sinks=None) -> np.ndarray:
    """`attend` for queries already multiplied by 1/√hd.   q: [T, n_heads, hd] -> [T, n_heads * hd]"""
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    group = n_heads // n_kv
    # Each KV head serves `group` query heads: stack them as rows of one matmul per KV head.
    q = q.reshape(T, n_kv, group, hd).transpose(1, 0, 2, 3)          # [n_kv, T, group, hd]
    q = q.reshape(n_kv, T * group, hd)                                # [n_kv, T*group, hd]
    scores = q @ k.transpose(0, 2, 1)                                 # [n_kv, T*group, L]
    sinks = None if sinks is None else sinks.reshape(n_kv, 1, group, 1)   # head h = kv · group + g, as q's
    denominators = _exp_scores(scores.reshape(n_kv, T, group, L), L - T, sliding_window, sinks)   # [n_kv, T, group, 1]
    out = scores @ v                                                  # [n_kv, T*group, hd]
    out /= denominators.reshape(n_kv, T * group, 1)                   # normalize hd values, not L weights
    out = out.reshape(n_kv, T, group, hd)
    return out.transpose(1, 0, 2, 3).reshape(T, n_heads * hd)         # [T, n_heads * hd]


def _exp_scores(scores: np.ndarray, first_query: int, sliding_window: int | None, sinks=None) -> np.ndarray:
    """Softmax numerators in place: scores <- exp(scores + mask - row max); returns the row sums
    (plus exp(sink - row max) with sinks [n_kv, 1, group, 1]: the max then counts the sink too).

    scores: [n_kv, T, group, L] for queries at key positions first_query..   -> [n_kv, T, group, 1]
    At prefill these score tables are the largest arrays in the model: nothing else is allocated.
    """
    _add_mask(scores, first_query, sliding_window)
    xp = array_module(scores)
    row_max = scores.max(axis=-1, keepdims=True)                      # [n_kv, T, group, 1]
    if sinks is not None:
        row_max = xp.maximum(row_max, sinks)
    scores -= row_max                                                 # the max becomes 0: exp cannot overflow
    xp.exp(scores, out=scores)
    sums = scores.sum(axis=-1, keepdims=True)
    return sums if sinks is None else sums + xp.exp(sinks - row_max)


def _add_mask(scores: np.ndarray, first_query: int, sliding_window: int | None) -> None:
    """Add -inf where a query may not see a key, touching only the columns where that can happen.

    scores: [n_kv, Tq, group, L], queries at key positions first_query..first_query+Tq-1. Causal
    masking can only hide keys after the first query; a window only keys before the last query's
    window. Blocked prefill's earlier keys are never masked, so most columns are left alone.
    """
    Tq, L = scores.shape[1], scores.shape[3]
    xp = array_module(scores)
    spans = [(first_query + 1, L)]                                    # keys after the first query
    if sliding_window is not None:
        spans.append((0, min(L, first_query + Tq - sliding_window)))  # keys out of the last query's window
    for lo, hi in spans:
        if lo < hi:
            allowed = _allowed(first_query, Tq, lo, hi, sliding_window, xp)
            scores[..., lo:hi] += xp.where(allowed, xp.float32(0.0), xp.float32(-np.inf))[None, :, None, :]
