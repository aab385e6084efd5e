"""Measuring tensor parallelism on this machine: µs per all-reduce, prefill and decode tok/s, and the
share of a decode step spent in collectives.

`measure(model, tp, threads)` runs `python -m minillm.engine.parallel.measure` as `tp` MPI ranks (each
with `threads` BLAS threads) and returns rank 0's numbers; lesson 21 and the benchmark docs use it to
compare tp = 1 with 2 threads against tp = 2 with 1 thread a rank on the same cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from minillm.engine.parallel.communicator import Communicator, SingleProcess
from minillm.engine.parallel.sharding import model_bytes


def allreduce_us(comm: Communicator, sizes=(576, 4096, 576 * 64), iters: int = 200) -> dict[int, float]:
    """Median µs of one fp32 all-reduce of n values, for each n (every rank must call this)."""
    out = {}
    for n in sizes:
        x = np.ones(n, dtype=np.float32)
        times = []
        for i in range(iters + 20):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(x)
            if i >= 20:                                   # the first calls set up buffers and connections
                times.append(time.perf_counter() - start)
        out[n] = 1e6 * float(np.median(times))
    return out


def profile(model, prompt_tokens: int = 64, new_tokens: int = 16, seed: int = 0) -> dict:
    """Prefill `prompt_tokens` random ids, then decode `new_tokens` greedily: tok/s of each phase, and the
    seconds of the decode spent in collectives (the communication share of a step)."""
    comm = model.comm or SingleProcess()
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, prompt_tokens).tolist()
    cache = model.new_cache(prompt_tokens + new_tokens + 1)
    comm.barrier()
    start = time.perf_counter()
    logits = model.prefill(ids, cache)
    prefill_s = time.perf_counter() - start
    comm.stats.reset()
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = model.decode(int(np.argmax(logits)), cache)
    decode_s = time.perf_counter() - start
    stats = comm.stats
    return {"prefill_tok_s": prompt_tokens / prefill_s, "decode_tok_s": new_tokens / decode_s,
            "comm_share": stats.total_seconds / decode_s,
            "collectives_per_token": sum(stats.calls.values()) / new_tokens,
            "all_reduce_us": 1e6 * stats.seconds["all_reduce"] / max(stats.calls["all_reduce"], 1)}


def measure(model: str | Path, tp: int = 1, threads: int = 1, prompt_tokens: int = 64, new_tokens: int = 16,
            timeout_s: float = 600) -> dict:
    """Run `profile` (and, at tp > 1, `allreduce_us`) as `tp` ranks with `threads` BLAS threads each."""
    from minillm.engine.parallel.launcher import find_mpiexec
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MINILLM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "numbers.json"
        cmd = [sys.executable, "-m", "minillm.engine.parallel.measure", str(model), str(out), str(tp),
               str(prompt_tokens), str(new_tokens)]
        if tp > 1:
            cmd = [find_mpiexec(), "-n", str(tp)] + cmd
        subprocess.run(cmd, check=True, env=env, timeout=timeout_s, capture_output=True, text=True)
        return json.loads(out.read_text())


def _rank_model(path: str, tp: int):
    """This rank's Transformer straight from an HF-layout folder (float weights): what load(tp=) builds,
    without the layers above the engine."""
    from minillm.checkpoints.weights import load_hf_dir
    from minillm.engine.parallel.communicator import from_environment
    from minillm.engine.parallel.sharding import shard_checkpoint
    from minillm.model.transformer import Transformer
    config, tensors = load_hf_dir(path)
    comm = from_environment(tp)
    if comm.size > 1:
        config, tensors = shard_checkpoint(config, tensors, comm.rank, comm.size)
    return Transformer(config, tensors, comm=comm if comm.size > 1 else None)


def measure_link(timeout_s: float = 120):
    """This machine's MPI as a cost.Link: two fp32 all-reduces between 2 local ranks, fitted (lesson 21,
    `minillm plan --tp N --link mpi`)."""
    from minillm.engine.parallel.cost import measured_link
    from minillm.engine.parallel.launcher import find_mpiexec
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "link.json"
        cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "minillm.engine.parallel.measure", "--link", str(out)]
        subprocess.run(cmd, check=True, env=env, timeout=timeout_s, capture_output=True, text=True)
        (n1, us1), (n2, us2) = [(int(n), us) for n, us in json.loads(out.read_text()).items()]
    return measured_link(us1, n1, us2, n2)


def _main() -> None:
    if sys.argv[1:2] == ["--link"]:                   # measure_link's ranks
        from minillm.engine.parallel.communicator import from_environment
        comm = from_environment(2)
        sizes = allreduce_us(comm, (1024, 256 * 1024))
        if comm.rank == 0:
            Path(sys.argv[2]).write_text(json.dumps(sizes))
        return
    p = argparse.ArgumentParser(description="one rank of `measure` (run it under mpiexec for tp > 1)")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("tp", type=int)
    p.add_argument("prompt_tokens", type=int)
    p.add_argument("new_tokens", type=int)
    a = p.parse_args()
    model = _rank_model(a.model, a.tp)
    comm = model.comm or SingleProcess()
    numbers = profile(model, a.prompt_tokens, a.new_tokens)
    numbers["weights_bytes_per_rank"] = model_bytes(model)
    if comm.size > 1:
        numbers["all_reduce_us_by_size"] = allreduce_us(comm, (model.config.dim, 64 * model.config.dim))
    if comm.rank == 0:
        Path(a.out).write_text(json.dumps(numbers))


if __name__ == "__main__":
    _main()
