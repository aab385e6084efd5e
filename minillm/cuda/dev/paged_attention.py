"""kernels/paged_attention.cu: the batching engine's three paged kernels, their NumPy references and checks.

    rope_at_positions     RoPE on the q and k heads of each packed row, at that row's own position
    paged_kv_write(_int8) each row's new key and value into its pool slot (int8: codes + a scale per vector)
    paged_attention(_int8) each row's queries against its sequence's keys, read through its block table

The references below compute what the kernels compute, one row at a time and in fp32, from the same
arrays the kernels read; tests/test_gpu_engine.py holds the kernels to them on random mixed batches.
`python -m minillm.cuda.dev.paged_attention` checks the kernels on the GPU.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.backend import to_dtype
from minillm.model.kv_cache import quantize_vectors
from minillm.model.layers import apply_rope, rope_tables


def rope_at_positions_reference(qkv: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, n_heads: int,
                                n_kv_heads: int, head_dim: int) -> None:
    """rope_at_positions: rotate the first n_heads + n_kv_heads heads of each row of qkv [N, width] in place."""
    cos, sin = rope_tables(np.asarray(positions), np.asarray(inv_freq))                   # [N, hd/2] each
    width = (n_heads + n_kv_heads) * head_dim
    heads = qkv[:, :width].reshape(len(qkv), n_heads + n_kv_heads, head_dim)              # [N, H + n_kv, hd]
    qkv[:, :width] = apply_rope(heads, cos, sin).reshape(len(qkv), width)


def paged_kv_write_reference(qkv: np.ndarray, slots: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
                             n_heads: int, n_kv_heads: int, head_dim: int, dtype: str = "float16",
                             scales=None) -> None:
    """paged_kv_write: each row's k and v heads into its flat slot of one layer's pool [blocks, bs, n_kv, hd],
    narrowed to `dtype`; with scales = (k_scale, v_scale) [blocks, bs, n_kv] the int8 pool's codes and
    scales (kv_cache.quantize_vectors: the CPU pools' format)."""
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    for pool, new, scale in zip((k_pool, v_pool), (qkv[:, nq:nq + nkv], qkv[:, nq + nkv:nq + 2 * nkv]),
                                scales or (None, None)):
        flat = pool.reshape(-1, n_kv_heads, head_dim)                                     # [blocks * bs, n_kv, hd] view
        rows = new.reshape(-1, n_kv_heads, head_dim)
        if scale is None:
            flat[slots] = to_dtype(np.asarray(rows, np.float32), dtype)
        else:
            flat[slots], scale.reshape(-1, n_kv_heads)[slots] = quantize_vectors(rows)


def paged_attention_reference(qkv: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, block_tables: np.ndarray,
                              seq_of_row: np.ndarray, positions: np.ndarray, n_heads: int,
                              window: int | None = None, scales=None) -> np.ndarray:
    """What paged_attention.cu computes: each row's queries (the first n_heads heads of its qkv row)
    against its sequence's keys [lo, p], gathered through the block table; scales = (k_scale, v_scale):
    the pools hold int8 codes (code · scale).  -> [N, n_heads * hd] fp32"""
    if scales is not None:
        k_pool, v_pool = (p.astype(np.float32) * s[..., None] for p, s in zip((k_pool, v_pool), scales))
    _, block_size, n_kv, hd = k_pool.shape
    group = n_heads // n_kv
    out = np.empty((qkv.shape[0], n_heads * hd), np.float32)
    for t in range(qkv.shape[0]):
        p = int(positions[t])
        lo = max(0, p - window + 1) if window else 0
        keys = np.arange(lo, p + 1)
        blocks = np.asarray(block_tables[seq_of_row[t]])[keys // block_size]
        K = to_dtype(k_pool[blocks, keys % block_size], "float32")[:, np.arange(n_heads) // group]  # [L, H, hd]
        V = to_dtype(v_pool[blocks, keys % block_size], "float32")[:, np.arange(n_heads) // group]  # [L, H, hd]
        q = qkv[t, :n_heads * hd].reshape(n_heads, hd)                                            # [H, hd]
        scores = np.einsum("lhd,hd->hl", K, q) / math.sqrt(hd)                                    # [H, L]
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[t] = np.einsum("hl,lhd->hd", w, V).reshape(-1)
    return out
