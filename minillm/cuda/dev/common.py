"""What every dev module shares: tolerances, the error measure, poisoned outputs, random weights, and
the small check-runner that prints PASS/FAIL lines (the selfcheck driver and each family's `main`).

Each `check_*` in the family modules runs on random inputs (never zeros), poisons outputs with NaN first
(an element a kernel forgets to write shows up as NaN), and returns (error, tolerance): the largest
absolute difference relative to the reference's largest magnitude, and what is accepted.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from minillm.backend import as_f32, to_dtype
from minillm.cuda.kernels import Kernels
from minillm.cuda.qweights import QuantMatrix
# the PASS/FAIL lines, the error measure and the GPU probe are production's (the selfcheck's), shared here
from minillm.cuda.selfcheck import FAILED, SHORT, finish, guarded, rel_err, require_gpu, say, verdict  # noqa: F401
from minillm.model.quantized import quantize

# Issue 24's decode tok/s targets at the Mistral-7B shape, batch 1, for an H200 (dev.qbench, qmma and qfloor print
# them beside what they measure; the current figures: minillm/data/current_figures.json).
TARGETS = {"float16": 270, "int8": 430, "int4": 650}
TARGETS_GPU = "H200"


def against_target(tok_s: float, target: int, gpu: str) -> str:
    """'missed: -8% against 270 tok/s' (or met), or, measured on another card than the targets', why not."""
    if TARGETS_GPU not in gpu:
        return f"no verdict: the targets are for an {TARGETS_GPU}, this is an {gpu} (compare same-run ratios)"
    gap = tok_s / target - 1
    return f"{'met' if gap >= 0 else 'missed'}: {100 * gap:+.0f}% against {target} tok/s"


def narrow(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> host 16-bit storage (float16, or bf16 bits as uint16), as the GPU holds it."""
    return to_dtype(np.asarray(a, np.float32), dtype)


# Relative tolerances: fp16 keeps 11 significant bits, bf16 8; fp32 paths are far tighter.
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
F32_TOL = 1e-5


# Quantized GEMVs (gemv_quant.cu v2) multiply codes and x in fp16 within each 16-byte chunk, then widen:
# ~1e-3 of the largest output at worst, 10-100x below what quantizing the weights moved it already.
QUANT_TOL = 3e-3


def gemv_tol(n_in: int, quant: str | None) -> float:
    """Same weights on both sides: fp32 summation order only, or the quantized kernels' fp16 products."""
    return QUANT_TOL if quant is not None else F32_TOL * math.sqrt(n_in)


def _cp():
    import cupy
    return cupy


def poisoned(shape, dtype):
    """A device array filled with NaN (fp16/fp32) or the bf16 NaN pattern 0x7FC0 (uint16)."""
    cp = _cp()
    if np.dtype(dtype) == np.uint16:
        return cp.full(shape, 0x7FC0, dtype=cp.uint16)
    return cp.full(shape, np.nan, dtype=dtype)


def _host(a) -> np.ndarray:
    """Device array -> host fp32 (16-bit storage widened)."""
    return as_f32(_cp().asnumpy(a))


def _sync():
    _cp().cuda.Device().synchronize()


def weights(k: Kernels, rows: int, n_in: int, rng, quant: str | None = None, group_size: int = 128):
    """Random W [rows, in] (variance 1/in) as the GPU holds it, and the fp32 reference it stands for:
    16-bit (the weight dtype), or int8/int4 quantized by minillm.model.quant and uploaded as is.
    -> (reference fp32 [rows, in] on the host, device matrix)"""
    w = rng.standard_normal((rows, n_in)) / math.sqrt(n_in)
    if quant is None:
        w = narrow(w, k.dtype)
        return as_f32(w), _cp().asarray(w)
    q = quantize(w.astype(np.float32), quant, group_size)
    return q.dequantize(), QuantMatrix.upload([q])


def _narrow_dt(dtype: str):
    return np.float16 if dtype == "float16" else np.uint16


def run_cases(make_cases: Callable[[Kernels], list], dtypes=("float16", "bfloat16"), quick: bool = False) -> None:
    """Every (label, check) of make_cases(Kernels(dtype)) for each dtype, one PASS/FAIL line each
    (quick: every other case)."""
    for dtype in dtypes:
        k = Kernels(dtype)
        listed = make_cases(k)
        for name, run in listed[::2] if quick else listed:
            label = f"{SHORT[dtype]} {name}"

            def one(run=run, label=label):
                err, tol = run()
                verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
            guarded(label, one)


def alternating_medians(variants: dict, measure: Callable, rounds: int) -> dict:
    """{label: median of measure(variant)} over `rounds` rounds, the variants' order reversed every other round:
    the machines drift, so each variant sees the same drift (the same-run A/B every dev sweep reports)."""
    seen: dict = {label: [] for label in variants}
    order = list(variants)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            seen[label].append(measure(variants[label]))
    return {label: float(np.median(values)) for label, values in seen.items()}


def plain_table(title: str, headers, rows) -> None:
    """title, then headers and rows in columns as wide as their widest cell."""
    cells = [[str(c) for c in row] for row in [headers] + list(rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    say(f"\n{title}")
    for r in cells[:1] + [["-" * w for w in widths]] + cells[1:]:
        say("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def report_checks(results: list[tuple[str, float, float]], most: int | None = None) -> bool:
    """Print a FAIL line per failed (name, error, tolerance) check (the first `most`), then how many passed
    and the largest error. -> whether all passed."""
    failed = [(name, err, tol) for name, err, tol in results if not err <= tol]
    for name, err, tol in failed[:most]:
        print(f"FAIL {name}: error {err:.3e} > {tol:.1e}")
    print(f"{len(results) - len(failed)} of {len(results)} checks passed "
          f"(largest error {max(e for _, e, _ in results):.2e})")
    return not failed
