"""The scheduler of continuous batching: which sequences run in the next step, and how many tokens each.

A sequence moves waiting -> running -> finished. Every step the scheduler

1. gives each running sequence, oldest first, its next tokens (one for a decode, a chunk of its prompt
   while it is still prefilling), growing its block table as needed. When no block is left it preempts
   the newest running sequence: its blocks go back to the pool, it returns to the front of the waiting
   queue, and it is recomputed from its tokens (prompt + output so far) when it is admitted again;
2. admits waiting sequences, first come first served, while the batch has room (`max_batch`
   sequences, `max_batch_tokens` tokens) and the pool has blocks. With a prefix cache, the full blocks
   of a newcomer's prompt that are cached are shared instead of computed.

After a step, a sequence's newly full blocks become findable by the prefix cache, and with a sliding
window (Mistral) the blocks that every later query of it is past go back to the pool (FREED in its table).

So a request never waits for the whole batch to finish (static batching's problem): it joins at the next
step. A token budget per step bounds how long one step takes, so a long prompt (split into chunks:
chunked prefill) does not stall the decodes running beside it.

One invariant makes the bookkeeping simple: `seq.tokens[:seq.num_computed]` have their keys and values
in the pool; a step computes `tokens[num_computed : num_computed + n]`; when it catches up with the end
of `tokens`, the step's logits sample the next token. Prefill, chunked prefill, decode and recompute
after preemption are all this one rule.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from minillm.engine.paged_kv import FREED, BlockManager, first_needed_block
from minillm.engine.prefix_cache import PrefixCache, block_hashes


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it: its tokens, what of them is computed, and its blocks."""
    request_id: int
    tokens: list[int]                     # prompt + output so far
    prompt_len: int
    max_tokens: int                       # new tokens at most (already clipped to the context)
    num_computed: int = 0                 # tokens[:num_computed] have K/V in the pool
    block_table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)     # one per full block of tokens, chained
    num_registered: int = 0               # block_table[:num_registered] are in the prefix cache
    num_dropped: int = 0                  # block_table[:num_dropped] are FREED: behind the sliding window
    cached_tokens: int = 0                # tokens served by the prefix cache at its last admission
    finished: bool = False

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def full_block_hashes(self, n_blocks: int, block_size: int) -> list[bytes]:
        """Hashes of the first `n_blocks` full blocks (computed once: full blocks never change)."""
        if len(self.hashes) < n_blocks:
            parent = self.hashes[-1] if self.hashes else b""
            start = len(self.hashes) * block_size
            self.hashes += block_hashes(self.tokens[start:n_blocks * block_size], block_size, parent)
        return self.hashes[:n_blocks]


