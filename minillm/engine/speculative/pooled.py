"""Speculative decoding inside the continuous-batching Engine.

Every running request that is decoding gets up to k drafts a step; they ride in the step's batch as part
of its chunk [pending, d_1 .. d_n], so one batched target pass verifies every request's drafts at once,
and each request keeps what the acceptance rule accepts. The scheduler sees the drafts as ordinary
pending tokens: it reserves their blocks and counts them in the token budget, and may preempt for them.
After the pass the rejected drafts leave `seq.tokens`, `num_computed` stops after the accepted ones, and
blocks left with no computed position go back to the pool (`Scheduler.rollback`).

A draft *model* keeps its KV in a pool of its own that follows the target's block tables block for
block (`DraftPool`): block j of a request holds the same positions in both, so admission, preemption and
the prefix cache count and move the draft's memory with the target's (the engine sizes its blocks as
target + draft bytes). The draft tracks, per request, how many positions of its pool are valid and
catches up from there; after a preemption the blocks differ and it recomputes.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.engine.batched import BatchedRunner, SeqChunk
from minillm.engine.paged_kv import FREED, PagedKVCache
from minillm.engine.sampling import next_token_distribution
from minillm.engine.speculative.acceptance import accept_draft
from minillm.engine.speculative.decode import SpeculativeStats
from minillm.engine.speculative.drafters import ModelDrafter


class DraftPool:
    """A ModelDrafter run batched over the engine's block tables, its KV in its own PagedKVCache."""

    def __init__(self, drafter: ModelDrafter, num_blocks: int, block_size: int, storage: str = "float32"):
        self.model, self.n_layers = drafter.model, drafter.n_layers
        self.vocab_size = drafter.vocab_size
        self.pool = PagedKVCache(draft_config(drafter), num_blocks, block_size, storage)
        self.runner = BatchedRunner(self.model, self.pool, n_layers=self.n_layers)
        self.valid: dict[int, tuple[int, list[int]]] = {}     # request id -> (positions valid, their blocks)

    def propose(self, items: list[tuple], window: int | None) -> list[tuple[list[int], np.ndarray | None]]:
        """items: (seq, context [L tokens, the last pending], n drafts wanted, params, rng) per request.
        -> (drafts, q [n, vocab] or None) per item. Positions L-1 .. L+n-2 are written: inside the
        blocks the scheduler reserved for the target's verify pass."""
        bs = self.pool.block_size
        starts = [self._valid_positions(seq, window) for seq, *_ in items]
        chunks = [SeqChunk(list(ctx[start:]), start, seq.block_table)
                  for (seq, ctx, *_), start in zip(items, starts)]
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[np.ndarray]] = [[] for _ in items]
        live = list(range(len(items)))
        while live:
            logits = self.runner.forward([chunks[i] for i in live])            # [len(live), vocab]
            still = []
            for i, row in zip(live, logits):
                seq, ctx, n, params, rng = items[i]
                row = row[:self.vocab_size]
                if params.temperature == 0.0:
                    token = int(np.argmax(row))
                else:
                    q = next_token_distribution(row, params)                   # filtered as the target's p
                    token = int(rng.choice(len(q), p=q))
                    probs[i].append(q)
                drafts[i].append(token)
                if len(drafts[i]) < n:
                    chunks[i] = SeqChunk([token], chunks[i].end, seq.block_table)
                    still.append(i)
            live = still
        for (seq, ctx, n, *_), chunk in zip(items, chunks):
            end = chunk.end                                                    # the last draft is not run
            self.valid[seq.request_id] = (end, list(seq.block_table[:math.ceil(end / bs)]))
        return [(d, np.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def rollback(self, seq) -> None:
        """After the verify pass: only the positions the target kept are valid."""
        n, blocks = self.valid.get(seq.request_id, (0, []))
        n = min(n, seq.num_computed)
        self.valid[seq.request_id] = (n, blocks[:math.ceil(n / self.pool.block_size)])

    def forget(self, request_id: int) -> None:
        self.valid.pop(request_id, None)

    def _valid_positions(self, seq, window: int | None) -> int:
        """Where this request's draft catches up from: its valid positions, cut at the first block that
        changed (a preemption gave it new blocks). With a sliding window the target has given back the
        blocks behind it: the draft starts after them, over keys it never saw (a worse draft, never a
        wrong answer: the target decides)."""
        n, blocks = self.valid.get(seq.request_id, (0, []))
        bs = self.pool.block_size
        for j, b in enumerate(blocks):
            if j >= len(seq.block_table) or (seq.block_table[j] != b and seq.block_table[j] != FREED):
                n = min(n, j * bs)
                break
        if window and seq.num_dropped:
            n = max(n, seq.num_dropped * bs + window - 1)   # the first position whose reads are all kept
        return min(n, seq.num_computed)


def draft_config(drafter: ModelDrafter):
    """The draft's config, with the early exit's layer count: its pool holds only those layers."""
    cfg = drafter.model.config
    return cfg if drafter.n_layers is None else cfg.replace(n_layers=drafter.n_layers)


class EngineSpeculation:
    """The Engine's speculative step: drafts before scheduling, the model draft after it, and the
    verify-accept-rollback of each request after the batched target pass."""

    def __init__(self, drafter, k: int, num_blocks: int, block_size: int, storage: str, window: int | None):
        self.drafter, self.k, self.window = drafter, k, window
        self.draft_pool = DraftPool(drafter, num_blocks, block_size, storage) if isinstance(drafter, ModelDrafter) else None
        self.pending: dict[int, tuple[list[int], np.ndarray | None]] = {}   # request id -> (drafts, q)
        self.stats: dict[int, SpeculativeStats] = {}                     # request id -> its counts
        self.totals = SpeculativeStats()

    @staticmethod
    def draft_bytes_per_block(drafter, block_size: int, storage: str) -> int:
        """What a block costs in the draft's own pool (0 for a drafter without a model)."""
        if not isinstance(drafter, ModelDrafter):
            return 0
        return PagedKVCache(draft_config(drafter), 1, block_size, storage).nbytes

    def draft(self, running: list, requests: dict) -> None:
        """Before scheduling: each decoding request's drafts become pending tokens (a draft model's are
        placeholders until its blocks are reserved). At most one fewer than the tokens it has left."""
        for seq in running:
            if seq.num_pending != 1:
                continue                                     # still prefilling
            n = min(self.k, seq.max_tokens - len(seq.output_ids) - 1)
            if n <= 0:
                continue
            if self.draft_pool is None:
                tokens, q = self.drafter.propose(seq.tokens, n, requests[seq.request_id].sampler.params,
                                                 requests[seq.request_id].sampler.rng)
                tokens = tokens[:n]
            else:
                tokens, q = [0] * n, None                    # filled in after scheduling
            if tokens:
                self.pending[seq.request_id] = (tokens, q)
                seq.tokens.extend(tokens)

    def fill(self, batch: list, requests: dict) -> None:
        """After scheduling: drafts of requests not in the batch leave their tokens; a chunk cut by the
        token budget keeps the drafts it holds; then the draft model drafts for the chunks (batched)."""
        in_batch = {seq.request_id: (seq, n) for seq, n in batch}
        for rid in list(self.pending):
            tokens, q = self.pending[rid]
            seq, n = in_batch.get(rid, (requests[rid].seq, 0))
            keep = max(0, n - 1) if rid in in_batch else 0
            if keep < len(tokens):
                del seq.tokens[len(seq.tokens) - (len(tokens) - keep):]
                tokens, q = tokens[:keep], (q[:keep] if q is not None else None)
            if tokens:
                self.pending[rid] = (tokens, q)
            else:
                del self.pending[rid]
        if self.draft_pool is not None and self.pending:
            items = []
            for rid, (tokens, _) in self.pending.items():
                seq, sampler = requests[rid].seq, requests[rid].sampler
                items.append((seq, seq.tokens[:len(seq.tokens) - len(tokens)], len(tokens), sampler.params, sampler.rng))
            for (seq, ctx, n, *_), (tokens, q) in zip(items, self.draft_pool.propose(items, self.window)):
                seq.tokens[len(ctx):] = tokens
                self.pending[seq.request_id] = (tokens, q)

    def rows(self, batch: list) -> tuple[list[int], list[slice]] | None:
        """Which rows of the packed batch need logits: every row of a verify chunk, the last of the rest.
        -> (rows, each request's slice of them), or None when no request has drafts this step."""
        if not any(seq.request_id in self.pending for seq, _ in batch):
            return None
        rows, slices, start = [], [], 0
        for seq, n in batch:
            first = len(rows)
            rows.extend(range(start, start + n) if seq.request_id in self.pending else [start + n - 1])
            slices.append(slice(first, len(rows)))
            start += n
        return rows, slices

    def verify(self, request, logits: np.ndarray, scheduler) -> list[int]:
        """Accept this request's drafts against the target's rows [n + 1, vocab]; advance the sequence past
        the pending token and the accepted drafts only, give back the blocks past them. -> emitted tokens."""
        seq = request.seq
        tokens, q = self.pending.pop(seq.request_id)
        del seq.tokens[len(seq.tokens) - len(tokens):]
        emitted = accept_draft(tokens, q, logits, request.sampler.params, request.sampler.rng)
        accepted = emitted[:-1]
        seq.tokens.extend(accepted)                            # the prefix cache hashes what stays
        scheduler.advance(seq, 1 + len(accepted))
        del seq.tokens[len(seq.tokens) - len(accepted):]       # re-added, under the stop rules, by the engine
        scheduler.rollback(seq)
        if self.draft_pool is not None:
            self.draft_pool.rollback(seq)
        for s in (self.stats.setdefault(seq.request_id, SpeculativeStats()), self.totals):
            s.draft_tokens += len(tokens)
            s.accepted_tokens += len(accepted)
            s.target_forwards += 1
        return emitted

    def forget(self, request_id: int) -> None:
        """A request finished or was aborted: drop its drafts and its draft-pool state."""
        self.pending.pop(request_id, None)
        if self.draft_pool is not None:
            self.draft_pool.forget(request_id)
