"""GEMV, the decode step's whole cost: kernels/gemv.cu (v4 with its fused prologues/epilogues; the first
versions v1, v2, v3 (fused norm) in dev/kernels/gemv_versions.cu, through lab.py) and kernels/gemv_quant.cu
(int8/int4, dequantized in registers; prefill's dequantize).

Checks against float64 NumPy (W·x on the same 16-bit or quantized weights); the sweep times each layer
matrix of a shape alone in each weight format inside a CUDA graph (`gemv_points`, lesson 14's roofline
plot) and the quantized v1 against v2 (`quant_versions_us`). `python -m minillm.cuda.dev.gemv` runs both
at the Mistral-7B shape.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from minillm.backend import as_f32
from minillm.cuda.dev.common import (QUANT_TOL, TOL, _cp, _host, _narrow_dt, _sync, finish, gemv_tol, narrow, poisoned,
                                     rel_err, require_gpu, run_cases, say, weights)
from minillm.cuda.dev.lab import LabKernels
from minillm.cuda.timing import graph_us
from minillm.cuda.kernels import Kernels
from minillm.model.config import PRESETS, ModelConfig
from minillm.model.layers import apply_rope, rmsnorm, rope_inv_freq, rope_tables, silu


def at_version(k: Kernels, version: int) -> tuple[Kernels, dict]:
    """(kernels, keyword) launching 16-bit GEMV `version`: k itself for the shipped v4, else the lab's kernels
    around k (dev/kernels/gemv_versions.cu) with version=..."""
    if version >= 4:
        return k, {}
    return (k if isinstance(k, LabKernels) else LabKernels.of(k)), {"version": version}


def check_gemv(k: Kernels, rows: int, n_in: int, version: int, accumulate: bool = False, seed: int = 0,
               quant: str | None = None, group_size: int = 128):
    cp, rng = _cp(), np.random.default_rng(seed)
    w, dw = weights(k, rows, n_in, rng, quant, group_size)
    x = rng.standard_normal(n_in).astype(np.float32)
    y0 = rng.standard_normal(rows).astype(np.float32)
    y = cp.asarray(y0) if accumulate else poisoned(rows, np.float32)
    lk, which = at_version(k, version)
    lk.gemv(dw, cp.asarray(x), y, accumulate=accumulate, **which)
    _sync()
    want = w.astype(np.float64) @ x.astype(np.float64) + (y0 if accumulate else 0)
    return rel_err(_host(y), want), gemv_tol(n_in, quant)


def check_gemv_rmsnorm(k: Kernels, rows: int, n_in: int, seed: int = 0, version: int = 3,
                       quant: str | None = None, group_size: int = 128):
    cp, rng = _cp(), np.random.default_rng(seed)
    w, dw = weights(k, rows, n_in, rng, quant, group_size)
    x = (rng.standard_normal(n_in) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    y = poisoned(rows, np.float32)
    lk, which = at_version(k, version)
    lk.gemv_rmsnorm(dw, cp.asarray(x), cp.asarray(g), 1e-5, y, **which)
    _sync()
    want = w.astype(np.float64) @ rmsnorm(x[None], g, 1e-5)[0].astype(np.float64)
    return rel_err(_host(y), want), gemv_tol(n_in, quant)


def check_gemv_swiglu(k: Kernels, ffn: int, n_in: int, norm: bool, seed: int = 0,
                      quant: str | None = None, group_size: int = 128):
    """v4 gate/up GEMV with SwiGLU in the epilogue (and the RMSNorm in the prologue when `norm`)."""
    cp, rng = _cp(), np.random.default_rng(seed)
    w, dw = weights(k, 2 * ffn, n_in, rng, quant, group_size)
    x = (rng.standard_normal(n_in) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    out = poisoned(ffn, np.float32)
    k.gemv_swiglu(dw, cp.asarray(x), cp.asarray(g) if norm else None, 1e-5, out)
    _sync()
    h = rmsnorm(x[None], g, 1e-5)[0] if norm else x
    gu = w.astype(np.float64) @ h.astype(np.float64)
    want = silu(gu[:ffn]) * gu[ffn:]
    if quant is not None:   # errors of gate and up reach the product scaled by the other's size, not by it
        return float(np.abs(_host(out) - want).max() / (np.abs(gu[:ffn]).max() * np.abs(gu[ffn:]).max())), QUANT_TOL
    return rel_err(_host(out), want), gemv_tol(n_in, quant)


def check_gemv_qkv(k: Kernels, n_heads: int, n_kv: int, hd: int, n_in: int, pos0: int, capacity: int,
                   norm: bool, seed: int = 0, quant: str | None = None, group_size: int = 128):
    """v4 q|k|v GEMV with RoPE and the KV-cache append in the epilogue (and the RMSNorm when `norm`):
    the rotated row against NumPy, and the cache (every other slot untouched) against the narrowed k, v."""
    cp, rng = _cp(), np.random.default_rng(seed)
    width = (n_heads + 2 * n_kv) * hd
    w, dw = weights(k, width, n_in, rng, quant, group_size)
    x = (rng.standard_normal(n_in) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    inv_freq = rope_inv_freq(hd, 10000.0)
    old = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    kc, vc = cp.asarray(old), cp.asarray(old)
    y = poisoned(width, np.float32)
    k.gemv_qkv(dw, cp.asarray(x), cp.asarray(g) if norm else None, 1e-5, y,
               cp.asarray(np.array([pos0], np.int32)), cp.asarray(inv_freq), kc, vc, n_heads, n_kv, hd)
    _sync()
    h = rmsnorm(x[None], g, 1e-5)[0] if norm else x
    qkv = (w.astype(np.float64) @ h.astype(np.float64)).astype(np.float32)
    cos, sin = rope_tables(np.arange(pos0, pos0 + 1), inv_freq)
    n_rot = n_heads + n_kv
    rotated = apply_rope(qkv[None, :n_rot * hd].reshape(1, n_rot, hd), cos, sin).reshape(-1)
    want = np.concatenate([rotated, qkv[n_rot * hd:]])
    err = rel_err(_host(y), want)
    tol = gemv_tol(n_in, quant) + 1e-5 * max(1, pos0) ** 0.5
    want_k, want_v = as_f32(old).copy(), as_f32(old).copy()
    if pos0 < capacity:
        new = want.reshape(n_heads + 2 * n_kv, hd)
        want_k[:, pos0] = as_f32(narrow(new[n_heads:n_rot], k.dtype))
        want_v[:, pos0] = as_f32(narrow(new[n_rot:], k.dtype))
    # the cache holds 16-bit roundings of values equal to ~1e-6: one rounding step may differ
    cache_err = max(rel_err(_host(kc), want_k), rel_err(_host(vc), want_v))
    return max(err, cache_err * tol / TOL[k.dtype]), tol


def check_dequantize(k: Kernels, method: str, rows: int, n_in: int, group_size: int = 128, seed: int = 0):
    """The prefill widening (gemv_quant.cu dequant_*) against minillm.model.quant's fp32 dequantization: every
    element within one rounding to the weight dtype (q·s + m may be one fused multiply-add on the GPU)."""
    rng = np.random.default_rng(seed)
    w, dw = weights(k, rows, n_in, rng, method, group_size)
    out = poisoned((rows, n_in), _narrow_dt(k.dtype))
    k.dequantize(dw, out)
    _sync()
    return rel_err(_host(out), w), TOL[k.dtype]


def cases(k: Kernels) -> list[tuple[str, Callable]]:
    """16-bit and quantized GEMVs, with their fused variants:
    (label, check) pairs for the selfcheck; each check -> (error, tolerance)."""
    return [
            ("gemv v1 4096x1024", lambda: check_gemv(k, 4096, 1024, 1)),
            ("gemv v2 257x4096 accumulate", lambda: check_gemv(k, 257, 4096, 2, True)),
            ("gemv v2 64x14336", lambda: check_gemv(k, 64, 14336, 2)),
            ("gemv+rmsnorm v3 100x4096", lambda: check_gemv_rmsnorm(k, 100, 4096)),
            ("gemv+rmsnorm v3 13x576", lambda: check_gemv_rmsnorm(k, 13, 576)),
            ("gemv v4 6144x4096", lambda: check_gemv(k, 6144, 4096, 4)),
            ("gemv v4 257x4096 accumulate", lambda: check_gemv(k, 257, 4096, 4, True)),
            ("gemv v4 64x14336 accumulate", lambda: check_gemv(k, 64, 14336, 4, True)),
            ("gemv v4 13x136 (ragged)", lambda: check_gemv(k, 13, 136, 4)),
            ("gemv+rmsnorm v4 101x4096", lambda: check_gemv_rmsnorm(k, 101, 4096, version=4)),
            ("gemv+rmsnorm v4 13x576", lambda: check_gemv_rmsnorm(k, 13, 576, version=4)),
            ("gemv+rmsnorm v4 7x14336", lambda: check_gemv_rmsnorm(k, 7, 14336, version=4)),
            ("gemv+swiglu v4 ffn 300 in 4096", lambda: check_gemv_swiglu(k, 300, 4096, False)),
            ("gemv+rmsnorm+swiglu v4 ffn 1000 in 576", lambda: check_gemv_swiglu(k, 1000, 576, True)),
            ("gemv+rmsnorm+qkv+rope+kv v4 32+8x128", lambda: check_gemv_qkv(k, 32, 8, 128, 4096, 4000, 4100, True)),
            ("gemv+qkv+rope+kv v4 9+3x64 in 576", lambda: check_gemv_qkv(k, 9, 3, 64, 576, 17, 40, False)),
            ("gemv+rmsnorm+qkv+rope+kv v4 MQA hd 256", lambda: check_gemv_qkv(k, 4, 1, 256, 264, 0, 5, True)),
            ("gemv+rmsnorm+qkv+rope+kv v4 hd 16 pos 39", lambda: check_gemv_qkv(k, 4, 4, 16, 64, 39, 40, True)),
            ("gemv int8 257x4096 accumulate", lambda: check_gemv(k, 257, 4096, 4, True, quant="int8")),
            ("gemv int4 g128 64x14336", lambda: check_gemv(k, 64, 14336, 4, quant="int4")),
            ("gemv int4 g128 13x200 (padded group)", lambda: check_gemv(k, 13, 200, 4, quant="int4")),
            ("gemv+rmsnorm+swiglu int8 ffn 300 in 4096", lambda: check_gemv_swiglu(k, 300, 4096, True, quant="int8")),
            ("gemv+rmsnorm+swiglu int4 ffn 1000 in 576", lambda: check_gemv_swiglu(k, 1000, 576, True, quant="int4")),
            ("gemv+rmsnorm+qkv+rope+kv int8 32+8x128", lambda: check_gemv_qkv(k, 32, 8, 128, 4096, 4000, 4100, True, quant="int8")),
            ("gemv+rmsnorm+qkv+rope+kv int4 9+3x64", lambda: check_gemv_qkv(k, 9, 3, 64, 576, 17, 40, True, quant="int4")),
            ("dequantize int4 g32 512x4096", lambda: check_dequantize(k, "int4", 512, 4096, 32)),
    ]


# ---- the sweep ------------------------------------------------------------------------------------
def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The four matrices of a layer as the decode step multiplies them (q|k|v and gate|up stacked)."""
    hd = cfg.head_dim
    return {"qkv": ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim), "o": (cfg.dim, cfg.n_heads * hd),
            "gate_up": (2 * cfg.ffn_dim, cfg.dim), "down": (cfg.dim, cfg.ffn_dim)}


