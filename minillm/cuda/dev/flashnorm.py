"""FlashNorm on the GPU: the deferred RMSNorm on two CUDA streams with an explicit join, and fused.

With the norm gains folded into the weights (minillm/model/flashnorm.py, Prop. 1), RMSNorm + projection is
(x · W*ᵀ) · 1/RMS(x) (Prop. 2): two independent pieces of work and one scale per row. Three ways to run it:

  unfused     rmsnorm kernel, then the projection reads the normalized x (what gpu_model.py's prefill does)
  two-stream  the projection on one stream, 1/RMS on another, each recording an event; the scaling kernel
              runs on the caller's stream after waiting on BOTH events (cudaStreamWaitEvent through CuPy's
              Stream.wait_event). That wait is the join, and it must be explicit: a stream orders only its
              own work, so a scale that waits on the RMS stream alone reads whatever the projection's output
              buffer held before (lesson 15 shows the model that then talks one step late).
  fused       kernels/flashnorm_gemv.cu: one GEMV that sums x² from the registers that feed the dot product
              and scales in its epilogue (decode shape; why no GEMM variant: see the .cu header).

`FlashNormGPUTransformer` is GPUTransformer with its LM head on the two-stream path (lesson 15, tests).
`python -m minillm.cuda.dev.flashnorm [--quick]` times the three per layer (norm -> qkv and norm -> gate/up)
at SmolLM2 and Mistral-7B shapes, decode and a 512-token prefill, and prints a table.
Importing this module does not import CuPy.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from minillm.model.config import PRESETS, ModelConfig
from minillm.cuda.gpu_kv_cache import device_dtype
from minillm.cuda.gpu_model import GPUTransformer
from minillm.cuda.dev.common import plain_table
from minillm.cuda.dev.timing import capture, time_gpu
from minillm.cuda.kernels import Kernels, module, suffix

SOURCE = "flashnorm_gemv"                  # kernels/flashnorm_gemv.cu
KERNELS = {"gemv": "flashnorm_gemv_{sfx}", "gemv_swiglu": "flashnorm_gemv_swiglu_{sfx}",
           "gemv_scaled": "gemv_scaled_{sfx}", "inv_rms": "flashnorm_inv_rms",
           "scale_rows": "flashnorm_scale_rows", "spin": "flashnorm_spin"}
FN_WARPS = 4                               # as #defined in flashnorm_gemv.cu (row pairs per block)


def _cp():
    import cupy
    return cupy


class FlashNormKernels:
    """Launch helpers for kernels/flashnorm_gemv.cu, for one weight dtype; launches go on the current stream."""

    def __init__(self, dtype: str = "float16"):
        cp = _cp()
        sfx = suffix(dtype)
        self.fn = {key: module(SOURCE).get_function(name.format(sfx=sfx)) for key, name in KERNELS.items()}
        for f in self.fn.values():          # load now, not during a graph capture
            getattr(f, "attributes", None)
        self._nil = cp.zeros(8, cp.float32)  # for pointer arguments a variant does not read

    def gemv(self, w, x, y, eps: float, accumulate: bool = False) -> None:
        """y [rows] (+)= (w [rows, in] · x [in]) · 1/RMS(x): x raw, w folded, the scale in the epilogue."""
        rows, n_in = _check(w)
        self._pairs("gemv", (rows + 1) // 2, (w, x, np.float32(eps), self._nil, y, np.int32(rows),
                                              np.int32(n_in), np.int32(accumulate), self._nil))

    def gemv_swiglu(self, w, x, eps: float, act, inv_rms_out) -> None:
        """act [ffn] = silu(s·gate)·up with [gate; up] = w [2 ffn, in] · x and s = 1/RMS(x) into
        inv_rms_out [1]: up is left unscaled for gemv_scaled to finish after the down projection."""
        rows, n_in = _check(w)
        self._pairs("gemv_swiglu", rows // 2, (w, x, np.float32(eps), self._nil, act,
                                               np.int32(rows), np.int32(n_in), np.int32(0), inv_rms_out))

    def gemv_scaled(self, w, x, scale, y, accumulate: bool = True) -> None:
        """y [rows] (+)= scale[0] · (w [rows, in] · x [in]): the down projection with the deferred 1/RMS."""
        rows, n_in = _check(w)
        self._pairs("gemv_scaled", (rows + 1) // 2, (w, x, np.float32(0), scale, y, np.int32(rows),
                                                     np.int32(n_in), np.int32(accumulate), self._nil))

    def _pairs(self, key: str, pairs: int, args) -> None:
        self.fn[key](((pairs + FN_WARPS - 1) // FN_WARPS,), (32 * FN_WARPS,), args)

    def inv_rms(self, x, s, eps: float) -> None:
        """s [T] = 1/sqrt(mean(x²) + eps) per row of x [T, dim] fp32."""
        T, dim = x.shape
        self.fn["inv_rms"]((T,), (256,), (x, s, np.int32(dim), np.float32(eps)))

    def scale_rows(self, y, s, out) -> None:
        """out [T, n] = y [T, n] · s[t] row by row (fp32; out may be y)."""
        T, n = y.shape
        grid = max(1, min(132 * 16, (T * n + 255) // 256))
        self.fn["scale_rows"]((grid,), (256,), (y, s, out, np.int32(n), np.int32(T)))

    def spin(self, ns: int) -> None:
        """Keep the current stream busy for `ns` nanoseconds (one thread spinning on the GPU's timer)."""
        self.fn["spin"]((1,), (1,), (np.uint64(ns),))


def _check(w) -> tuple[int, int]:
    rows, n_in = w.shape
    if n_in % 8:
        raise ValueError(f"flashnorm GEMV needs in % 8 == 0, got {n_in}")
    return rows, n_in


def gemm(a, w, out, dtype: str, stream) -> None:
    """out [T, rows] fp32 = a [T, in] (16-bit) @ w [rows, in]ᵀ on cuBLAS (fp32 accumulation), on `stream`.

    Row-major a and w are column-major aᵀ and wᵀ to cuBLAS: out (column-major [rows, T]) = op(W) · aᵀ."""
    cp = _cp()
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas
    T, n_in = a.shape
    rows = w.shape[0]
    ab_type = runtime.CUDA_R_16F if dtype == "float16" else runtime.CUDA_R_16BF
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream.ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rows, T, n_in, _ONE.ctypes.data,
                  w.data.ptr, ab_type, n_in, a.data.ptr, ab_type, n_in, _ZERO.ctypes.data, out.data.ptr,
                  runtime.CUDA_R_32F, rows, cublas.CUBLAS_COMPUTE_32F, -1)


