"""The scheduler of continuous batching: which sequences run in the next step, and how many tokens each.

A sequence moves waiting -> running -> finished. Every step the scheduler

1. gives each decoding sequence, oldest first, its next token (and any speculative drafts), growing its
   block table as needed. When no block is left it preempts the newest running sequence: its blocks go
   back to the pool, it returns to the front of the waiting queue, and it is recomputed from its tokens
   (prompt + output so far) when it is admitted again;
2. spends the step's prompt budget on the prompt with the fewest tokens left first, whether it is in
   progress or waiting. Waiting sequences are admitted first come first served, while the batch has
   room (`max_batch` sequences) and the pool has blocks, never those a prompt in progress still needs
   (with a prefix cache, the full blocks of a newcomer's prompt that are cached are shared instead of
   computed).

The prompt budget is what keeps one client from slowing another down. A step lasts as long as all its
tokens take, and every request in it waits that long. So while more than one request has work (a prompt
beside decodes, or beside another prompt), a step takes only `StepBudget.prompt_tokens` prompt tokens
(step_budget.py: sized to a target step time, measured as the engine runs) or, with a fixed budget,
`max_batch_tokens` in all. A long prompt is then prefilled over many short steps (chunked prefill) while
the others keep their tokens coming, and a short prompt that arrives meanwhile goes first, so its first
token does not wait for the long one's. A prompt with nobody beside it takes whole `max_batch_tokens`
chunks. (With `arrival_order`, the scheduler before this budget: running sequences in arrival order
share `max_batch_tokens`, so a long prompt's chunks left nothing for the decodes behind it; kept for
comparisons.)

After a step, a sequence's newly full blocks become findable by the prefix cache, and with a sliding
window (Mistral) the blocks that every later query of it is past go back to the pool (FREED in its table).

The n choices of one prompt (choices.py) fork from the first once its prompt is computed (`fork`): they
share its blocks, and `_reserve` gives a sequence its own copy of a shared block before it writes into
it (the copies are listed in `copies`, made by the pool before the step runs).

So a request never waits for the whole batch to finish (static batching's problem): it joins at the next
step.

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
from minillm.engine.step_budget import StepBudget


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
    decoding: bool = False                # caught up with its tokens since admission: one new token a step
    whole_prompt: bool = False            # computed from position 0, never from cached blocks (prompt logprobs)
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
                 prefix_cache: PrefixCache | None = None, chunked_prefill: bool = True, window: int | None = None,
                 budget: StepBudget | None = None, arrival_order: bool = False):
        """budget: sizes the prompt work of a step beside other requests (None: max_batch_tokens in all);
        arrival_order: the scheduler before the budget existed (bench serve's `before`)."""
        self.blocks, self.block_size, self.prefix_cache = blocks, block_size, prefix_cache
        self.window = window                  # the model's sliding window: blocks behind it are given back
        self.max_batch, self.max_batch_tokens, self.chunked_prefill = max_batch, max_batch_tokens, chunked_prefill
        self.budget, self.arrival_order = budget, arrival_order
        self.last_step = (0, 0)               # (decode tokens, prompt tokens) of the last schedule()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.copies: list[tuple[int, int]] = []   # (src, dst) blocks to copy before this step runs (copy-on-write)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of its tokens to compute): decodes, then prompt chunks."""
        self.copies = []
        if self.arrival_order:
            return self._schedule_in_arrival_order()
        preemptions, batch = self.preemptions, []
        self._take([seq for seq in self.running if seq.decoding], self.max_batch_tokens, batch)
        decode_tokens = sum(n for _, n in batch)
        prompts = [seq for seq in self.running if not seq.decoding]
        if prompts or self.waiting:                  # a decode that found no block: no newcomer this step
            self._prefill(prompts, self._prompt_room(decode_tokens), self.preemptions == preemptions, batch)
        self.last_step = (decode_tokens, sum(n for _, n in batch) - decode_tokens)
        return batch

    def _prompt_room(self, decode_tokens: int) -> int:
        """Prompt tokens this step may take: the budget's if more than one request has work (a prompt beside
        decodes or beside another prompt), else all that is left of the step."""
        room = self.max_batch_tokens - decode_tokens
        with_work = len(self.running) + min(len(self.waiting), self.max_batch - len(self.running))
        if self.budget is not None and with_work > 1:
            room = min(room, self.budget.prompt_tokens(decode_tokens))
        return room

    def _prefill(self, prompts: list[Sequence], room: int, admit: bool, batch: list) -> None:
        """Prompt chunks into `room` tokens, the prompt with the fewest tokens to go first, so a short prompt
        never waits out a long one. Newcomers join first come first served, each counted by its whole prompt,
        and only while the pool keeps the blocks that the prompts in progress still need."""
        prompts = sorted(prompts, key=lambda seq: seq.num_pending)
        keep_free = sum(self._blocks_to_finish(seq) for seq in prompts)
        while room > 0:
            newcomer = self.waiting[0] if admit and self.waiting else None
            if prompts and (newcomer is None or prompts[0].num_pending <= len(newcomer.tokens)):
                seq = prompts.pop(0)
                if seq not in self.running:          # preempted for an older one in this very step
                    continue
                n = min(seq.num_pending, room)
                if not self._make_room(seq, n, batch):
                    return
                batch.append((seq, n))
            elif newcomer is not None:
                admitted = self._admit(room, bool(batch), keep_free)
                if admitted is None:
                    admit = False
                    continue
                batch.append(admitted)
                n = admitted[1]
            else:
                return
            room -= n

    def _take(self, seqs: list[Sequence], budget: int, batch: list) -> None:
        """Append running seqs to batch, each with its next min(pending, what is left of budget) tokens."""
        for seq in seqs:
            if budget <= 0:
                break
            if seq not in self.running:              # preempted for an older one in this very loop
                continue
            n = min(seq.num_pending, budget)
            if not self._make_room(seq, n, batch):
                return
            batch.append((seq, n))
            budget -= n

    def _make_room(self, seq: Sequence, n: int, batch: list) -> bool:
        """Reserve blocks for seq's next n tokens; while the pool is dry, preempt the newest running sequence
        (out of the batch if it was in). False if that was seq itself."""
        while not self._reserve(seq, seq.num_computed + n):
            victim = self.running.pop()              # the newest: the least work lost
            self._preempt(victim)
            batch[:] = [(s, k) for s, k in batch if s is not victim]
            if victim is seq:
                return False
        return True

    def _blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks seq still needs to reach the end of its tokens (a prompt in progress)."""
        return max(0, math.ceil(len(seq.tokens) / self.block_size) - len(seq.block_table))

    def _schedule_in_arrival_order(self) -> list[tuple[Sequence, int]]:
        """Running sequences first, oldest first, then newcomers, sharing max_batch_tokens: a prompt's chunk
        can take the whole step while a decode behind it waits (kept for bench serve's comparison)."""
        preemptions, batch = self.preemptions, []
        self._take(list(self.running), self.max_batch_tokens, batch)
        if len(batch) == len(self.running) and self.preemptions == preemptions:   # room to spare
            budget = self.max_batch_tokens - sum(n for _, n in batch)
            while (admitted := self._admit(budget, bool(batch))) is not None:
                batch.append(admitted)
                budget -= admitted[1]
        return batch

    def _admit(self, budget: int, has_batch: bool, keep_free: int = 0) -> tuple[Sequence, int] | None:
        """The first waiting sequence into the running batch with up to `budget` tokens, if the batch and the
        pool have room (leaving `keep_free` blocks); None if it must wait."""
        if not self.waiting or len(self.running) >= self.max_batch or budget <= 0:
            return None
        seq = self.waiting[0]
        matched = self._cached_prefix(seq)
        pending = len(seq.tokens) - len(matched) * self.block_size
        if not self.chunked_prefill and pending > budget and has_batch:
            return None                              # whole prompts only: wait for a step with room
        n = pending if not self.chunked_prefill else min(pending, budget)
        if not self._fits(matched, len(matched) * self.block_size + n, keep_free):
            return None                              # first come, first served: nobody overtakes
        self.waiting.popleft()
        self._take_prefix(seq, matched)
        self._reserve(seq, seq.num_computed + n)
        self.running.append(seq)
        return seq, n

    # ---- blocks ----------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, n_positions: int) -> bool:
        """Grow seq's block table to hold n_positions, and give it its own copy of each shared block it is
        about to write (copy-on-write: the copies are done before the step runs); all or nothing."""
        first, end = seq.num_computed // self.block_size, math.ceil(n_positions / self.block_size)
        shared = [j for j in range(first, min(end, len(seq.block_table)))
                  if seq.block_table[j] != FREED and self.blocks.refcount[seq.block_table[j]] > 1]
        need = end - len(seq.block_table)
        if max(need, 0) + len(shared) > self.blocks.num_free:
            return False
        for j in shared:
            copy = self.blocks.allocate()
            self.copies.append((seq.block_table[j], copy))
            self.blocks.release(seq.block_table[j])          # the other owners keep it
            seq.block_table[j] = copy
        seq.block_table += [self.blocks.allocate() for _ in range(need)]
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that can stand for seq's first tokens. The last token is always computed:
        its logits give the first new token."""
        if self.prefix_cache is None or seq.whole_prompt:
            return []
        n_blocks = (len(seq.tokens) - 1) // self.block_size
        return self.prefix_cache.match(seq.full_block_hashes(n_blocks, self.block_size))

    def _fits(self, matched: list[int], n_positions: int, keep_free: int = 0) -> bool:
        """Would the pool hold a newcomer that shares `matched` and needs n_positions in all, and still
        have `keep_free` blocks?"""
        need = math.ceil(n_positions / self.block_size) - len(matched)
        revived = sum(1 for b in matched if self.blocks.refcount[b] == 0)   # unused cached: no longer free
        return need + keep_free <= self.blocks.num_free - revived

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
        self.copies = [(src, dst) for src, dst in self.copies if dst not in seq.block_table]
        self.blocks.release_all(seq.block_table)
        seq.num_computed = seq.num_registered = seq.num_dropped = 0
        seq.decoding = False
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # ---- after the model ran ----------------------------------------------------------------------
    def advance(self, seq: Sequence, n: int) -> None:
        """n more of seq's tokens are in the pool; newly full blocks become findable by later requests,
        and with a sliding window the blocks every later query is past go back to the pool."""
        seq.num_computed += n
        seq.decoding = seq.decoding or seq.num_pending == 0
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

    def fork(self, parent: Sequence, children: list[Sequence]) -> int:
        """Run children (the other choices of parent's prompt, engine/choices.py) from parent's computed prompt:
        each shares parent's blocks (one more reference each) and joins the running batch; -> how many joined.
        The ones the batch has no room for (max_batch) wait first in the queue, as requests of their own."""
        joined = children[:max(0, self.max_batch - len(self.running))]
        for child in joined:
            for block in parent.block_table:
                if block != FREED:
                    self.blocks.share(block)
            child.block_table, child.hashes = list(parent.block_table), list(parent.hashes)
            child.num_computed, child.num_registered = parent.num_computed, parent.num_registered
            child.num_dropped, child.cached_tokens, child.decoding = parent.num_dropped, parent.cached_tokens, True
            self.running.append(child)
        self.waiting.extendleft(reversed(children[len(joined):]))
        return len(joined)

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
