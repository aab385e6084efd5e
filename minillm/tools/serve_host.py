"""What the serving engine does on the host each step, beside the forward pass, measured on this CPU.

The runner is a fake that returns ready-made logits at once, so a step's time is the engine's own work:

    schedule     Scheduler.schedule: which sequences run, blocks for them
    pack         what GPUBatchedRunner does before its launches: batch_meta (eager) or decode_meta_into
                 (the padded metadata of a graph bucket), on the host
    sample       the samplers, one per request, over [vocab] logits each (none at temperature 0: a greedy
                 step takes token ids from the runner, forward_greedy, which the GPU picks on the device)
    detokenize   _TextCollector.push: the streaming decoder and stop strings
    step         Engine.step end to end (all of the above and the bookkeeping)

    python -m minillm.tools.serve_host [--users 64] [--steps 200] [--temperature 0.8]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

from minillm.cuda.batch_meta import batch_meta, bucket_for, decode_meta_into, meta_size
from minillm.engine import engine as engine_module
from minillm.engine.batched import CPUBatching
from minillm.engine.engine import Engine
from minillm.llm import LLM
from minillm.model.config import PRESETS


class Clock:
    """Seconds spent in each named part during the current step, and per-step totals."""

    def __init__(self):
        self.now: dict[str, float] = {}
        self.steps: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - t
        return timed

    def close_step(self) -> None:
        for name, s in self.now.items():
            self.steps.setdefault(name, []).append(s)
        self.now = {}


class FakeRunner:
    """The runner's contract with no model: packs the batch's metadata as the GPU runner does (timed), then
    returns random logits [B, vocab] made once (forward_greedy: their argmax, int32 [B])."""

    def __init__(self, config, pool, clock: Clock):
        self.config, self.pool, self.clock = config, pool, clock
        self.width = min(-(-config.max_seq_len // pool.block_size), pool.num_blocks)
        self.logits = np.random.default_rng(0).standard_normal((512, config.vocab_size)).astype(np.float32)
        self.ids = self.logits.argmax(axis=1).astype(np.int32)
        self.host = {}

    def forward(self, chunks, all_logits: bool = False, rows=None) -> np.ndarray:
        t = time.perf_counter()
        if all(len(c.token_ids) == 1 for c in chunks) and bucket_for(len(chunks)):
            bucket = bucket_for(len(chunks))
            flat = self.host.setdefault(bucket, np.zeros(meta_size(bucket, self.width), np.int32))
            decode_meta_into(flat, chunks, self.pool.block_size, bucket, self.width)
        else:
            batch_meta(chunks, self.pool.block_size, np.asarray)
        self.clock.now["pack"] = time.perf_counter() - t
        return self.logits[:len(chunks)]

    def forward_greedy(self, chunks) -> np.ndarray:
        self.forward(chunks)
        return self.ids[:len(chunks)]


class _TimedSampler:
    """A request's sampler whose picks the clock times; the engine reads and sets its other attributes
    (argmax_only, allowed_tokens, ...) on the sampler itself."""

    def __init__(self, sampler, timed_call):
        self.__dict__.update(_sampler=sampler, _call=timed_call)

    def __call__(self, logits):
        return self._call(logits)

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def __setattr__(self, name, value):
        setattr(self._sampler, name, value)


def measure(users: int, steps: int, temperature: float, prompt_len: int, tokenizer) -> dict[str, float]:
    """Median ms per decode step of each part, `users` sequences decoding at once."""
    config = dataclasses.replace(PRESETS["mistral-7b"].config, n_layers=1)   # the pool is not used: keep it small
    clock = Clock()

    class Fake(CPUBatching):
        def __init__(self):                                  # no model to check
            self.model = None

        def new_runner(self, pool):
            return FakeRunner(config, pool, clock)
    llm = LLM(config, None, tokenizer, batching=Fake())
    engine = Engine(llm, max_batch=users, kv_cache="auto", num_blocks=users * (prompt_len + steps + 40) // 16)
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    rng = np.random.default_rng(1)
    for _ in range(users):
        engine.add_request(rng.integers(100, 30000, prompt_len).tolist(), max_tokens=steps + 20,
                           temperature=temperature, ignore_eos=True)
    while not all(r.seq.output_ids for r in engine.requests.values()):
        engine.step()                                            # the prompts, not measured
    for r in engine.requests.values():
        r.sampler = _TimedSampler(r.sampler, clock.wrap("sample", r.sampler))
        r.text.push = clock.wrap("detokenize", r.text.push)
    clock.now = {}
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        clock.now["step"] = time.perf_counter() - t
        clock.close_step()
    return {name: 1e3 * statistics.median(v) for name, v in clock.steps.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.tools.serve_host")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="default: greedy and 0.8")
    parser.add_argument("--tokenizer", default=None, help="a model folder with tokenizer.json (default: none)")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from minillm.checkpoints.tokenizer_files import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)
    temps = [args.temperature] if args.temperature is not None else [0.0, 0.8]
    print(f"host work per decode step, {args.users} users, vocab 32000, median of {args.steps} steps (ms)")
    names = ["schedule", "pack", "sample", "detokenize", "step"]
    print("temperature  " + "  ".join(f"{n:>10}" for n in names))
    for temp in temps:
        ms = measure(args.users, args.steps, temp, args.prompt_len, tokenizer)
        print(f"{temp:<11}  " + "  ".join(f"{ms.get(n, 0.0):10.3f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
