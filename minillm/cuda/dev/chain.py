"""The decode step as a chain of kernels: what each kind costs inside it.

A kernel timed alone (32 copies of it in a graph) is not what it costs in the decode step: there each
kernel starts during the one ahead (programmatic dependent launch) and finds some of its weights already
in L2. So this module measures inside the chain:

    parts     decode tok/s with one kind of kernel left out of the captured step (its launches not made:
              the outputs are wrong by design, the timing is what is kept): the step's time minus that,
              a layer, is what the kind adds to the chain (its marginal µs), beside its share of the bytes
(The prefetches across its links this module also measured, K/V and whole rows before the wait, were slower
or even and left the kernels: lessons/BENCHMARKS_HISTORY.md.)

    python -m minillm.cuda.dev.chain [--quick] [--rounds N] [--new-tokens N] [--formats float16,int8,int4]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import sys

import numpy as np

from minillm.cuda.timing import decode_tok_s
from minillm.cuda.dev.sweep import decode_sweep_setup, sweep_parser
from minillm.cuda.dev.common import alternating_medians, finish, plain_table, require_gpu, verdict
from minillm.cuda.dev.model import greedy

FORMATS = ("float16", "int8", "int4")
# What a decode step launches, by kind: the GEMVs by their label, attention by its kernel's name.
KINDS = ("qkv", "attention", "o", "gate_up", "down", "lm_head")
LEFT_OUT = {"qkv": ("qkv",), "attention": ("attention",), "o": ("o",), "gate_up": ("gate_up",),
            "down": ("down",), "attention + o": ("attention", "o"), "every GEMV of a layer":
            ("qkv", "o", "gate_up", "down")}


def kind_of(name: str, label: str) -> str | None:
    """The KINDS entry a launch belongs to (None: embed, kv_append_int8, the head's norm, ...)."""
    if label in KINDS:
        return label
    return "attention" if name.startswith("attention") else None


def leaving_out(gpu, kinds: tuple[str, ...]):
    """A copy of gpu whose decode step skips every launch of `kinds` (prefill's launches carry no such label
    or name, so prompts still fill the cache). Its own Kernels object, so its graph is captured apart."""
    other = gpu.with_settings()
    launch = other.k._launch

    def maybe(name, grid, block, args, label="", shared_mem=0):
        if kind_of(name, label) not in kinds:
            launch(name, grid, block, args, label, shared_mem)
    other.k._launch = maybe
    return other


def median_tok_s(models: dict, cache, prompt, n_new: int, rounds: int) -> dict[str, float]:
    """Median decode tok/s of each model, in alternating rounds."""
    return alternating_medians(models, lambda m: decode_tok_s(m, cache, prompt, n_new)[0], rounds)


def parts(gpu, cache, prompt, n_new: int, rounds: int, fmt: str) -> list[list]:
    """What each kind adds to the step: (full step - step without it) / layers, in µs, beside the step."""
    models = {"full step": gpu} | {label: leaving_out(gpu, kinds) for label, kinds in LEFT_OUT.items()}
    tps = median_tok_s(models, cache, prompt, n_new, rounds)
    n_layers, full_us = gpu.config.n_layers, 1e6 / tps["full step"]
    rows = [[fmt, "full step", f"{tps['full step']:.1f}", f"{full_us:.0f}", "", ""]]
    for label in LEFT_OUT:
        us = 1e6 / tps[label]
        rows.append([fmt, f"without {label}", f"{tps[label]:.1f}", f"{us:.0f}", f"{(full_us - us) / n_layers:.1f}",
                     f"{100 * (full_us - us) / full_us:.0f}%"])
    return rows


def same_numbers(reference, other, prompt, label: str) -> None:
    """Two ways of running the same model give the same tokens and logits, exactly (a launch setting such as
    PDL changes when bytes arrive, never a number)."""
    runs = []
    for model in (reference, other):
        tokens, logits = greedy(model, prompt, 17, model.new_cache(len(prompt) + 24))
        runs.append((tokens, np.stack(logits)))
    diff = float(np.max(np.abs(runs[0][1] - runs[1][1])))
    verdict(label, runs[0][0] == runs[1][0] and diff == 0.0,
            f"tokens equal {runs[0][0] == runs[1][0]}, largest logit change {diff:g}")


def main(argv=None) -> int:
    ap = sweep_parser("chain", __doc__)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    if not require_gpu(ap.prog) or not set(formats) <= set(FORMATS):
        return 2
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    cfg, _, prompt = decode_sweep_setup(args.quick)
    part_rows = []
    for fmt in formats:
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=None if fmt == "float16" else fmt)
        cache = gpu.new_cache(len(prompt) + args.new_tokens + 8)
        part_rows += parts(gpu, cache, prompt, args.new_tokens, args.rounds, fmt)
        del gpu, cache
        cp.get_default_memory_pool().free_all_blocks()
    title = f"decode, batch 1, {args.new_tokens} new tokens, CUDA graph, median of {args.rounds} alternating rounds"
    plain_table(f"\n{title}: each kind left out", ["weights", "step", "tok/s", "µs a token",
                                                   "µs a layer it adds", "share of the step"], part_rows)
    return finish(ap.prog)


if __name__ == "__main__":
    sys.exit(main())
