"""What the lab's same-run decode sweeps share (dev.ab, dev.chain, dev.pdl): their options and their setup.
The measuring itself is production's (minillm/cuda/timing.py)."""
from __future__ import annotations

import argparse

import numpy as np

from minillm.cuda.selfcheck import bench_config, say
from minillm.cuda.timing import copy_bandwidth


def sweep_parser(module: str, doc: str, rounds: int = 3) -> argparse.ArgumentParser:
    """The options every same-run decode sweep takes (dev.ab, dev.chain, dev.pdl): --quick, --rounds,
    --new-tokens; `module` is its name under minillm.cuda.dev, `doc` its docstring (the first line describes it)."""
    ap = argparse.ArgumentParser(prog=f"python -m minillm.cuda.dev.{module}", description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model instead of the Mistral-7B shape")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--new-tokens", type=int, default=128)
    return ap


def decode_sweep_setup(quick: bool, prompt_len: int = 16):
    """(config, copy bandwidth B/s, a random prompt) for a same-run decode sweep (dev.ab, dev.chain,
    dev.pdl): the Mistral-7B shape or, quick, a small one; says which, and the bandwidth."""
    cfg = bench_config(quick)
    bw = copy_bandwidth(2048 << 20)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len)
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s; {'quick shape' if quick else 'mistral-7b shape'}, random weights")
    return cfg, bw, prompt