def gemv_points(cfg: ModelConfig, formats=("float16", "int8", "int4"), group_size: int = 128,
                settings: dict | None = None):
    """Each layer matrix of `cfg` alone, in each weight format: [(format, matrix, shape, bytes, µs)].
    Plain GEMV (y = W·x, no fusion), timed inside a CUDA graph over enough copies of the matrix (random,
    made on the device) that none is still in L2 when its turn comes again. `settings`: LabSettings
    changes (e.g. the TMA-streamed kernels: quant_version=4, wide_tma=True; none: the shipped kernels)."""
    import cupy as cp
    from minillm.cuda.qweights import QuantMatrix
    k = LabKernels("float16").with_settings(**settings) if settings else Kernels("float16")
    points = []
    for fmt in formats:
        for name, (rows, cols) in matrix_shapes(cfg).items():
            def one(seed):
                if fmt != "float16":
                    return QuantMatrix.random(fmt, rows, cols, k, group_size, seed=seed)
                w = cp.empty((rows, cols), cp.float16)
                k.fill_uniform(w, seed, (3.0 / cols) ** 0.5)
                return w
            first = one(7)
            copies = [first] + [one(8 + j) for j in range(min(15, -(-(160 << 20) // first.nbytes)))]
            x = cp.asarray(np.random.default_rng(0).standard_normal(cols).astype(np.float32))
            y = cp.empty(rows, cp.float32)
            us = graph_us(lambda i: k.gemv(copies[i % len(copies)], x, y), 2 * len(copies))
            points.append((fmt, name, (rows, cols), int(first.nbytes), us))
    return points


def quant_versions_us(gpu) -> dict:
    """Each quantized layer matrix as a plain GEMV (y = W·x), v1 (fp32 x) against v2 (fp16 x, HFMA2), µs a
    launch in a CUDA graph over all layers in turn. -> {(matrix, version): µs}"""
    import cupy as cp
    k, n = LabKernels.of(gpu.k), len(gpu.layers)
    out = {}
    for name, attr in (("qkv", "wqkv"), ("o", "wo"), ("gate_up", "w_gate_up"), ("down", "w_down")):
        w0 = getattr(gpu.layers[0], attr)
        rows, cols = w0.shape
        x = cp.asarray(np.random.default_rng(0).standard_normal(cols).astype(np.float32))
        y = cp.empty(rows, cp.float32)
        for v in (1, 2):
            kv = k.with_settings(quant_version=v)
            out[name, v] = graph_us(lambda i: kv.gemv(getattr(gpu.layers[i], attr), x, y), n)
    return out


def print_points(points) -> None:
    """The sweep's table: µs per GEMV and the bytes it streamed per second."""
    say(f"  {'format':<8} {'matrix':<8} {'shape':>13} {'MB':>7} {'µs':>7} {'TB/s':>6}")
    for fmt, name, shape, nbytes, us in points:
        say(f"  {fmt:<8} {name:<8} {str(shape):>13} {nbytes / 1e6:7.1f} {us:7.1f} {nbytes / us / 1e6:6.2f}")


def main(argv=None) -> int:
    """`python -m minillm.cuda.dev.gemv`: every check of this family in fp16 and bf16, then
    each Mistral-7B matrix alone in fp16, int8 and int4."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.gemv", description=__doc__.split("\n")[0])
    ap.add_argument("--no-sweep", action="store_true", help="checks only")
    args = ap.parse_args(argv)
    if not require_gpu("gemv"):
        return 2
    run_cases(cases)
    if not args.no_sweep:
        print_points(gemv_points(PRESETS["mistral-7b"].config))
    return finish("gemv")


if __name__ == "__main__":
    sys.exit(main())
