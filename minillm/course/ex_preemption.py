"""Exercise 17.2, a behaviour exercise: one step of continuous batching's scheduler, with preemption.

The student's `schedule_step(state) -> decision` sees the batch as data and answers with what to run
and whom to preempt; the grader replays each decision on its own BlockManager (engine/paged_kv.py) and
its own queues (behaviour.replay), checking after every step that the pool is never over-committed, and
at the end that no request was lost: each one finished with every output token it asked for."""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.course.cases import Case, CaseFailed, case_rng
from minillm.course.behaviour import replay
from minillm.engine.paged_kv import BlockManager


def schedule_step_reference(state: dict) -> dict:
    """The engine scheduler's rule (engine/scheduler.py) as a policy: running sequences oldest first,
    preempting the newest when blocks run out; then waiting ones first come first served."""
    bs, free, budget = state["block_size"], state["free_blocks"], state["max_batch_tokens"]
    queue, run, preempt = list(state["running"]), [], []
    while queue and budget:
        seq = queue.pop(0)
        n = min(seq["tokens"] - seq["computed"], budget)
        need = -(-(seq["computed"] + n) // bs) - seq["blocks"]
        while need > free and queue:                          # preempt the newest until this one fits
            victim = queue.pop()
            preempt.append(victim["id"])
            free += victim["blocks"]
        if need > free:                                       # no one left to preempt: wait itself
            preempt.append(seq["id"])
            free += seq["blocks"]
            continue
        run.append([seq["id"], n])
        free, budget = free - need, budget - n
    for seq in state["waiting"]:
        n = min(seq["tokens"], budget)
        need = -(-n // bs)
        if n == 0 or need > free:
            break
        run.append([seq["id"], n])
        free, budget = free - need, budget - n
    return {"preempt": preempt, "run": run}


@dataclass
class _Seq:
    id: int
    tokens: int                     # prompt + outputs so far: what a recompute runs again
    outputs_left: int
    computed: int = 0
    table: list[int] = field(default_factory=list)


class SchedulerWorld:
    """The grader's side: requests, a BlockManager, the running and waiting queues."""

    def __init__(self, requests: list[tuple[int, int]], num_blocks: int, block_size: int, max_batch_tokens: int):
        self.blocks, self.block_size, self.budget = BlockManager(num_blocks), block_size, max_batch_tokens
        self.num_blocks = num_blocks
        self.waiting = [_Seq(i, p, o) for i, (p, o) in enumerate(requests)]
        self.running: list[_Seq] = []
        self.finished: list[_Seq] = []
        self.asked = {i: o for i, (_, o) in enumerate(requests)}
        self.steps = self.preemptions = 0

    def observe(self) -> dict:
        return {"block_size": self.block_size, "free_blocks": self.blocks.num_free,
                "max_batch_tokens": self.budget,
                "running": [{"id": s.id, "tokens": s.tokens, "computed": s.computed, "blocks": len(s.table)}
                            for s in self.running],
                "waiting": [{"id": s.id, "tokens": s.tokens} for s in self.waiting]}

    def apply(self, decision) -> None:
        self.steps += 1
        preempt = [int(i) for i in decision["preempt"]]
        run = [(int(i), int(n)) for i, n in decision["run"]]
        running = {s.id: s for s in self.running}
        for i in preempt:
            if i not in running:
                raise CaseFailed(f"preempts sequence {i}, which is not running")
            seq = running.pop(i)
            self.blocks.release_all(seq.table)               # its blocks back; it recomputes from its tokens
            seq.table, seq.computed = [], 0
            self.running.remove(seq)
            self.waiting.insert(0, seq)
            self.preemptions += 1
        if len({i for i, _ in run}) < len(run):
            raise CaseFailed("runs a sequence twice in one step")
        if sum(n for _, n in run) > self.budget:
            raise CaseFailed(f"runs {sum(n for _, n in run)} tokens, over the step budget of {self.budget}")
        waiting = {s.id: s for s in self.waiting}
        for i, n in run:
            seq = running.get(i) or waiting.get(i)
            if seq is None:
                raise CaseFailed(f"runs sequence {i}, which is neither running nor waiting")
            if not 1 <= n <= seq.tokens - seq.computed:
                raise CaseFailed(f"runs {n} tokens of sequence {i}, which has {seq.tokens - seq.computed} to compute")
            need = -(-(seq.computed + n) // self.block_size) - len(seq.table)
            if need > self.blocks.num_free:
                raise CaseFailed(f"over-commits the pool: sequence {i} needs {need} more blocks for {n} tokens, "
                                 f"{self.blocks.num_free} are free")
            seq.table += [self.blocks.allocate() for _ in range(need)]
            if i in waiting:
                self.waiting.remove(seq)
                self.running.append(seq)
        for i, n in run:
            seq = next(s for s in self.running if s.id == i)
            seq.computed += n
            if seq.computed == seq.tokens:                   # caught up: this step sampled a token
                seq.outputs_left -= 1
                if seq.outputs_left == 0:
                    self.blocks.release_all(seq.table)
                    self.running.remove(seq)
                    self.finished.append(seq)
                else:
                    seq.tokens += 1

    def done(self) -> bool:
        return not self.running and not self.waiting

    def verdict(self) -> str:
        lost = [i for i, o in self.asked.items() if not any(s.id == i and s.outputs_left == 0 for s in self.finished)]
        if lost:
            raise CaseFailed(f"requests {lost} never finished")
        if self.blocks.num_free != self.num_blocks:
            raise CaseFailed(f"{self.num_blocks - self.blocks.num_free} blocks still held after every request finished")
        return (f"{len(self.finished)} requests finished in {self.steps} steps with {self.preemptions} "
                f"preemption{'s' if self.preemptions != 1 else ''}; the pool was never over-committed")


def _schedule_cases() -> list[Case]:
    rng = case_rng(17, 2)

    def requests(n, prompt, output):
        return [(int(rng.integers(*prompt)), int(rng.integers(*output))) for _ in range(n)]
    return [Case("a roomy pool: three requests, no preemption needed",
                 dict(requests=requests(3, (3, 9), (2, 6)), num_blocks=32, block_size=4, max_batch_tokens=32)),
            Case("a pool too small for all at once: someone must be preempted",
                 dict(requests=requests(3, (6, 8), (8, 10)), num_blocks=8, block_size=4, max_batch_tokens=32)),
            Case("a prompt longer than the step budget: prefilled in chunks",
                 dict(requests=[(int(rng.integers(20, 30)), 3)] + requests(2, (2, 5), (3, 6)), num_blocks=24,
                      block_size=4, max_batch_tokens=8)),
            Case("eight short requests at once in a tight pool",
                 dict(requests=requests(8, (2, 6), (2, 8)), num_blocks=10, block_size=2, max_batch_tokens=16))]


def _check_schedule(fn, case: Case) -> str:
    return replay(fn, SchedulerWorld(**case.inputs))
