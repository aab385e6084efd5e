"""The quantized decode GEMV v2 pipelined (gemv_quant.cu's _pipe kernels, KernelSettings.quant_pipeline)
against v2 as it is.

Why: a v2 warp loads a step of its row pair (8 int8 or 4 int4 chunks of each row a lane), waits for it,
multiplies it, and only then loads the next: its loads and its arithmetic take turns, and Mistral-7B's q|k|v,
o and down give each of the H200's ~2100 warps one pair, so little else runs meanwhile. The pipelined kernels
issue the next step's loads before this step's arithmetic (two steps of registers, so half the chunks a step):
one step is always in flight.

    checks    the _pipe kernels on the GPU against float64 NumPy: every epilogue (qmma's cases, U = 4 ones
              aside), odd widths, rows not a multiple of 2, Mistral-7B's four matrices
    timings   each Mistral-7B matrix as a plain GEMV, v2 vs pipelined (µs a launch in a CUDA graph, % of the
              copy roofline)
    decode    (--decode) tok/s of a random Mistral-7B, int8 and int4, v2 vs pipelined, with the CUDA graph

    python -m minillm.cuda.dev.qpipe [--no-timing] [--decode]
"""
from __future__ import annotations

import argparse
import sys

from minillm.cuda.dev import qmma

PIPE = {"quant_pipeline": True}
LABELS = [label for label in qmma.CASE_LABELS if "U=4" not in label]      # those are v3's own sub-steps


def check_case(k, label: str) -> tuple[float, float]:
    """The check named `label` (one of LABELS) on Kernels k, pipelined. -> (error, tolerance)"""
    return dict(qmma._cases())[label](k.with_settings(**PIPE))


def cases(k) -> list:
    """(label, check) pairs for dev.common.run_cases."""
    return [(f"pipe {label}", lambda label=label: check_case(k, label)) for label in LABELS]


def timings(group: int = 128) -> list[list]:
    """Each Mistral-7B matrix, int8 and int4, v2 vs pipelined as a plain GEMV (qmma.matrix_us)."""
    from minillm.cuda.dev.common import plain_table
    from minillm.cuda.dev.timing import copy_bandwidth
    from minillm.cuda.kernels import Kernels
    k = Kernels("float16")
    versions = {"v2": k, "pipe": k.with_settings(**PIPE)}
    bw = copy_bandwidth(1 << 30)
    table = []
    for method in ("int8", "int4"):
        for name, (rows, n_in) in qmma._mistral_shapes().items():
            us, nbytes = qmma.matrix_us(versions, method, rows, n_in, group)
            share = {v: nbytes / (t * 1e-6) / bw for v, t in us.items()}
            table.append([method, name, f"{rows}x{n_in}", f"{nbytes / 1e6:.1f}",
                          f"{us['v2']:.1f} ({share['v2']:.0%})", f"{us['pipe']:.1f} ({share['pipe']:.0%})",
                          f"{us['v2'] / us['pipe']:.2f}x"])
    plain_table(f"plain y = W·x, µs a launch in a CUDA graph (% of the {bw / 1e12:.2f} TB/s copy)",
                ["method", "matrix", "shape", "MB", "v2", "pipelined", "v2 / pipelined"], table)
    return table


def main(argv=None) -> int:
    from minillm.cuda.dev.common import finish, require_gpu, run_cases
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.qpipe", description=__doc__.split("\n")[0])
    ap.add_argument("--no-timing", action="store_true", help="checks only")
    ap.add_argument("--decode", action="store_true", help="also decode tok/s of a random Mistral-7B")
    args = ap.parse_args(argv)
    if not require_gpu("qpipe"):
        return 2
    run_cases(cases, dtypes=("float16",))
    if not args.no_timing:
        timings()
    if args.decode:
        qmma.decode(variants={"v2": {}, "pipelined": PIPE})
    return finish("qpipe")


if __name__ == "__main__":
    sys.exit(main())
