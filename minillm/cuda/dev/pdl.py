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

from minillm.cuda.dev.ab import decode_ab
from minillm.cuda.dev.sweep import sweep_parser
from minillm.cuda.dev.chain import same_numbers
from minillm.cuda.dev.common import finish, require_gpu

FORMATS = ("float16", "int8", "int4")


def check(gpu, models, prompt, fmt: str) -> None:
    """The decode step with PDL gives the same tokens and the same logits, exactly (fp16: both KV caches)."""
    same_numbers(models["off"], models["on"], prompt, f"pdl {fmt}")
    if fmt == "float16":
        int8_kv = gpu.with_options(kv_cache="int8")
        same_numbers(int8_kv.with_settings(pdl=False), int8_kv.with_settings(pdl=True), prompt,
                     "pdl float16, int8 KV cache")


def main(argv=None) -> int:
    ap = sweep_parser("pdl", __doc__, rounds=4)
    args = ap.parse_args(argv)
    if not require_gpu(ap.prog):
        return 2
    decode_ab(args, FORMATS, lambda gpu: {"off": gpu.with_settings(pdl=False), "on": gpu.with_settings(pdl=True)},
              check, header="PDL")
    return finish(ap.prog)


if __name__ == "__main__":
    sys.exit(main())
