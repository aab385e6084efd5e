"""The batching Engine over tensor-parallel ranks: rank 0 schedules and samples, the others follow.

Only rank 0 runs an `Engine` (its scheduler, block manager, prefix cache and sampler). Every batched
forward pass must still run on every rank, since each holds a slice of every layer, so rank 0's runner
first broadcasts the batch it is about to run (the chunks: token ids, start positions, block tables),
then runs it; each other rank, in `follow`, runs the same batch on its own pool (same blocks, its own
KV heads) and drops the logits. The pool's size travels the same way, once, before the first batch.

    rank 0:  schedule -> broadcast(batch) -> forward (all-reduces with the others) -> sample -> ...
    rank r:              receive(batch)   -> forward (all-reduces with rank 0)     -> (nothing)

A follower waits for the next batch as long as it takes (a server may sit idle for hours); rank 0 tells
it to stop when its process ends normally, and a rank that dies takes the others down (launcher.py).
Ctrl-C and SIGTERM, which mpiexec forwards to every rank, stop rank 0's server; the followers ignore them
and end at rank 0's stop, so a server shutting down gracefully is not killed by a follower's exit. After
SIGTERM rank 0 exits normally once drained (uvicorn would re-raise the signal and end it before it could
send the stop, and mpiexec would report a failed rank).
"""
from __future__ import annotations

import atexit
import signal
import sys

from minillm.engine.batched import BatchedRunner, CPUBatching, SeqChunk
from minillm.errors import MiniLLMError

FOREVER = float("inf")


class TPBatching(CPUBatching):
    """CPUBatching for one rank's shard: the pool holds this rank's KV heads (the shard's config, not the
    model's), and on rank 0 the runner sends every batch to the other ranks first."""

    def __init__(self, model):
        super().__init__(model)
        self.comm = model.comm

    def bytes_per_block(self, config, block_size: int, kv_cache: str) -> int:
        return super().bytes_per_block(self.model.config, block_size, kv_cache)

    def new_pool(self, config, num_blocks: int, block_size: int, kv_cache: str):
        if self.comm.rank != 0:
            raise MiniLLMError("only rank 0 runs the Engine; the other ranks run parallel.serving.follow(llm)")
        self.comm.broadcast_object(("pool", num_blocks, block_size, kv_cache))
        return super().new_pool(self.model.config, num_blocks, block_size, kv_cache)

    def new_runner(self, pool) -> "LeaderRunner":
        return LeaderRunner(BatchedRunner(self.model, pool), self.comm)


class LeaderRunner:
    """Rank 0's runner: each forward pass is announced to the followers, then run with them."""

    def __init__(self, runner: BatchedRunner, comm):
        self.runner, self.comm, self.released = runner, comm, False
        atexit.register(self.release)

    @property
    def pool(self):
        return self.runner.pool

    def forward(self, chunks: list[SeqChunk], all_logits: bool = False, rows=None):
        self.comm.broadcast_object(("forward", _plain(chunks), all_logits, rows))
        return self.runner.forward(chunks, all_logits, rows)

    def forward_greedy(self, chunks: list[SeqChunk]):
        """The followers run the same forward pass (and drop its logits); only rank 0 picks the tokens."""
        self.comm.broadcast_object(("forward", _plain(chunks), False, None))
        return self.runner.forward_greedy(chunks)

    def release(self) -> None:
        """Tell the followers there is nothing more to run (once; also at this process's normal exit)."""
        if not self.released:
            self.released = True
            self.comm.broadcast_object(("stop",))


def _plain(chunks: list[SeqChunk]) -> list[tuple]:
    """What travels: token ids, start and block table of each chunk (lists of ints pickle small)."""
    return [(list(map(int, c.token_ids)), int(c.start), list(map(int, c.block_table))) for c in chunks]


def follow(llm) -> int:
    """A rank other than 0: build the pool rank 0 announces, run each batch it sends, return at its stop.
    -> how many batches ran."""
    model = llm.model
    comm = getattr(model, "comm", None)
    if comm is None or comm.rank == 0:
        raise MiniLLMError("follow() is for ranks other than 0 of a tensor-parallel model")
    batching, runner, steps = CPUBatching(model), None, 0
    while True:
        message = comm.broadcast_object(None, timeout_s=FOREVER)
        if message[0] == "stop":
            return steps
        if message[0] == "pool":
            _, num_blocks, block_size, kv_cache = message
            runner = BatchedRunner(model, batching.new_pool(model.config, num_blocks, block_size, kv_cache))
        else:
            _, chunks, all_logits, rows = message
            runner.forward([SeqChunk(*c) for c in chunks], all_logits, rows)
            steps += 1


def follows(llm) -> bool:
    """On a tensor-parallel rank other than 0: follow rank 0's Engine until it stops, then True (the caller
    is done). Elsewhere False at once: this process runs the Engine itself. (`minillm serve --tp N`.)"""
    comm = getattr(llm.model, "comm", None)
    if comm is None:
        return False
    if comm.rank == 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        return False
    for signum in (signal.SIGINT, signal.SIGTERM):     # rank 0 says when to stop, once its server has drained
        signal.signal(signum, signal.SIG_IGN)
    follow(llm)
    return True