class Scheduler:
    """Decides each step's batch; owns the waiting and running queues and every sequence's blocks."""

    def __init__(self, blocks: BlockManager, block_size: int, max_batch: int, max_batch_tokens: int,
                 prefix_cache: PrefixCache | None = None, chunked_prefill: bool = True, window: int | None = None):
        self.blocks, self.block_size, self.prefix_cache = blocks, block_size, prefix_cache
        self.window = window                  # the model's sliding window: blocks behind it are given back
        self.max_batch, self.max_batch_tokens, self.chunked_prefill = max_batch, max_batch_tokens, chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of its tokens to compute), running ones first."""
        preemptions = self.preemptions
        batch = self._schedule_running()
        if len(batch) == len(self.running) and self.preemptions == preemptions:   # room to spare
            batch += self._admit_waiting(self.max_batch_tokens - sum(n for _, n in batch), bool(batch))
        return batch

    def _schedule_running(self) -> list[tuple[Sequence, int]]:
        batch, budget = [], self.max_batch_tokens
        while len(batch) < len(self.running) and budget > 0:
            seq = self.running[len(batch)]
            n = min(seq.num_pending, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running.pop()          # the newest: the least work lost
                self._preempt(victim)
                if victim is seq:
                    return batch
            batch.append((seq, n))
            budget -= n
        return batch

    def _admit_waiting(self, budget: int, has_batch: bool) -> list[tuple[Sequence, int]]:
        admitted = []
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            seq = self.waiting[0]
            matched = self._cached_prefix(seq)
            pending = len(seq.tokens) - len(matched) * self.block_size
            if not self.chunked_prefill and pending > budget and (has_batch or admitted):
                break                                # whole prompts only: wait for a step with room
            n = pending if not self.chunked_prefill else min(pending, budget)
            if not self._fits(matched, len(matched) * self.block_size + n):
                break                                # first come, first served: nobody overtakes
            self.waiting.popleft()
            self._take_prefix(seq, matched)
            self._reserve(seq, seq.num_computed + n)
            self.running.append(seq)
            admitted.append((seq, n))
            budget -= n
        return admitted

    # ---- blocks ----------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, n_positions: int) -> bool:
        """Grow seq's block table to hold n_positions; all or nothing."""
        need = math.ceil(n_positions / self.block_size) - len(seq.block_table)
        if need > self.blocks.num_free:
            return False
        seq.block_table += [self.blocks.allocate() for _ in range(need)]
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that can stand for seq's first tokens. The last token is always computed:
        its logits give the first new token."""
        if self.prefix_cache is None:
            return []
        n_blocks = (len(seq.tokens) - 1) // self.block_size
        return self.prefix_cache.match(seq.full_block_hashes(n_blocks, self.block_size))

    def _fits(self, matched: list[int], n_positions: int) -> bool:
        """Would the pool hold a newcomer that shares `matched` and needs n_positions in all?"""
        need = math.ceil(n_positions / self.block_size) - len(matched)
        revived = sum(1 for b in matched if self.blocks.refcount[b] == 0)   # unused cached: no longer free
        return need <= self.blocks.num_free - revived

    def _take_prefix(self, seq: Sequence, matched: list[int]) -> None:
        for block in matched:
            self.blocks.share(block)
        seq.block_table = list(matched)
        seq.num_registered = len(matched)
        seq.num_computed = len(matched) * self.block_size
        seq.cached_tokens = seq.num_computed
        if self.prefix_cache is not None:
            self.prefix_cache.hit_tokens += seq.num_computed

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop seq's blocks (cached ones stay findable), requeue it first."""
        self.blocks.release_all(seq.block_table)
        seq.num_computed = seq.num_registered = seq.num_dropped = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # ---- after the model ran ----------------------------------------------------------------------
    def advance(self, seq: Sequence, n: int) -> None:
        """n more of seq's tokens are in the pool; newly full blocks become findable by later requests,
        and with a sliding window the blocks every later query is past go back to the pool."""
        seq.num_computed += n
        if self.prefix_cache is not None:
            full = seq.num_computed // self.block_size
            for j, h in enumerate(seq.full_block_hashes(full, self.block_size)[seq.num_registered:],
                                  seq.num_registered):
                self.prefix_cache.insert(h, seq.block_table[j])
            seq.num_registered = full
        if self.window:
            self._drop_behind_window(seq)

    def _drop_behind_window(self, seq: Sequence) -> None:
        """The next query sits at num_computed: blocks wholly before its window are read by no later
        step. Released (a cached one stays findable for other requests' prefixes), marked FREED."""
        keep = first_needed_block(seq.num_computed, self.window, self.block_size)
        for j in range(seq.num_dropped, keep):
            self.blocks.release(seq.block_table[j])
            seq.block_table[j] = FREED
        seq.num_dropped = max(seq.num_dropped, keep)

    def rollback(self, seq: Sequence) -> None:
        """Speculative decoding rejected drafts past `num_computed`: the blocks that now hold no computed
        position go back to the pool (they were reserved for the drafts; the next step reserves anew)."""
        keep = math.ceil(seq.num_computed / self.block_size)
        while len(seq.block_table) > keep:
            self.blocks.release(seq.block_table.pop())

    def finish(self, seq: Sequence) -> None:
        """seq is done (or aborted): out of the queues, its blocks freed or left in the prefix cache."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release_all(seq.block_table)
