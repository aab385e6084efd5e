"""A batched step's metadata: which token, position, pool slot and block table each row has, as int32.

`batch_meta` packs any step and uploads it in one copy; a decode-only step that replays a CUDA graph writes it,
padded to its bucket, into the graph's static buffer instead (`decode_meta_into`; layout: `meta_views`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minillm.engine.batched import SeqChunk, pack


@dataclass
class BatchMeta:
    """What the kernels need to know about a packed batch, as int32 (one upload for all of it)."""
    tokens: object          # [N]   token ids
    positions: object       # [N]   absolute position of each row
    slots: object           # [N]   flat pool slot (block * block_size + offset) each row's K/V goes to
    seq_of_row: object      # [N]   which chunk (row of block_tables) each row belongs to
    last_rows: object       # [B]   each chunk's last row (its next-token logits)
    block_tables: object    # [B, max_blocks]  padded with 0 past each sequence's last block
    longest_chunk: int = 1  # rows of the longest chunk (a host int: 1 in a decode-only step)


def batch_meta(chunks: list[SeqChunk], block_size: int, upload) -> BatchMeta:
    """Pack the chunks on the host (batched.pack) and upload the int32 metadata in one copy."""
    tokens, positions, last_rows = pack(chunks)                                          # [N], [N], [B]
    lengths = [len(c.token_ids) for c in chunks]
    tables = np.zeros((len(chunks), max(math.ceil(c.end / block_size) for c in chunks)), dtype=np.int32)
    write_tables(tables, chunks, block_size)                                             # [B, max_blocks]
    seq_of_row = np.repeat(np.arange(len(chunks)), lengths)                             # [N]
    slots = pool_slots(tables, seq_of_row, positions, block_size)
    parts = [tokens, positions, slots, seq_of_row, last_rows, tables.reshape(-1)]
    flat = upload(np.concatenate(parts).astype(np.int32))
    views, start = [], 0
    for p in parts:
        views.append(flat[start:start + len(p)])
        start += len(p)
    return BatchMeta(*views[:5], views[5].reshape(tables.shape), max(lengths))


def write_tables(tables: np.ndarray, chunks: list[SeqChunk], block_size: int) -> None:
    """Each chunk's blocks in use (those its positions reach) into its row of `tables` [>= B, width]."""
    for b, c in enumerate(chunks):
        n = math.ceil(c.end / block_size)
        tables[b, :n] = c.block_table[:n]


def pool_slots(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The flat pool slot (block * block_size + offset) of each position, through its row of `tables`."""
    return tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)   # decode batch sizes a graph is captured for


def bucket_for(batch: int, buckets=GRAPH_BUCKETS) -> int | None:
    """The smallest bucket that holds `batch` rows (None: more rows than the largest bucket)."""
    return next((b for b in buckets if b >= batch), None)


def meta_size(bucket: int, width: int) -> int:
    """int32s in a bucket's metadata: five per row (token, position, slot, seq_of_row, last_row) + its table row."""
    return bucket * (5 + width)


def meta_views(flat, bucket: int, width: int) -> BatchMeta:
    """BatchMeta over a flat int32 buffer of meta_size(bucket, width) (host or device): views, no copies."""
    rows = [flat[i * bucket:(i + 1) * bucket] for i in range(5)]
    return BatchMeta(*rows, flat[5 * bucket:].reshape(bucket, width))


def decode_meta_into(flat: np.ndarray, chunks: list[SeqChunk], block_size: int, bucket: int, width: int) -> None:
    """A decode-only batch (one token per chunk) as metadata padded to `bucket` rows, written into the host
    buffer `flat` [meta_size(bucket, width)] int32. Row b < B is chunk b; a padded row has token 0 at position
    0, its own all-zero table row, and slot -1: the write kernels skip it, so it changes no real KV (its
    attention reads block 0's first key, whatever is there, and its logits are dropped)."""
    B = len(chunks)
    m = meta_views(flat, bucket, width)
    flat[:] = 0
    m.tokens[:B] = [c.token_ids[0] for c in chunks]
    m.positions[:B] = [c.start for c in chunks]
    write_tables(m.block_tables, chunks, block_size)
    m.slots[:B] = pool_slots(m.block_tables, np.arange(B), m.positions[:B], block_size)
    m.slots[B:] = -1
    m.seq_of_row[:] = np.arange(bucket)                                        # row b reads table row b
    m.last_rows[:] = np.arange(bucket)                                         # one row per chunk
