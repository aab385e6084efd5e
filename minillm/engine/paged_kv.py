"""The paged KV cache: one pool of fixed-size blocks for every sequence, and a block table per sequence.

A contiguous cache (kv_cache.py) reserves max_seq_len positions per sequence up front. Most requests
stop far short of that, so most of the reservation is never written: with many users, memory runs out
long before it is used. Paging (vLLM's PagedAttention) hands out blocks of `block_size` positions as a
sequence grows; a sequence only wastes the unfilled tail of its last block (< block_size positions).

    pool.k[layer]          [n_blocks, block_size, n_kv_heads, head_dim]   every sequence's keys
    block_table            [b0, b1, b2, ...]   block j holds positions j*block_size .. (j+1)*block_size - 1
    position p             lives in block block_table[p // block_size], slot p % block_size

Attention reads a sequence's keys back through its table: on the CPU a NumPy gather (a copy of the
blocks, the price of paging here), on a GPU a paged attention kernel that follows the table itself.

`BlockManager` owns the blocks: a free list, a reference count per block (a block shared by several
sequences, through the prefix cache or by the n choices of one prompt, is freed when the last one lets
go; a shared block is copied before one of them writes into it), and, with a `PrefixCache`,
the blocks that are unused but still hold a known prefix (evicted least recently used first).

Sliding-window models (Mistral) never look further back than the window, so the scheduler gives back
the blocks a sequence has slid past: their table entries become FREED, and a sequence holds at most
about window / block_size + 1 blocks however long it runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minillm.backend import as_f32, to_host
from minillm.model.config import ModelConfig
from minillm.model.kv_cache import CacheBase, quantize_vectors

DEFAULT_BLOCK_SIZE = 16
FREED = -1               # a block-table entry whose block went back to the pool (behind a sliding window)


class PagedKVCache:
    """The pool of blocks, float32 or int8 (with a scale per position and KV head, as Int8KVCache).

    Layout is token-major inside a block, [block_size, n_kv_heads, head_dim], like the rows the q/k/v
    projection produces: writing T new tokens is one scatter, and reading a sequence back is one gather
    whose result is already [L, n_kv_heads, head_dim] (a transpose view away from what attention wants).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: str = "float32"):
        if dtype not in ("float32", "int8"):
            raise ValueError(f"paged KV dtype must be float32 or int8, got {dtype!r}")
        shape = (config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        # np.zeros maps untouched pages lazily: a large pool costs memory only as blocks get written.
        self.k = np.zeros(shape, dtype=np.int8 if dtype == "int8" else np.float32)  # [layers, blocks, bs, n_kv, hd]
        self.v = np.zeros(shape, dtype=self.k.dtype)
        if dtype == "int8":
            self.k_scale = np.zeros(shape[:4], dtype=np.float32)                  # [layers, blocks, bs, n_kv]
            self.v_scale = np.zeros(shape[:4], dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if hasattr(a, "nbytes"))

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def slots(self, block_table, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(block, offset) of positions start .. stop-1 of the sequence with this table.   -> 2 × [T]"""
        positions = np.arange(start, stop)
        return np.asarray(block_table, dtype=np.int64)[positions // self.block_size], positions % self.block_size

    def write(self, layer: int, blocks: np.ndarray, offsets: np.ndarray, k_new: np.ndarray,
              v_new: np.ndarray) -> None:
        """Scatter new keys and values into their slots.   blocks, offsets: [T]; k_new, v_new: [T, n_kv, hd]"""
        if self.dtype == "float32":
            self.k[layer, blocks, offsets] = k_new
            self.v[layer, blocks, offsets] = v_new
            return
        for new, q, scale in ((k_new, self.k, self.k_scale), (v_new, self.v, self.v_scale)):
            q[layer, blocks, offsets], scale[layer, blocks, offsets] = quantize_vectors(new)   # per (token, head)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer, for each (src, dst): a shared block about to be written gets its
        own copy first (copy-on-write, engine/choices.py)."""
        if not pairs:
            return
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]    # lists index NumPy and CuPy alike
        for name in ("k", "v", "k_scale", "v_scale"):
            a = getattr(self, name, None)
            if a is not None:
                a[:, dst] = a[:, src]                               # [layers, len(pairs), bs, n_kv(, hd)]

    def clear(self, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """Zero these slots in every layer (a rolled-back speculative draft).   blocks, offsets: [T]"""
        for a in (self.k, self.v, getattr(self, "k_scale", None), getattr(self, "v_scale", None)):
            if a is not None:
                a[:, blocks, offsets] = 0

    def read(self, layer: int, block_table, length: int, first_block: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's keys and values at positions first_block * block_size .. length - 1, in fp32 on the host
        (a device pool's too: cuda/paged_pool.py). -> k, v: [n_kv, n, hd] (views), n = length - first_block * block_size"""
        blocks = np.asarray(block_table[first_block:math.ceil(length / self.block_size)], dtype=np.int64)
        n = length - first_block * self.block_size
        if not isinstance(self.k, np.ndarray):
            blocks = blocks.tolist()                                    # a device pool: CuPy indexes with a list
        out = []
        for pool, scale in ((self.k, getattr(self, "k_scale", None)), (self.v, getattr(self, "v_scale", None))):
            x = to_host(pool[layer, blocks])                            # [nb, bs, n_kv, hd]  the gather (a copy)
            x = x.reshape(-1, *x.shape[2:])[:n]                         # [n, n_kv, hd]
            if scale is not None:                                       # int8 codes · their scales
                x = x * to_host(scale[layer, blocks]).reshape(-1, x.shape[1])[:n, :, None]
            out.append(as_f32(x).transpose(1, 0, 2))                    # [n_kv, n, hd] (16-bit storage widened)
        return out[0], out[1]


def first_needed_block(position: int, window: int | None, block_size: int) -> int:
    """The first block a query at `position` reads: 0, or with a sliding window the block holding key
    position - window + 1. Later queries sit further on, so no later step reads the blocks before it."""
    if not window:
        return 0
    return max(0, position - window + 1) // block_size


class BlockManager:
    """Hands out blocks and takes them back, counting owners so blocks can be shared.

    Every block is in exactly one state: free (in `free`), used (refcount > 0), or cached-unused
    (refcount 0, content known to the prefix cache, reclaimed LRU-first when the free list is empty).
    """

    def __init__(self, num_blocks: int, prefix_cache=None):
        self.num_blocks = num_blocks
        # A stack, lowest ids on top: a freed block is the next one handed out, so a big pool's pages
        # that were never written stay unmapped (np.zeros) and the blocks in use stay few and warm.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refcount = [0] * num_blocks
        self.prefix_cache = prefix_cache

    @property
    def num_free(self) -> int:
        """Blocks a new owner can get now: free ones plus cached ones nobody uses."""
        return len(self.free) + (self.prefix_cache.num_unused if self.prefix_cache else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """One block for a new owner; raises MemoryError when every block is in use."""
        if self.free:
            block = self.free.pop()
        elif self.prefix_cache is not None and self.prefix_cache.num_unused:
            block = self.prefix_cache.evict()                           # least recently used prefix goes
        else:
            raise MemoryError("no free KV blocks")
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more owner of a block: a prefix-cache hit, or a choice forked from another (engine/choices.py)."""
        if self.refcount[block] == 0:
            self.prefix_cache.touch(block)                              # in use again: not evictable
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was allocated")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if self.prefix_cache is not None and self.prefix_cache.holds(block):
                self.prefix_cache.park(block)                           # keep its prefix until the space is needed
            else:
                self.free.append(block)

    def release_all(self, block_table: list[int]) -> None:
        """Release a sequence's blocks, last first: its deepest blocks are then evicted before its
        prefix, which more requests share. (FREED entries went back already.)"""
        for block in reversed(block_table):
            if block != FREED:
                self.release(block)
        block_table.clear()


class BlockTableCache(CacheBase):
    """One sequence in the paged pool, with the contiguous caches' contract (`append`, `advance`),
    so `Transformer.prefill` / `decode` run through a block table unchanged (lesson 16, tests).
    Blocks are allocated as positions arrive; `free()` gives them back."""

    def __init__(self, pool: PagedKVCache, manager: BlockManager):
        self.pool, self.manager = pool, manager
        self.block_table: list[int] = []
        self.length = 0

    def append(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """k_new, v_new: [n_kv, T, hd] -> k, v: [n_kv, length + T, hd], gathered through the table"""
        end = self.length + k_new.shape[1]
        while len(self.block_table) * self.pool.block_size < end:
            self.block_table.append(self.manager.allocate())
        blocks, offsets = self.pool.slots(self.block_table, self.length, end)
        self.pool.write(layer, blocks, offsets, k_new.transpose(1, 0, 2), v_new.transpose(1, 0, 2))
        return self.pool.read(layer, self.block_table, end)

    def free(self) -> None:
        self.manager.release_all(self.block_table)
        self.length = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions: their slots after are zeroed, and every block left
        with no position goes back to the pool."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.pool.clear(*self.pool.slots(self.block_table, length, self.length))
        while len(self.block_table) > math.ceil(length / self.pool.block_size):
            self.manager.release(self.block_table.pop())
        self.length = length


# ---- fragmentation: what each way of reserving memory costs --------------------------------------

@dataclass
class AllocationReport:
    used_bytes: int                 # positions actually written
    contiguous_bytes: int           # one max-length region per sequence (kv_cache.KVCache)
    paged_bytes: int                # whole blocks, as many as each sequence needs

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.used_bytes / self.contiguous_bytes if self.contiguous_bytes else 0.0

    @property
    def paged_waste(self) -> float:
        return 1 - self.used_bytes / self.paged_bytes if self.paged_bytes else 0.0


def compare_allocation(lengths, max_len: int, block_size: int, bytes_per_token: int) -> AllocationReport:
    """KV bytes reserved for sequences of these lengths: contiguous at `max_len` each vs paged."""
    used = sum(lengths)
    paged = sum(math.ceil(n / block_size) for n in lengths) * block_size
    return AllocationReport(used * bytes_per_token, len(lengths) * max_len * bytes_per_token,
                            paged * bytes_per_token)
