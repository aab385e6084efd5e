"""`minillm bench choices`: n choices of one prompt (its prefill once, its blocks shared) against one request
and against n separate requests: wall time and the KV blocks each holds at its peak.

Every run gets a fresh engine (no prefix-cache hits carried over), temperature 1 with ignore_eos (every run
makes exactly its tokens), BLAS threads as the measured thread policy picks them (minillm.load); the three
modes take turns round after round, so a busy machine slows each alike, and each row is its median round.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from minillm.engine.engine import Engine
from minillm.threads import policy


@dataclass
class ChoicesRow:
    mode: str                   # "one request" | "n choices, shared" | "n separate requests"
    sequences: int
    seconds: float              # the median round's wall time, prompt in to last token out
    over_one: float             # the median of each round's seconds over that round's one request
    peak_blocks: int            # KV blocks held at the peak
    block_size: int


def run_mode(llm, prompt: list[int], n: int, new_tokens: int, shared: bool, seed: int) -> tuple[float, int, int]:
    """One run on a fresh engine; -> (seconds, peak KV blocks, block size)."""
    engine = Engine(llm, prefix_caching=False)
    sampling = dict(max_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    start = time.perf_counter()
    if shared:
        engine.generate_choices(prompt, n, seed=seed, **sampling)
    else:                                        # n requests of their own: n prefills, n copies of the prompt
        for i in range(n):
            engine.add_request(prompt, seed=seed + i, **sampling)
        while engine.has_unfinished():
            engine.step()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return seconds, stats["peak_kv_bytes"] // stats["kv_bytes_per_block"], engine.pool.block_size


def bench_choices(llm, n: int = 4, prompt_tokens: int = 64, new_tokens: int = 64, rounds: int = 3,
                  seed: int = 0) -> list[ChoicesRow]:
    """The three modes on one random prompt of `prompt_tokens` ids, `rounds` interleaved rounds each."""
    prompt = np.random.default_rng(seed).integers(100, llm.config.vocab_size, prompt_tokens).tolist()
    modes = [("one request", 1, True), (f"{n} choices, shared", n, True), (f"{n} separate requests", n, False)]
    run_mode(llm, prompt, 1, 2, True, seed)                                 # warm-up: caches, thread pools
    times: dict[str, list[float]] = {name: [] for name, _, _ in modes}
    blocks: dict[str, tuple[int, int]] = {}
    for _ in range(rounds):
        for name, k, shared in modes:
            seconds, peak, block_size = run_mode(llm, prompt, k, new_tokens, shared, seed)
            times[name].append(seconds)
            blocks[name] = (peak, block_size)
    one = times[modes[0][0]]                     # ratios within a round: a busy machine slows the round alike
    return [ChoicesRow(name, k, statistics.median(times[name]),
                       statistics.median(t / o for t, o in zip(times[name], one)), *blocks[name])
            for name, k, _ in modes]


def format_table(rows: list[ChoicesRow], prompt_tokens: int, new_tokens: int) -> str:
    lines = [f"{prompt_tokens}-token prompt, {new_tokens} tokens out per sequence, temperature 1, ignore_eos; "
             f"{policy() or 'BLAS threads: as BLAS starts'}",
             f"{'':<24}{'sequences':>10}{'seconds':>10}{'x one':>8}{'KV blocks':>11}"]
    for r in rows:
        lines.append(f"{r.mode:<24}{r.sequences:>10}{r.seconds:>10.2f}{r.over_one:>8.2f}{r.peak_blocks:>11}")
    lines.append(f"(seconds: the median round; x one: the median of the rounds' ratios; blocks of {rows[0].block_size} "
                 "tokens, the shared choices holding the prompt's full blocks once)")
    return "\n".join(lines)


def run_cli(model: str, n: int, prompt_tokens: int, new_tokens: int, rounds: int, echo) -> int:
    from minillm.llm import load
    llm = load(model)
    rows = bench_choices(llm, n, prompt_tokens, new_tokens, rounds)
    echo(format_table(rows, prompt_tokens, new_tokens))
    return 0
