"""Prefill with int8/int4 weights: each matrix widened right before its GEMM, or one GEMM ahead on a second
stream (lab.LabSettings.prefill_widen_ahead, minillm/cuda/dev/widen_ahead.py), measured.

    check   the prompt's logits are the same either way, bit for bit
    time    TTFT of a 512-token prompt, both ways in alternating rounds (the machine drifts), beside fp16's
            (no widening at all: the floor widening ahead can reach), Mistral-7B shape, random weights

    python -m minillm.cuda.dev.widen [--quick] [--rounds N] [--prompt N]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from minillm.cuda.selfcheck import bench_config
from minillm.cuda.timing import prefill_ttft
from minillm.cuda.dev.common import alternating_medians, finish, plain_table, require_gpu, say, verdict
from minillm.cuda.dev.lab import as_lab_model

WAYS = {"widen, then GEMM": {"prefill_widen_ahead": False}, "widen one GEMM ahead": {"prefill_widen_ahead": True},
        "ahead, side stream at high priority": {"prefill_widen_ahead": True, "prefill_widen_priority": -5}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.widen", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model instead of the Mistral-7B shape")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args(argv)
    if not require_gpu(ap.prog):
        return 2
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    cfg = bench_config(args.quick)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt)
    rows = []
    for method in ("float16", "int8", "int4"):
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=None if method == "float16" else method)
        cache = gpu.new_cache(args.prompt + 8)
        ways = {"no widening (16-bit weights)": gpu} if method == "float16" else {
            label: as_lab_model(gpu).with_settings(**changes) for label, changes in WAYS.items()}
        if method != "float16":
            logits = []
            for model in ways.values():
                cache.reset()
                logits.append(model.prefill(prompt, cache))
            diff = max(float(np.max(np.abs(other - logits[0]))) for other in logits[1:])
            verdict(f"widen {method}", diff == 0.0, f"largest logit change {diff:g}")
        ttft = alternating_medians(ways, lambda model, cache=cache: prefill_ttft(model, cache, prompt), args.rounds)
        first = next(iter(ttft.values()))
        for label, seconds in ttft.items():
            rows.append([method, label, f"{1e3 * seconds:.1f}", f"{first / seconds:.2f}x"])
        del gpu, ways, cache
        cp.get_default_memory_pool().free_all_blocks()
    plain_table(f"\nTTFT of a {args.prompt}-token prompt (host logits included), median of {args.rounds} alternating "
                "rounds of prefill_ttft's median of 3", ["weights", "prefill", "TTFT ms", "speed-up"], rows)
    say("(speed-up: against the first row of the same weights)")
    return finish(ap.prog)


if __name__ == "__main__":
    sys.exit(main())
