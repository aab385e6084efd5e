"""One change of the settings (a shipped KernelSettings tuning or a lab.LabSettings choice) against the defaults,
in the decode step: the same numbers, then which is faster.

    check   for each weight format asked: greedy tokens and logits with the change equal the defaults', bit
            for bit (a change of build, grid or timing, not of arithmetic; --no-check for one that rounds otherwise)
    time    decode tok/s of both in alternating rounds (the machine drifts), GB/s and % of the copy roofline,
            on the Mistral-7B shape

    python -m minillm.cuda.dev.ab --set 'qkv_one_round=False' [--formats float16,int8] [--quick]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import ast
import sys
from typing import Callable

from minillm.cuda.timing import decode_bytes, decode_tok_s
from minillm.cuda.dev.sweep import decode_sweep_setup, sweep_parser
from minillm.cuda.dev.chain import same_numbers
from minillm.cuda.dev.common import alternating_medians, finish, plain_table, require_gpu

FORMATS = ("float16", "int8", "int4")


def parse_change(text: str) -> dict:
    """'NAME=VALUE' (VALUE a Python literal) -> {NAME: VALUE}, NAME a LabSettings field (the shipped tunings and
    the lab's choices)."""
    from minillm.cuda.dev.lab import lab_fields
    name, sep, value = text.partition("=")
    names = lab_fields()
    if not sep or name.strip() not in names:
        raise ValueError(f"--set NAME=VALUE with NAME one of LabSettings' fields ({', '.join(names)}), not {text!r}")
    try:
        return {name.strip(): ast.literal_eval(value.strip())}
    except (ValueError, SyntaxError):
        raise ValueError(f"--set {name.strip()}: {value.strip()!r} is not a Python literal") from None


def decode_ab(args, formats, variants: Callable, check: Callable | None = None, header: str = "settings") -> None:
    """For each weight format, a random model of the sweep's shape (args: sweep_parser's options) run as each of
    variants(gpu) = {label: model}, the first the baseline: check(gpu, models, prompt, fmt) first, then decode
    tok/s in alternating rounds, printed beside GB/s, % of copy and the ratio to the baseline."""
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    cfg, bw, prompt = decode_sweep_setup(args.quick)
    rows, base = [], None
    for fmt in formats:
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=None if fmt == "float16" else fmt)
        models = variants(gpu)
        base = next(iter(models))
        if check is not None:
            check(gpu, models, prompt, fmt)
        cache = gpu.new_cache(len(prompt) + args.new_tokens + 8)
        tps = alternating_medians(models, lambda model: decode_tok_s(model, cache, prompt, args.new_tokens)[0],
                                  args.rounds)
        per_token, _ = decode_bytes(cfg, gpu.weight_bytes, len(prompt), args.new_tokens)
        for label in models:
            rows.append([fmt, label, f"{tps[label]:.1f}", f"{per_token * tps[label] / 1e9:.0f}",
                         f"{100 * per_token * tps[label] / bw:.0f}%", f"{tps[label] / tps[base]:.3f}x"])
        del gpu, models
        cp.get_default_memory_pool().free_all_blocks()
    plain_table(f"\ndecode, batch 1, {args.new_tokens} new tokens, CUDA graph, median of {args.rounds} alternating "
                "rounds", ["weights", header, "tok/s", "GB/s", "% of copy", f"vs {base}"], rows)


def main(argv=None) -> int:
    ap = sweep_parser("ab", __doc__, rounds=5)
    ap.add_argument("--set", dest="change", required=True, help="NAME=VALUE: the LabSettings field to change")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: float16, int8, int4")
    ap.add_argument("--no-check", action="store_true", help="time only (a change that rounds otherwise)")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",")]
    try:
        change = parse_change(args.change)
        if not set(formats) <= set(FORMATS):
            raise ValueError(f"--formats: {', '.join(sorted(set(formats) - set(FORMATS)))} (there are: {', '.join(FORMATS)})")
    except ValueError as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2
    if not require_gpu(ap.prog):
        return 2

    def check(gpu, models, prompt, fmt):
        same_numbers(*models.values(), prompt, f"{args.change} {fmt}")
    from minillm.cuda.dev.lab import LabTransformer
    decode_ab(args, formats, lambda gpu: {"defaults": gpu, args.change: LabTransformer.of(gpu, **change)},
              None if args.no_check else check)
    return finish(ap.prog)


if __name__ == "__main__":
    sys.exit(main())
