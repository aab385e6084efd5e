"""Programmatic dependent launch in the decode graph (minillm/cuda/pdl.py, KernelSettings.pdl), measured.

    check   for each weight format (fp16, int8, int4) and both KV caches: greedy tokens and logits of the
            decode step with PDL equal those without it, bit for bit (the same kernels and arithmetic; only
            when each kernel may start changes)
    time    decode tok/s with and without PDL in alternating rounds (the machine drifts), GB/s and % of
            the copy roofline, on the Mistral-7B shape

    python -m minillm.cuda.dev.pdl [--quick] [--rounds N]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import sys

from minillm.cuda.dev.bench import decode_bytes, decode_sweep_setup, decode_tok_s, sweep_parser
from minillm.cuda.dev.chain import same_numbers
from minillm.cuda.dev.common import alternating_medians, finish, plain_table, require_gpu

FORMATS = ("float16", "int8", "int4")


def check(gpu, prompt, label: str) -> None:
    """The decode step with PDL gives the same tokens and the same logits, exactly."""
    same_numbers(gpu.with_settings(pdl=False), gpu.with_settings(pdl=True), prompt, f"pdl {label}")


def timed(gpu, prompt, n_new: int, rounds: int) -> dict[bool, float]:
    """Median decode tok/s without and with PDL, their rounds alternating."""
    models = {pdl: gpu.with_settings(pdl=pdl) for pdl in (False, True)}
    cache = gpu.new_cache(len(prompt) + n_new + 8)
    return alternating_medians(models, lambda model: decode_tok_s(model, cache, prompt, n_new)[0], rounds)


def main(argv=None) -> int:
    ap = sweep_parser("pdl", __doc__, rounds=4)
    args = ap.parse_args(argv)
    if not require_gpu(ap.prog):
        return 2
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    cfg, bw, prompt = decode_sweep_setup(args.quick)
    rows = []
    for fmt in FORMATS:
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=None if fmt == "float16" else fmt)
        check(gpu, prompt, fmt)
        if fmt == "float16":
            check(gpu.with_options(kv_cache="int8"), prompt, "float16, int8 KV cache")
        tps = timed(gpu, prompt, args.new_tokens, args.rounds)
        per_token, _ = decode_bytes(cfg, gpu.weight_bytes, len(prompt), args.new_tokens)
        for pdl in (False, True):
            rows.append([fmt, "on" if pdl else "off", f"{tps[pdl]:.1f}", f"{per_token * tps[pdl] / 1e9:.0f}",
                         f"{100 * per_token * tps[pdl] / bw:.0f}%", f"{tps[pdl] / tps[False]:.3f}x"])
        del gpu
        cp.get_default_memory_pool().free_all_blocks()
    plain_table(f"\ndecode, batch 1, {args.new_tokens} new tokens, CUDA graph, median of {args.rounds} alternating "
                "rounds", ["weights", "PDL", "tok/s", "GB/s", "% of copy", "vs off"], rows)
    return finish(ap.prog)


if __name__ == "__main__":
    sys.exit(main())