_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


# ---- the two-stream path -----------------------------------------------------------------------------

class TwoStreamNorm:
    """(x · wᵀ) · 1/RMS(x), the projection and the reduction on two streams, joined explicitly.

    The caller's current stream is the timeline: both branches start after what it has enqueued (x is
    ready) and the scale runs on it after both branches. `delay_ns` spins the matmul stream first (tests,
    lesson 15): with an explicit join nothing may change, only the time.
    """

    def __init__(self, kernels: Kernels, flash: FlashNormKernels | None = None):
        cp = _cp()
        self.k, self.fk = kernels, flash or FlashNormKernels(kernels.dtype)
        self.mm_stream = cp.cuda.Stream(non_blocking=True)
        self.rms_stream = cp.cuda.Stream(non_blocking=True)
        self.x_ready, self.mm_done, self.rms_done = (cp.cuda.Event(disable_timing=True) for _ in range(3))
        self.delay_ns = 0

    def __call__(self, x, w, y_raw, inv_rms, out, eps: float, x16=None) -> None:
        """out [T, rows] fp32 = (x [T, dim] fp32 · w [rows, dim]ᵀ) · 1/RMS(x) per row.

        Scratch: y_raw [T, rows] fp32 (the un-normalized projection), inv_rms [T] fp32, and for T > 1
        x16 [T, dim] in the weight dtype (the GEMM's input)."""
        cp = _cp()
        main = cp.cuda.get_current_stream()
        main.record(self.x_ready)                               # x is written: both branches may start
        self.mm_stream.wait_event(self.x_ready)
        self.rms_stream.wait_event(self.x_ready)
        with self.mm_stream:                                    # branch 1: the projection of raw x
            if self.delay_ns:
                self.fk.spin(self.delay_ns)
            self._project(x, w, y_raw, x16)
            self.mm_stream.record(self.mm_done)
        with self.rms_stream:                                   # branch 2: one number per row
            self.fk.inv_rms(x, inv_rms, eps)
            self.rms_stream.record(self.rms_done)
        self.join(main)
        self.fk.scale_rows(y_raw, inv_rms, out)                 # on main, after the join

    def join(self, main) -> None:
        """The scale may start only when BOTH branches are done: wait on both events."""
        main.wait_event(self.mm_done)
        main.wait_event(self.rms_done)

    def _project(self, x, w, y_raw, x16) -> None:
        if x.shape[0] == 1:                                     # decode: our GEMV reads fp32 x directly
            self.k.gemv(w, x[0], y_raw[0], version=4)
            return
        self.k.cast(x, x16)                                     # prefill: cuBLAS wants 16-bit inputs
        gemm(x16, w, y_raw, self.k.dtype, self.mm_stream)


