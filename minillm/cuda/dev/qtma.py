"""The quantized decode GEMV v4 (dev/kernels/gemv_quant_tma.cu: weights streamed into shared memory by the TMA,
x in registers) against v2 (gemv_quant.cu).

    coverage(...)  no GPU: which thread computes which (row pair, chunk) under a TmaPlan, as the kernel's
                   producer and consumers index them; tests/test_qtma_plan.py checks that every pair's every
                   chunk is computed exactly once and every copy lands inside its stage
    checks         v4 on the GPU vs float64 NumPy on the same quantized weights: qmma.py's cases (every
                   epilogue, odd widths, Mistral-7B's matrices) and v4's own (each lanes-a-row, a partial last
                   stage, the widest rows v4 takes, and widths where it hands over to v2), fp16 and bf16
    timings        each Mistral-7B matrix as a plain GEMV, v2 vs v4 (and v4 with other splits), then fp16 through
                   gemv.cu v4 vs the 16-bit twin: µs a launch in a CUDA graph over enough copies that none stays
                   in L2, GB/s, % of copy
    decode         (--decode) tok/s of a random Mistral-7B, int8 and int4 v2 vs v4, fp16 gemv.cu v4 vs the twin,
                   with the CUDA graph

    python -m minillm.cuda.dev.qtma [--no-timing] [--decode]

Importing this module does not import CuPy.
"""
from __future__ import annotations

import argparse
import sys

