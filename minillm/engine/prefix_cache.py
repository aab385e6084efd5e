"""Prefix caching: requests that start with the same tokens reuse the KV blocks already computed.

Agents and chat apps send the same long system prompt (tools, instructions, the conversation so far)
with every request. Its keys and values depend only on the tokens before them, so once computed they
can be shared: a later request skips prefill for that prefix, which cuts its time to first token.

Two designs are in use:

- **Hashed full blocks** (vLLM): every full block of a sequence gets a hash of (its parent block's hash,
  its own tokens), so a hash names the whole prefix up to the block's end. A dict maps hashes to
  blocks; a new request hashes its prompt block by block and takes the longest run of hits.
- **A radix tree** (SGLang's RadixAttention): a trie over token ids whose edges hold token runs and
  the KV slots behind them; a request walks down the tree to its longest match, at token
  granularity, and splits an edge where it diverges.

minillm uses hashed full blocks. The engine's unit of memory is already the block (paged_kv.py), and
a hash per block maps one to one onto it: one dict lookup per 16 tokens, a reference count per block,
one LRU list of unused blocks, no tree to split or rebalance. What it gives up is the partial last
block (a match is always a whole number of blocks): at most block_size - 1 tokens of prefill per
request. Branching conversations cost it nothing extra: each branch's blocks hash differently from
the block where they diverge. Lesson 18 builds the radix tree too and compares the two.

Hashes are SHA-256 digests of the parent digest and the block's token ids: a hit then means the whole
prefix is equal (a 64-bit `hash()` collision would silently serve another prompt's keys).

The cache holds no reference counts itself (`paged_kv.BlockManager` does): it maps hashes to blocks and
keeps the blocks nobody uses in least-recently-used order, to be evicted when the free list runs dry.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

ROOT = b""   # the parent "hash" of a sequence's first block


def block_hash(parent: bytes, tokens) -> bytes:
    """The hash naming a block by everything up to its end: (parent block's hash, its token ids)."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def block_hashes(tokens, block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """One hash per full block of `tokens`, each chained to the one before.   -> [len(tokens) // block_size]"""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """hash -> block for every full block whose content is known, plus the LRU list of unused ones."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.unused: OrderedDict[int, None] = OrderedDict()   # refcount-0 cached blocks, oldest first
        self.hit_tokens = 0                                   # prompt tokens served from the cache
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.block_of)

    @property
    def num_unused(self) -> int:
        return len(self.unused)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached run of `hashes` from the start (a prefix hit)."""
        blocks = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert(self, h: bytes, block: int) -> bool:
        """Remember that `block` holds the prefix named `h`. False when another block already does
        (two requests computed the same prefix at once): the first one stays the cached copy."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h], self.hash_of[block] = block, h
        return True

    def holds(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, block: int) -> None:
        """Its last owner let go: keep the content, evictable, as the most recently used."""
        self.unused[block] = None

    def touch(self, block: int) -> None:
        """An unused cached block is reused by a hit: no longer evictable."""
        del self.unused[block]

    def evict(self) -> int:
        """Forget the least recently used unused block and hand it back for reuse."""
        block, _ = self.unused.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        self.evictions += 1
        return block