# ---- a GPU model whose LM head runs the two-stream path ---------------------------------------------

class FlashNormGPUTransformer(GPUTransformer):
    """GPUTransformer with the final norm + LM head as FlashNorm's two-stream path (the largest matrix
    of a small model's decode step). Needs folded weights with an untied head (flashnorm.fold_checkpoint
    with untie=True): the final norm must be weightless. The layers keep gpu_model.py's fused kernels
    (their norms are all-ones after folding). Decode runs eagerly (two streams do not go through the
    captured graph) and the whole device is idle between tokens.
    """

    def __init__(self, *args, **kw):
        cp = _cp()
        super().__init__(*args, **{**kw, "use_graph": False})
        if not bool(cp.all(self.final_norm == 1.0)):
            raise ValueError("FlashNormGPUTransformer needs a weightless final norm: fold with untie=True")
        self.two_stream = TwoStreamNorm(self.k)
        self.head_raw = cp.zeros((1, self.config.vocab_size), cp.float32)     # the un-normalized logits
        self.head_inv_rms = cp.zeros(1, cp.float32)
        cp.cuda.Device().synchronize()

    def _norm_gemv(self, x, gain, w, out, label: str) -> None:
        if label != "lm_head":
            return super()._norm_gemv(x, gain, w, out, label)
        self.two_stream(x, w, self.head_raw, self.head_inv_rms, out, self.config.norm_eps)

    def prefill(self, tokens, cache, all_logits: bool = False) -> np.ndarray:
        """As GPUTransformer.prefill; the last position's head on the two-stream path."""
        if all_logits:
            return super().prefill(tokens, cache, all_logits=True)
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        cache.end_of_write(len(tokens))
        with self.stream:
            for start in range(0, len(tokens), self.prefill_chunk):
                x = self._prefill_chunk(tokens[start:start + self.prefill_chunk], cache)   # [T, dim]
            self._norm_gemv(x[-1:], self.final_norm, self.lm_head, self.logits[None], "lm_head")
            logits = self.logits.get()
        _cp().cuda.Device().synchronize()
        return logits

    def decode(self, token: int, cache) -> np.ndarray:
        logits = super().decode(token, cache)
        _cp().cuda.Device().synchronize()          # the side streams too: each token starts on an idle GPU
        return logits


# ---- the micro-benchmark -----------------------------------------------------------------------------

