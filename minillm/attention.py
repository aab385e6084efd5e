"""Causal self-attention with grouped KV heads (MHA, GQA and MQA are one code path).

n_heads query heads share n_kv_heads key/value heads in groups of n_heads // n_kv_heads:
MHA is n_kv_heads == n_heads, MQA is n_kv_heads == 1, GQA anything between. Grouping the query
heads by their KV head lets one batched matmul serve the whole group without copying K and V.
"""
from __future__ import annotations

import math

import numpy as np


def attention_mask(n_queries: int, n_keys: int, sliding_window: int | None = None) -> np.ndarray:
    """Which keys each query may see: causal, optionally only the last `sliding_window` positions.

    The queries are the last `n_queries` of the `n_keys` positions.  -> bool [n_queries, n_keys]
    """
    q_pos = np.arange(n_keys - n_queries, n_keys)[:, None]     # [Tq, 1] absolute positions
    k_pos = np.arange(n_keys)[None, :]                         # [1, Tk]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window              # Mistral: a window of W keys, self included
    return allowed


def mask_bias(n_queries: int, n_keys: int, sliding_window: int | None = None) -> np.ndarray:
    """The mask as an additive bias: 0 where allowed, -inf where not.   -> float32 [Tq, Tk]"""
    allowed = attention_mask(n_queries, n_keys, sliding_window)
    return np.where(allowed, np.float32(0.0), np.float32(-np.inf))


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      sliding_window: int | None = None, block: int = 128) -> np.ndarray:
    """softmax(q·kᵀ/√d + mask)·v for the new queries against every cached key.

    q: [T, n_heads, hd]   k, v: [n_kv_heads, L, hd] (L = cached + new)   -> [T, n_heads * hd]

    Long prefills go `block` queries at a time, each against only the keys it can see: causal
    masking hides every key after a block's last query, so skipping them halves the work, and
    [block, L] score tables stay in cache where [T, L] ones would not.
    """
    T, L = q.shape[0], k.shape[1]
    if T <= block:
        return attend(q, k, v, sliding_window)
    first = L - T                                                     # absolute position of q[0]
    outputs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        k_end = first + end                                           # keys after the block's last query: masked
        k_start = 0 if sliding_window is None else max(0, first + start - sliding_window + 1)
        outputs.append(attend(q[start:end], k[:, k_start:k_end], v[:, k_start:k_end], sliding_window))
    return np.concatenate(outputs)                                    # [T, n_heads * hd]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, sliding_window: int | None = None) -> np.ndarray:
    """Attention of T queries that are the last T of the L key positions.

    q: [T, n_heads, hd]   k, v: [n_kv_heads, L, hd]   -> [T, n_heads * hd]
    """
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    group = n_heads // n_kv
    # Each KV head serves `group` query heads: stack them as rows of one matmul per KV head.
    q = q.reshape(T, n_kv, group, hd).transpose(1, 0, 2, 3)          # [n_kv, T, group, hd]
    q = q.reshape(n_kv, T * group, hd)                                # [n_kv, T*group, hd]
    scores = (q @ k.transpose(0, 2, 1)) * (1.0 / math.sqrt(hd))       # [n_kv, T*group, L]
    scores = scores.reshape(n_kv, T, group, L)
    if T > 1 or sliding_window is not None:
        scores += mask_bias(T, L, sliding_window)[None, :, None, :]
    # Softmax, in place: at prefill these [T, L] score tables are the largest arrays in the model.
    scores -= scores.max(axis=-1, keepdims=True)                      # the max becomes 0: exp cannot overflow
    np.exp(scores, out=scores)
    denominators = scores.sum(axis=-1, keepdims=True)                 # [n_kv, T, group, 1]
    out = scores.reshape(n_kv, T * group, L) @ v                      # [n_kv, T*group, hd]
    out /= denominators.reshape(n_kv, T * group, 1)                   # normalize hd values, not L weights
    out = out.reshape(n_kv, T, group, hd)
    return out.transpose(1, 0, 2, 3).reshape(T, n_heads * hd)         # [T, n_heads * hd]
