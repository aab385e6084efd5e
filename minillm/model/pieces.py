"""The pieces of the forward pass a student may swap for their own (`minillm generate --student DIR`).

A Transformer (and the Engine's BatchedRunner, the speculative loop) calls these through `model.pieces`:
the engine's own functions unless course/student.py gives a model a Pieces of the student's exercises.
The indirection is one attribute lookup per call, next to matmuls of a whole layer: nothing measurable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from minillm.model.attention import grouped_attention
from minillm.model.layers import apply_rope, rmsnorm


def cache_append(cache, layer: int, k_new, v_new):
    """The engine's KV-cache write: cache.append.   k_new, v_new: [n_kv, T, hd] -> keys, values [n_kv, L, hd]"""
    return cache.append(layer, k_new, v_new)


@dataclass(frozen=True)
class Pieces:
    """One function per swappable piece, each with the signature of the engine's own."""
    rmsnorm: Callable = rmsnorm                   # (x [T, dim], weight [dim], eps) -> [T, dim]
    apply_rope: Callable = apply_rope             # (x [T, heads, hd], cos, sin [T, hd/2]) -> [T, heads, hd]
    cache_append: Callable = cache_append         # (cache, layer, k, v [n_kv, T, hd]) -> keys, values [n_kv, L, hd]
    attention: Callable = grouped_attention       # (q [T, heads, hd], keys, values [n_kv, L, hd], window,
                                                  #  sinks=) -> [T, heads * hd]
    # The engine's (engine/batched.py, engine/speculative); None: the engine's own, which model/ cannot import.
    pack_batch: Callable | None = None            # (chunks [SeqChunk]) -> tokens [N], positions [N], last_rows [B]
    paged_read: Callable | None = None            # (pool, layer, block_table, length, first_block) -> keys,
                                                  #  values [n_kv, n, hd]
    speculative_rule: tuple | None = None         # (acceptance probability, residual) of (p, q, token):
                                                  #  speculative sampling's accept step (acceptance.py)


ENGINE_PIECES = Pieces()