def _sites(cfg: ModelConfig) -> dict[str, int]:
    """The two norm -> projection pairs of a layer: rows of the stacked matrices."""
    return {"qkv": (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, "gate_up": 2 * cfg.ffn_dim}


class _Site:
    """Random folded weights and every buffer the variants need, for one (matrix, T)."""

    def __init__(self, k: Kernels, rows: int, dim: int, T: int, seed: int):
        cp = _cp()
        nd = device_dtype(k.dtype)
        self.w = cp.empty((rows, dim), nd)
        k.fill_uniform(self.w, seed, math.sqrt(3.0 / dim))
        rng = np.random.default_rng(seed)
        self.x = cp.asarray((rng.standard_normal((T, dim)) * 3).astype(np.float32))
        self.ones = cp.ones(dim, cp.float32)
        self.h = cp.empty((T, dim), cp.float32 if T == 1 else nd)         # the normalized x (unfused)
        self.x16 = cp.empty((T, dim), nd)
        k.cast(self.x, self.x16)                                           # "projection alone" reads real values
        self.y = cp.empty((T, rows), cp.float32)
        self.y_raw = cp.empty((T, rows), cp.float32)
        self.s = cp.empty(T, cp.float32)


def _variants(k: Kernels, fk: FlashNormKernels, two: TwoStreamNorm, site: _Site, eps: float) -> dict:
    """name -> a function enqueueing that variant on the current stream."""
    cp = _cp()
    T = site.x.shape[0]
    if T == 1:
        return {
            "projection alone": lambda: k.gemv(site.w, site.x[0], site.y[0], version=4),
            "unfused": lambda: (k.rmsnorm(site.x, site.ones, site.h, eps),
                                k.gemv(site.w, site.h[0], site.y[0], version=4)),
            "two-stream": lambda: two(site.x, site.w, site.y_raw, site.s, site.y, eps),
            "fused flashnorm_gemv": lambda: fk.gemv(site.w, site.x[0], site.y[0], eps),
            "gemv.cu v4 norm-fused": lambda: k.gemv_rmsnorm(site.w, site.x[0], site.ones, eps, site.y[0],
                                                            version=4),
        }
    cur = cp.cuda.get_current_stream
    return {
        "projection alone": lambda: gemm(site.x16, site.w, site.y, k.dtype, cur()),
        "unfused": lambda: (k.rmsnorm(site.x, site.ones, site.h, eps), gemm(site.h, site.w, site.y, k.dtype, cur())),
        "two-stream": lambda: two(site.x, site.w, site.y_raw, site.s, site.y, eps, site.x16),
    }


def _time_us(fn, stream, graph: bool, inner: int, outer: int) -> float | None:
    """Median µs per call of fn: `inner` calls captured as one CUDA graph (GPU time, no Python in it), or
    enqueued eagerly (what a Python engine pays, launch costs included). None if capture fails."""
    cp = _cp()
    with stream:
        fn()
        stream.synchronize()
        step = lambda: [fn() for _ in range(inner)]
        if graph:
            try:
                g = capture(step, stream)
            except Exception:   # noqa: BLE001 - e.g. a library that cannot be captured: report no number
                cp.cuda.Device().synchronize()
                return None
            step = lambda: g.launch(stream)
        return time_gpu(step, outer, warmup=1) * 1000.0 / inner


def benchmark(presets=("smollm2-135m", "mistral-7b"), dtype: str = "float16", prefill_tokens: int = 512,
              quick: bool = False) -> list[dict]:
    """µs per layer (norm -> qkv plus norm -> gate/up) of each variant, decode (T = 1) and prefill.

    Returns rows {preset, phase, variant, graph_us, eager_us}; random folded weights, made on the device."""
    cp = _cp()
    k, fk = Kernels(dtype), FlashNormKernels(dtype)
    two = TwoStreamNorm(k, fk)
    stream = cp.cuda.Stream(non_blocking=True)
    inner, outer = (4, 3) if quick else (20, 15)
    rows = []
    for preset in presets:
        cfg = PRESETS[preset].config
        for phase, T in (("decode", 1), (f"prefill {prefill_tokens}", prefill_tokens)):
            sites = [_Site(k, n, cfg.dim, T, seed) for seed, n in enumerate(_sites(cfg).values(), 1)]
            cp.cuda.Device().synchronize()
            for name in _variants(k, fk, two, sites[0], cfg.norm_eps):
                per = [_variants(k, fk, two, s, cfg.norm_eps)[name] for s in sites]
                timed = {mode: [_time_us(f, stream, mode == "graph", inner, outer) for f in per]
                         for mode in ("graph", "eager")}
                rows.append(dict(preset=preset, phase=phase, variant=name,
                                 **{f"{m}_us": None if None in v else sum(v) for m, v in timed.items()}))
            del sites
    return rows


def print_benchmark(rows: list[dict], dtype: str, print_table=None) -> None:
    """The table: µs per layer and the ratio to the unfused path (graph: GPU time; eager: with launches).
    print_table(title, headers, rows): how to print it (lesson 15 passes the course's; plain columns here)."""
    print_table = print_table or plain_table
    base = {(r["preset"], r["phase"]): r for r in rows if r["variant"] == "unfused"}

    def cell(r, mode):
        us, ref = r[f"{mode}_us"], base[(r["preset"], r["phase"])][f"{mode}_us"]
        if us is None:
            return "(no capture)"
        return f"{us:8.1f}" + (f"  {us / ref:4.2f}x" if ref else "")
    print_table(f"FlashNorm micro-benchmark, {dtype}: µs per layer (norm -> qkv + norm -> gate/up), "
                f"ratio to unfused", ["model", "phase", "variant", "graph µs (ratio)", "eager µs (ratio)"],
                [[r["preset"], r["phase"], r["variant"], cell(r, "graph"), cell(r, "eager")] for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="FlashNorm: unfused vs two-stream vs fused, µs per layer")
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    args = parser.parse_args(argv)
    from minillm.cuda import available
    if not available():
        print("minillm.cuda.dev.flashnorm: no CUDA device (or no CuPy): nothing to time", file=sys.stderr)
        return 1
    cp = _cp()
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    print(f"device: {name.decode() if isinstance(name, bytes) else name}")
    print_benchmark(benchmark(dtype=args.dtype, quick=args.quick), args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