SOURCE = "gemv_quant_tma"                          # dev/kernels/gemv_quant_tma.cu
KERNELS = {f"{e}{m}": f"gemv_{e}{m}_v4_{{sfx}}" for m in ("int8", "int4")
           for e in ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_", "qkv_", "rmsnorm_qkv_")}
KERNELS.update({f"{e}tma": f"gemv_{e}tma_{{sfx}}"                    # the 16-bit ones: gemv.cu v4's variants
                for e in ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_", "qkv_", "rmsnorm_qkv_")})


# ---- the kernel's indexing, in Python ------------------------------------------------------------------------
def coverage(plan, method: str, pairs: int, n_chunks: int, grid: int) -> dict:
    """Replay gemv_quant_tma.cu's indexing for one launch: the producer's copies (stage, offset, bytes) and the
    consumers' (pair, chunk) products. -> {"products": {(pair, chunk): times}, "copies_fit": bool,
    "epilogues": {pair: times}}"""
    from minillm.cuda.dev.lab import TMA_CHUNKS_A_THREAD, TMA_THREADS
    consumers, J = TMA_THREADS - 32, TMA_CHUNKS_A_THREAD[method]
    P, L = plan.pairs_a_stage, plan.lanes
    S = consumers // L
    tiles = -(-pairs // P)
    products, epilogues, fits = {}, {}, True
    for block in range(grid):
        for tile in range(block, tiles, grid):
            p0 = tile * P
            np_ = min(P, pairs - p0)
            # producer: lane q < 2 np copies row q of the stage to offset q · row_bytes (+ scales, mins)
            row_bytes = 16 * n_chunks
            last_end = (2 * np_ - 1) * row_bytes + row_bytes
            fits &= last_end <= 2 * P * row_bytes <= plan.stage_bytes
            for t in range(consumers):
                slot, c_t = t // L, t % L
                for j in range(slot, np_, S):
                    for u in range(J):
                        c = c_t + L * u
                        if c < n_chunks:
                            key = (p0 + j, c)
                            products[key] = products.get(key, 0) + 1
                if t < np_:
                    epilogues[p0 + t] = epilogues.get(p0 + t, 0) + 1
    return {"products": products, "copies_fit": fits, "epilogues": epilogues}


# ---- on the GPU ----------------------------------------------------------------------------------------------
def _v4_cases() -> list:
    """(label, check(k4)) of v4's own: shapes chosen for its lanes a row, stage sizes and hand-overs."""
    from minillm.cuda.dev.gemv import check_gemv, check_gemv_qkv, check_gemv_rmsnorm, check_gemv_swiglu
    from minillm.cuda.dev.qmma import check_large
    out = []
    for m in ("int8", "int4"):
        out += [
            (f"{m} 33x1024 (L 32/64, partial stage)", lambda k4, m=m: check_gemv(k4, 33, 1024, 4, quant=m)),
            (f"{m} g32 45x256", lambda k4, m=m: check_gemv(k4, 45, 256, 4, quant=m, group_size=32)),
            (f"{m} g64 301x2048 accumulate",
             lambda k4, m=m: check_gemv(k4, 301, 2048, 4, True, quant=m, group_size=64)),
            (f"{m} 1000x8192", lambda k4, m=m: check_gemv(k4, 1000, 8192, 4, quant=m, seed=5)),
            (f"{m} 130x16384 (widest v4)", lambda k4, m=m: check_gemv(k4, 130, 16384, 4, True, quant=m)),
            (f"{m} 66x16512 (v2 takes over)", lambda k4, m=m: check_gemv(k4, 66, 16512, 4, quant=m)),
            (f"{m} +rmsnorm 513x16384", lambda k4, m=m: check_gemv_rmsnorm(k4, 513, 16384, version=4, quant=m)),
            (f"{m} +rmsnorm+swiglu ffn 2000 in 4096",
             lambda k4, m=m: check_gemv_swiglu(k4, 2000, 4096, True, quant=m)),
            (f"{m} +rmsnorm+qkv+rope+kv 32+8x128 at 5000",
             lambda k4, m=m: check_gemv_qkv(k4, 32, 8, 128, 4096, 5000, 5100, True, quant=m)),
            (f"{m} qkv+rope+kv 16+4x64 in 2048",
             lambda k4, m=m: check_gemv_qkv(k4, 16, 4, 64, 2048, 3, 40, False, quant=m)),
            (f"{m} Mistral-7B down, 1 block an SM, 200 KB ring",
             lambda k4, m=m: check_large(k4.with_settings(quant_tma_blocks_per_sm=1, quant_tma_ring_bytes=200 << 10),
                                         m, 4096, 14336)),
        ]
    return out


def _wide_cases() -> list:
    """(label, check(kw)) of the 16-bit kernels (kw: Kernels with wide_tma on): gemv.py's v4 checks' shapes
    and Mistral-7B's widths."""
    from minillm.cuda.dev.gemv import check_gemv, check_gemv_qkv, check_gemv_rmsnorm, check_gemv_swiglu
    return [
        ("257x4096 accumulate", lambda kw: check_gemv(kw, 257, 4096, 4, True)),
        ("13x200 (L 32)", lambda kw: check_gemv(kw, 13, 200, 4)),
        ("1000x14336 (widest)", lambda kw: check_gemv(kw, 1000, 14336, 4, seed=2)),
        ("40x14344 (gemv.cu v4 takes over)", lambda kw: check_gemv(kw, 40, 14344, 4)),
        ("+rmsnorm 101x4096", lambda kw: check_gemv_rmsnorm(kw, 101, 4096, version=4)),
        ("+rmsnorm 7x14336", lambda kw: check_gemv_rmsnorm(kw, 7, 14336, version=4)),
        ("swiglu ffn 300 in 4096", lambda kw: check_gemv_swiglu(kw, 300, 4096, False)),
        ("+rmsnorm+swiglu ffn 1000 in 576", lambda kw: check_gemv_swiglu(kw, 1000, 576, True)),
        ("+rmsnorm+qkv+rope+kv 32+8x128", lambda kw: check_gemv_qkv(kw, 32, 8, 128, 4096, 4000, 4100, True)),
        ("qkv+rope+kv 9+3x64 in 576", lambda kw: check_gemv_qkv(kw, 9, 3, 64, 576, 17, 40, False)),
    ]


def cases(k) -> list:
    """(label, check) pairs for dev.common.run_cases: qmma.py's v3 cases (but its U=4 ones) and v4's own on the
    quantized kernels, then the 16-bit ones."""
    from minillm.cuda.dev.lab import as_lab
    return [(label, lambda check=check, s=s: check(as_lab(k).with_settings(**s))) for label, check, s in _listed()]


def _listed() -> list:
    """(label, check(k), settings) of every case: v4's on the quantized kernels, then the 16-bit ones."""
    from minillm.cuda.dev.qmma import _cases
    quant = [(label, check) for label, check in _cases() if "U=4" not in label] + _v4_cases()
    return ([(f"v4 {label}", check, {"quant_version": 4}) for label, check in quant]
            + [(f"tma 16-bit {label}", check, {"wide_tma": True}) for label, check in _wide_cases()])


def check_case(k, label: str) -> tuple[float, float]:
    """The check named `label` (one of CASE_LABELS) on Kernels k, under its settings. -> (error, tolerance)"""
    for name, check, settings in _listed():
        if name == label:
            from minillm.cuda.dev.lab import as_lab
            return check(as_lab(k).with_settings(**settings))
    raise KeyError(label)


VARIANTS = {"v2": {"quant_version": 2}, "v4": {"quant_version": 4},
            "v4 L 256": {"quant_version": 4, "quant_tma_lanes": 256},
            "v4 L 256, stages/12": {"quant_version": 4, "quant_tma_lanes": 256, "quant_tma_stage_share": 12}}


def timings(variants: dict | None = None, methods=("int8", "int4"), group: int = 128) -> list[list]:
    """Each Mistral-7B matrix in each of `methods` ("float16" too) as a plain GEMV under each variant
    ({label: settings}): µs, GB/s and % of the copy roofline (qmma.matrix_us: every variant on the same copies)."""
    from minillm.cuda.dev.common import plain_table
    from minillm.cuda.dev.qmma import _mistral_shapes, matrix_us
    from minillm.cuda.timing import copy_bandwidth
    from minillm.cuda.dev.lab import LabKernels
    variants = variants or VARIANTS
    k = LabKernels("float16")
    versions = {label: k.with_settings(**changes) for label, changes in variants.items()}
    bw = copy_bandwidth(1 << 30)
    table = []
    for method in methods:
        for name, (rows, n_in) in _mistral_shapes().items():
            us, nbytes = matrix_us(versions, method, rows, n_in, group)
            cells = []
            for label in variants:
                gbs = nbytes / (us[label] * 1e-6) / 1e9
                cells.append(f"{us[label]:.1f} ({gbs:.0f}, {gbs / (bw / 1e9):.0%})")
            table.append([method, name, f"{rows}x{n_in}", f"{nbytes / 1e6:.1f}"] + cells)
    plain_table(f"plain y = W·x, µs a launch in a CUDA graph (GB/s, % of the {bw / 1e12:.2f} TB/s copy roofline)",
                ["method", "matrix", "shape", "MB"] + list(variants), table)
    return table


# the 16-bit kernels: gemv.cu v4 against gemv_quant_tma.cu's Wide16Tma
WIDE_VARIANTS = {"gemv.cu v4": {}, "tma": {"wide_tma": True},
                 "tma L 256": {"wide_tma": True, "quant_tma_lanes": 256},
                 "tma L 256, stages/12": {"wide_tma": True, "quant_tma_lanes": 256, "quant_tma_stage_share": 12}}


def main(argv=None) -> int:
    from minillm.cuda.dev.common import finish, require_gpu, run_cases
    from minillm.cuda.dev.qmma import decode
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.qtma", description=__doc__.split("\n")[0])
    ap.add_argument("--no-timing", action="store_true", help="checks only")
    ap.add_argument("--decode", action="store_true", help="also decode tok/s of a random Mistral-7B, v2 vs v4")
    args = ap.parse_args(argv)
    if not require_gpu("qtma"):
        return 2
    run_cases(cases)
    if not args.no_timing:
        timings()
        timings(WIDE_VARIANTS, ("float16",))
    if args.decode:
        decode(variants={"v2": {}, "v4": {"quant_version": 4}})
        decode(variants={"gemv.cu v4": {}, "tma": {"wide_tma": True}}, methods=("float16",))
    return finish("qtma")


if __name__ == "__main__":
    sys.exit(main())


CASE_LABELS = [label for label, _, _ in _listed()]   # computed without a GPU (the checks import CuPy when run)
