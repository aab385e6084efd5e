"""The quantized decode GEMV v2 with each row pair's k range split between two warps (gemv_quant.cu's _ks2
kernels, KernelSettings.quant_ksplit = 2) against v2 as it is.

Why: v2 gives a warp a row pair, 8 (int8) or 4 (int4) 16-byte chunks of each row in flight a lane: ~100-114
registers a thread, so 2 blocks (16 warps) fit an SM, and Mistral-7B's q|k|v, o and down have only 2048-3072
pairs for the ~2100 warps of the H200, one round each, whose loads and arithmetic take turns. The k-split
gives each warp half of a pair's columns with half of the chunks in flight (<= 64 registers), so 4 blocks
(32 warps) fit an SM: the same bytes in flight, twice the warps to hide one another's latency.

    checks    the _ks2 kernels on the GPU against float64 NumPy: every epilogue (qmma's cases, U = 4 ones
              aside), odd widths, rows not a multiple of 2, Mistral-7B's four matrices
    timings   each Mistral-7B matrix as a plain GEMV: v2, k-split at 4 and 3 blocks an SM (µs a launch in a
              CUDA graph, GB/s, % of the copy roofline)
    decode    (--decode) tok/s of a random Mistral-7B, int8 and int4, v2 vs the k-split, with the CUDA graph

    python -m minillm.cuda.dev.qsplit [--no-timing] [--decode]
"""
from __future__ import annotations

import argparse
import sys

from minillm.cuda.dev import qmma

KS2 = {"quant_ksplit": 2}
LABELS = [label for label in qmma.CASE_LABELS if "U=4" not in label]      # those are v3's own sub-steps


def check_case(k, label: str) -> tuple[float, float]:
    """The check named `label` (one of LABELS) on Kernels k with the k-split. -> (error, tolerance)"""
    return dict(qmma._cases())[label](k.with_settings(**KS2))


def cases(k) -> list:
    """(label, check) pairs for dev.common.run_cases."""
    return [(f"ks2 {label}", lambda label=label: check_case(k, label)) for label in LABELS]


def timings(group: int = 128) -> list[list]:
    """Each Mistral-7B matrix, int8 and int4, v2 vs the k-split as a plain GEMV (qmma.matrix_us)."""
    from minillm.cuda.dev.common import plain_table
    from minillm.cuda.dev.timing import copy_bandwidth
    from minillm.cuda.kernels import Kernels
    k = Kernels("float16")
    versions = {"v2": k, "ks2": k.with_settings(**KS2),
                "ks2 3/SM": k.with_settings(**KS2, quant_ks2_blocks_per_sm=3)}
    bw = copy_bandwidth(1 << 30)
    table = []
    for method in ("int8", "int4"):
        for name, (rows, n_in) in qmma._mistral_shapes().items():
            us, nbytes = qmma.matrix_us(versions, method, rows, n_in, group)
            share = {v: nbytes / (t * 1e-6) / bw for v, t in us.items()}
            table.append([method, name, f"{rows}x{n_in}", f"{nbytes / 1e6:.1f}",
                          f"{us['v2']:.1f} ({share['v2']:.0%})", f"{us['ks2']:.1f} ({share['ks2']:.0%})",
                          f"{us['ks2 3/SM']:.1f} ({share['ks2 3/SM']:.0%})", f"{us['v2'] / us['ks2']:.2f}x"])
    plain_table(f"plain y = W·x, µs a launch in a CUDA graph (% of the {bw / 1e12:.2f} TB/s copy)",
                ["method", "matrix", "shape", "MB", "v2", "k-split, 4 blocks/SM", "k-split, 3 blocks/SM",
                 "v2 / k-split"], table)
    return table


def main(argv=None) -> int:
    from minillm.cuda.dev.common import finish, require_gpu, run_cases
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.qsplit", description=__doc__.split("\n")[0])
    ap.add_argument("--no-timing", action="store_true", help="checks only")
    ap.add_argument("--decode", action="store_true", help="also decode tok/s of a random Mistral-7B")
    args = ap.parse_args(argv)
    if not require_gpu("qsplit"):
        return 2
    run_cases(cases, dtypes=("float16",))
    if not args.no_timing:
        timings()
    if args.decode:
        qmma.decode(variants={"v2": {}, "k-split": KS2, "k-split 3/SM": dict(KS2, quant_ks2_blocks_per_sm=3)})
    return finish("qsplit")


if __name__ == "__main__":
    sys.exit(main())
