"""Check, then time, the GPU path in one run:  PYTHONPATH=. python3 -m minillm.cuda.selfcheck [--quick]

1. every kernel against its NumPy reference (fp16 and bf16), and small random models GPU vs CPU
   (logits, greedy continuation, CUDA-graph replay == eager);
2. the measured device-to-device copy bandwidth (bytes read + written / time): the roofline;
3. a random-weight model made on the device (Mistral-7B shape, fp16: 14.5 GB; `--quick`: a small one):
   GEMV kernels vs cuBLAS, TTFT of a 512-token prompt, decode tok/s eager vs graph over 128 new
   tokens after a short prompt, bytes per token, GB/s, % of copy bandwidth, and where one decode
   step spends its time (CUDA events around every launch).

Ends with one line: all checks passed, or which failed (exit status 1). Needs nothing outside the repo.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from minillm.model.config import PRESETS, ModelConfig

FAILED: list[str] = []
BANDWIDTH: dict[str, float] = {}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def say(msg: str = "") -> None:
    print(msg, flush=True)


def verdict(name: str, passed: bool, detail: str) -> None:
    say(f"  {'PASS' if passed else 'FAIL'}  {name:<52} {detail}")
    if not passed:
        FAILED.append(name)


def guarded(name: str, fn) -> None:
    """Run one check; an exception is a failed check, not the end of the selfcheck."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        verdict(name, False, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


# ---- 1. correctness -----------------------------------------------------------------------------
def kernel_checks(quick: bool) -> None:
    from minillm.cuda import checks
    from minillm.cuda.kernels import Kernels
    say("kernels vs NumPy (error relative to the reference's largest value; NaN-poisoned outputs)")
    for dtype in ("float16", "bfloat16"):
        k = Kernels(dtype)
        cases = [
            ("rmsnorm -> fp32", lambda: checks.check_rmsnorm(k, 3, 4096, False)),
            ("rmsnorm -> 16-bit", lambda: checks.check_rmsnorm(k, 3, 576, True)),
            ("gemv v1 4096x1024", lambda: checks.check_gemv(k, 4096, 1024, 1)),
            ("gemv v2 257x4096 accumulate", lambda: checks.check_gemv(k, 257, 4096, 2, True)),
            ("gemv v2 64x14336", lambda: checks.check_gemv(k, 64, 14336, 2)),
            ("gemv+rmsnorm v3 100x4096", lambda: checks.check_gemv_rmsnorm(k, 100, 4096)),
            ("gemv+rmsnorm v3 13x576", lambda: checks.check_gemv_rmsnorm(k, 13, 576)),
            ("gemv v4 6144x4096", lambda: checks.check_gemv(k, 6144, 4096, 4)),
            ("gemv v4 257x4096 accumulate", lambda: checks.check_gemv(k, 257, 4096, 4, True)),
            ("gemv v4 64x14336 accumulate", lambda: checks.check_gemv(k, 64, 14336, 4, True)),
            ("gemv v4 13x136 (ragged)", lambda: checks.check_gemv(k, 13, 136, 4)),
            ("gemv+rmsnorm v4 101x4096", lambda: checks.check_gemv_rmsnorm(k, 101, 4096, version=4)),
            ("gemv+rmsnorm v4 13x576", lambda: checks.check_gemv_rmsnorm(k, 13, 576, version=4)),
            ("gemv+rmsnorm v4 7x14336", lambda: checks.check_gemv_rmsnorm(k, 7, 14336, version=4)),
            ("gemv+swiglu v4 ffn 300 in 4096", lambda: checks.check_gemv_swiglu(k, 300, 4096, False)),
            ("gemv+rmsnorm+swiglu v4 ffn 1000 in 576", lambda: checks.check_gemv_swiglu(k, 1000, 576, True)),
            ("gemv+rmsnorm+qkv+rope+kv v4 32+8x128", lambda: checks.check_gemv_qkv(k, 32, 8, 128, 4096, 4000, 4100, True)),
            ("gemv+qkv+rope+kv v4 9+3x64 in 576", lambda: checks.check_gemv_qkv(k, 9, 3, 64, 576, 17, 40, False)),
            ("gemv+rmsnorm+qkv+rope+kv v4 MQA hd 256", lambda: checks.check_gemv_qkv(k, 4, 1, 256, 264, 0, 5, True)),
            ("gemv+rmsnorm+qkv+rope+kv v4 hd 16 pos 39", lambda: checks.check_gemv_qkv(k, 4, 4, 16, 64, 39, 40, True)),
            ("rope 32+8 heads hd 128 pos 4000", lambda: checks.check_rope(k, 1, 32, 8, 128, 4000)),
            ("rope T=7 hd 16", lambda: checks.check_rope(k, 7, 4, 4, 16, 3)),
            ("kv_append T=5", lambda: checks.check_kv_append(k, 5, 4, 1, 128, 40, 7)),
            ("attention decode L=37 splits=4", lambda: checks.check_attention(k, 1, 8, 2, 64, 37, 4)),
            ("attention decode L=37 splits=64 (empty)", lambda: checks.check_attention(k, 1, 8, 2, 64, 37, 64)),
            ("attention decode L=3000 GQA hd 128", lambda: checks.check_attention(k, 1, 32, 8, 128, 3000, 16)),
            ("attention decode MQA hd 256", lambda: checks.check_attention(k, 1, 8, 1, 256, 50, 3)),
            ("attention decode window 6", lambda: checks.check_attention(k, 1, 8, 2, 16, 100, 5, 6)),
            ("attention prefill T=9 after 31", lambda: checks.check_attention(k, 9, 9, 3, 64, 40, 2)),
            ("attention prefill T=9 window 6", lambda: checks.check_attention(k, 9, 8, 2, 16, 40, 2, 6)),
            ("attention fused L=37 splits=4", lambda: checks.check_attention(k, 1, 8, 2, 64, 37, 4, fused=True)),
            ("attention fused L=37 splits=64 (empty)", lambda: checks.check_attention(k, 1, 8, 2, 64, 37, 64, fused=True)),
            ("attention fused L=1 splits=17", lambda: checks.check_attention(k, 1, 32, 8, 128, 1, 17, fused=True)),
            ("attention fused L=3000 GQA hd 128", lambda: checks.check_attention(k, 1, 32, 8, 128, 3000, 17, fused=True)),
            ("attention fused MQA hd 256", lambda: checks.check_attention(k, 1, 8, 1, 256, 50, 3, fused=True)),
            ("attention fused window 6", lambda: checks.check_attention(k, 1, 8, 2, 16, 100, 5, 6, fused=True)),
            ("attention fused prefill T=9 after 31", lambda: checks.check_attention(k, 9, 9, 3, 64, 40, 2, fused=True)),
            ("attention fused prefill T=64 s=1", lambda: checks.check_attention(k, 64, 8, 2, 64, 64, 1, fused=True)),
            ("prefill attn tiled T=37 (ragged tile)", lambda: checks.check_prefill_attention(k, 37, 8, 2, 64, 37)),
            ("prefill attn tiled T=9 after 31, group 3", lambda: checks.check_prefill_attention(k, 9, 9, 3, 64, 40)),
            ("prefill attn tiled T=70 32/8 heads hd 128", lambda: checks.check_prefill_attention(k, 70, 32, 8, 128, 70)),
            ("prefill attn tiled T=100 after 200 window 40", lambda: checks.check_prefill_attention(k, 100, 4, 2, 64, 300, 40)),
            ("prefill attn tiled MQA hd 128 after 17", lambda: checks.check_prefill_attention(k, 33, 8, 1, 128, 50)),
            ("prefill attn tiled hd 16 window 6", lambda: checks.check_prefill_attention(k, 9, 8, 2, 16, 40, 6)),
            ("prefill attn tiled T=40 after 100 window 64", lambda: checks.check_prefill_attention(k, 40, 8, 2, 128, 140, 64)),
            ("prefill attn tiled T=512 Mistral heads", lambda: checks.check_prefill_attention(k, 512, 32, 8, 128, 512, 4096)),
            ("swiglu -> fp32", lambda: checks.check_swiglu(k, 1, 14336, False)),
            ("swiglu -> 16-bit", lambda: checks.check_swiglu(k, 4, 1536, True)),
            ("embed + cast", lambda: checks.check_embed_cast(k, 300, 72)),
            ("gemv int8 257x4096 accumulate", lambda: checks.check_gemv(k, 257, 4096, 4, True, quant="int8")),
            ("gemv int4 g128 64x14336", lambda: checks.check_gemv(k, 64, 14336, 4, quant="int4")),
            ("gemv int4 g128 13x200 (padded group)", lambda: checks.check_gemv(k, 13, 200, 4, quant="int4")),
            ("gemv+rmsnorm+swiglu int8 ffn 300 in 4096", lambda: checks.check_gemv_swiglu(k, 300, 4096, True, quant="int8")),
            ("gemv+rmsnorm+swiglu int4 ffn 1000 in 576", lambda: checks.check_gemv_swiglu(k, 1000, 576, True, quant="int4")),
            ("gemv+rmsnorm+qkv+rope+kv int8 32+8x128", lambda: checks.check_gemv_qkv(k, 32, 8, 128, 4096, 4000, 4100, True, quant="int8")),
            ("gemv+rmsnorm+qkv+rope+kv int4 9+3x64", lambda: checks.check_gemv_qkv(k, 9, 3, 64, 576, 17, 40, True, quant="int4")),
            ("dequantize int4 g32 512x4096", lambda: checks.check_dequantize(k, "int4", 512, 4096, 32)),
        ]
        if quick:
            cases = cases[::2]
        for name, run in cases:
            label = f"{SHORT[dtype]} {name}"

            def one(run=run, label=label):
                err, tol = run()
                verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
            guarded(label, one)


def model_checks(quick: bool) -> None:
    from minillm.cuda import checks
    say("small random models, GPU vs CPU (same 16-bit weights on both)")
    kinds = ["gqa", "mistral"] if quick else ["gqa", "mha", "mqa", "tied", "mistral", "hd64", "llama3"]
    variants = [(4, True, ""), (4, False, " v4 unfused-norm"), (2, False, " v2"), (2, True, " v2+v3 fused-norm")]
    for dtype in ("float16", "bfloat16"):
        for kind in kinds:
            for version, fuse, tag in variants:
                if version == 2 and kind not in ("gqa", "mistral", "tied"):
                    continue                       # the old path: a few kinds are enough
                label = f"{SHORT[dtype]} logits {kind}{tag}"

                def one(kind=kind, dtype=dtype, label=label, fuse=fuse, version=version):
                    err, tol = checks.check_model_logits(kind, dtype, fuse_norm=fuse, gemv_version=version)
                    verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
                guarded(label, one)
        for kind in ("gqa", "mistral"):
            for quant in ("int8", "int4"):
                label = f"{SHORT[dtype]} logits {kind} {quant} weights"

                def q(kind=kind, dtype=dtype, label=label, quant=quant):
                    err, tol = checks.check_model_logits(kind, dtype, fuse_norm=True, quant=quant)
                    verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
                guarded(label, q)
        for kind in ("gqa", "mistral"):
            label = f"{SHORT[dtype]} logits {kind} old prefill attention"

            def old_pf(kind=kind, dtype=dtype, label=label):
                err, tol = checks.check_model_logits(kind, dtype, prefill_attention="decode")
                verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
            guarded(label, old_pf)
    for kind in ["gqa", "mistral"]:
        for version, fuse, tag in [(4, True, ""), (2, False, " v2")]:
            label = f"fp16 greedy 16 tokens {kind}{tag}"

            def one(kind=kind, label=label, fuse=fuse, version=version):
                same, detail = checks.check_greedy(kind, "float16", fuse_norm=fuse, gemv_version=version)
                verdict(label, same, detail)
            guarded(label, one)
        for version, fuse, tag in variants:
            label = f"fp16 graph replay == eager {kind}{tag}"

            def two(kind=kind, label=label, fuse=fuse, version=version):
                same, detail = checks.check_graph_equals_eager(kind, "float16", fuse_norm=fuse, gemv_version=version)
                verdict(label, same, detail)
            guarded(label, two)


# ---- 2. timing helpers ---------------------------------------------------------------------------
def time_gpu(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() on the current stream, by CUDA events."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(cp.cuda.get_current_stream())        # explicit: record() alone may mean the null stream
        fn()
        end.record(cp.cuda.get_current_stream())
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (the memory roofline)."""
    import cupy as cp
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    ms = time_gpu(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                      cp.cuda.runtime.memcpyDeviceToDevice,
                                                      cp.cuda.get_current_stream().ptr), reps=10)
    return 2 * nbytes / (ms / 1e3)


class EventTimer:
    """Kernels.timer: CUDA events around every launch, summed per kernel name."""

    def __init__(self):
        self.records = []

    def __call__(self, name, launch):
        import cupy as cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(cp.cuda.get_current_stream())
        launch()
        end.record(cp.cuda.get_current_stream())
        self.records.append((name, start, end))

    def totals(self) -> dict[str, tuple[int, float]]:
        import cupy as cp
        self.records[-1][2].synchronize()
        out: dict[str, list] = {}
        for name, s, e in self.records:
            n, ms = out.get(name, (0, 0.0))
            out[name] = (n + 1, ms + cp.cuda.get_elapsed_time(s, e))
        return out


# ---- 3. the benchmark ----------------------------------------------------------------------------
def bench_config(quick: bool) -> ModelConfig:
    if quick:
        return ModelConfig(vocab_size=8000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_dim=2816,
                           max_seq_len=4096, family="mistral", sliding_window=4096)
    return PRESETS["mistral-7b"].config


def decode_bytes(cfg: ModelConfig, weight_bytes: int, prompt_len: int, n_new: int) -> tuple[float, float]:
    """(bytes one decode token reads, the 16-bit KV cache's share of them), at the average context of
    n_new tokens generated after a prompt_len-token prompt."""
    kv_read = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2 * (prompt_len + n_new / 2)
    return weight_bytes + kv_read, kv_read


def report_decode(cfg: ModelConfig, weight_bytes: int, prompt_len: int, n_new: int, results: dict, bw: float,
                  width: int = 20) -> float:
    """Print the bytes a decode token reads, then each mode's tok/s, ms/token, GB/s and % of the copy
    bandwidth. results: {mode: (tok/s, tokens)}.   -> bytes per token"""
    per_token, kv_read = decode_bytes(cfg, weight_bytes, prompt_len, n_new)
    say(f"\ndecode, batch 1, {n_new} new tokens after a {prompt_len}-token prompt (host argmax each step)")
    say(f"  bytes per token: {per_token / 1e9:.3f} GB (weights {weight_bytes / 1e9:.3f} + KV {kv_read / 1e6:.1f} MB "
        f"on average)")
    say(f"  {'mode':<{width}} {'tok/s':>8} {'ms/token':>9} {'GB/s':>8} {'% copy BW':>10}")
    for mode, (tps, _) in results.items():
        say(f"  {mode:<{width}} {tps:8.1f} {1e3 / tps:9.2f} {per_token * tps / 1e9:8.0f} {100 * per_token * tps / bw:9.0f}%")
    return per_token


def prefill_ttft(gpu, cache, prompt, repeats: int = 3) -> float:
    """Seconds to prefill `prompt` into an emptied cache, host logits included: the median of `repeats`
    runs after a warm-up."""
    times = []
    for _ in range(repeats + 1):
        cache.reset()
        start = time.perf_counter()
        gpu.prefill(prompt, cache)                         # returns host logits: includes the copy back
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def decode_tok_s(gpu, cache, prompt, n_new: int) -> tuple[float, list[int]]:
    """tok/s of n_new greedy steps after `prompt` with the model's current settings, and the tokens (host
    argmax each step). A warm-up run first, which also recaptures the cache's graph for those settings."""
    for attempt in ("warm-up", "timed"):
        cache.reset()
        cache.graph = None if attempt == "warm-up" else cache.graph
        logits = gpu.prefill(prompt, cache)
        tokens = []
        start = time.perf_counter()
        for _ in range(n_new):
            tokens.append(int(np.argmax(logits)))
            logits = gpu.decode(tokens[-1], cache)
        elapsed = time.perf_counter() - start
    return n_new / elapsed, tokens


def bench(quick: bool, dtype: str, n_new: int, prompt_len: int, ttft_len: int,
          config: ModelConfig | None = None, label: str | None = None) -> None:
    """Benchmark a random-weight model of `config`'s shape (default: Mistral-7B, or a small one)."""
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer

    cfg = config or bench_config(quick)
    show_targets = config is None and not quick          # issue #6's targets are for the Mistral-7B shape
    label = label or ("small (--quick)" if quick else "Mistral-7B shape")
    say("\ncopy bandwidth")
    bw = BANDWIDTH["copy"] = copy_bandwidth((256 if quick else 2048) << 20)
    say(f"  device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")

    t0 = time.perf_counter()
    gpu = GPUTransformer.random(cfg, dtype, seed=0)
    wbytes = gpu.weight_bytes
    say(f"\nmodel: {label}, random {dtype} weights made on the "
        f"device in {time.perf_counter() - t0:.1f} s: {wbytes / 1e9:.2f} GB read per decode step; "
        f"roofline {bw / wbytes:.0f} tok/s")

    # -- GEMV kernels vs cuBLAS on the model's matrices
    say("\nGEMV, one matrix (median of 20, CUDA events); v4 fused = v4 with its decode prologue/epilogue "
        "(qkv: norm+rope+kv append; gate_up: norm+swiglu; lm_head: norm)")
    say(f"  {'matrix':<10} {'shape':>13} {'v1 µs':>8} {'v2 µs':>8} {'v3+norm µs':>10} {'cuBLAS µs':>10} "
        f"{'v2 TB/s':>8} {'v2 % copy':>9} {'v4 µs':>8} {'v4 fused µs':>11} {'v4 TB/s':>8} {'v4 % copy':>9}")
    L = gpu.layers[0]
    c = cfg
    scratch = gpu.new_cache(64)
    with gpu.stream:
        for name, w in [("qkv", L.wqkv), ("o", L.wo), ("gate_up", L.w_gate_up), ("down", L.w_down), ("lm_head", gpu.lm_head)]:
            x = cp.ones(w.shape[1], cp.float32)
            y = cp.empty(w.shape[0], cp.float32)
            g = cp.ones(w.shape[1], cp.float32)
            v1 = time_gpu(lambda: gpu.k.gemv(w, x, y, version=1), 20) * 1e3
            v2 = time_gpu(lambda: gpu.k.gemv(w, x, y, version=2), 20) * 1e3
            v4 = time_gpu(lambda: gpu.k.gemv(w, x, y, version=4), 20) * 1e3
            v3 = v4f = float("nan")
            if name in ("qkv", "gate_up", "lm_head"):          # the matrices an RMSNorm feeds
                v3 = time_gpu(lambda: gpu.k.gemv_rmsnorm(w, x, g, 1e-5, y), 20) * 1e3
            if name == "qkv":
                v4f = time_gpu(lambda: gpu.k.gemv_qkv(w, x, g, 1e-5, y, gpu.step_pos, gpu.inv_freq, scratch.k[0],
                                                      scratch.v[0], c.n_heads, c.n_kv_heads, c.head_dim), 20) * 1e3
            elif name == "gate_up":
                act = cp.empty(w.shape[0] // 2, cp.float32)
                v4f = time_gpu(lambda: gpu.k.gemv_swiglu(w, x, g, 1e-5, act), 20) * 1e3
            elif name == "lm_head":
                v4f = time_gpu(lambda: gpu.k.gemv_rmsnorm(w, x, g, 1e-5, y, version=4), 20) * 1e3
            else:
                v4f = time_gpu(lambda: gpu.k.gemv(w, x, y, accumulate=True, version=4), 20) * 1e3   # + residual
            try:
                xh = cp.ones((w.shape[1], 1), w.dtype) if w.dtype == cp.float16 else None
                cub = (time_gpu(lambda: cp.matmul(w, xh), 20) * 1e3) if xh is not None else float("nan")
            except Exception:
                cub = float("nan")
            tbs = w.nbytes / (v2 / 1e6) / 1e12
            tbs4 = w.nbytes / (v4 / 1e6) / 1e12
            say(f"  {name:<10} {str(tuple(w.shape)):>13} {v1:8.1f} {v2:8.1f} {v3:10.1f} {cub:10.1f} {tbs:8.2f} "
                f"{100 * w.nbytes / (v2 / 1e6) / bw:8.0f}% {v4:8.1f} {v4f:11.1f} {tbs4:8.2f} "
                f"{100 * w.nbytes / (v4 / 1e6) / bw:8.0f}%")

    # -- prefill (TTFT)
    cache = gpu.new_cache(max(ttft_len, prompt_len + n_new) + 8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, ttft_len)
    ttft = prefill_ttft(gpu, cache, prompt)
    flops = 2 * (wbytes / 2) * ttft_len
    say(f"\nprefill {ttft_len} tokens: TTFT {ttft * 1e3:.1f} ms (median of 3 after a warm-up; "
        f"{flops / ttft / 1e12:.0f} TFLOP/s on the weight matmuls)")

    # -- decode, eager then graph; the first version (v2, fuse_norm off / v3) beside v4
    short = rng.integers(0, cfg.vocab_size, prompt_len)
    results = {}
    modes = {"v2 eager": (2, False, False), "v2 graph": (2, True, False), "v2 graph+fused-norm": (2, True, True),
             "v4 eager": (4, False, True), "v4 graph": (4, True, True)}
    for mode, (version, use_graph, fuse) in modes.items():
        gpu.gemv_version, gpu.use_graph, gpu.fuse_norm = version, use_graph, fuse
        results[mode] = decode_tok_s(gpu, cache, short, n_new)
    gpu.gemv_version, gpu.use_graph, gpu.fuse_norm = 4, True, True
    same = results["v2 eager"][1] == results["v2 graph"][1] and results["v4 eager"][1] == results["v4 graph"][1]
    verdict(f"{label} decode: graph tokens == eager tokens",
            same, "" if same else "the graph replay diverged from eager launches")

    per_token = report_decode(cfg, wbytes, prompt_len, n_new, results, bw)
    fused_same = results["v4 graph"][1][:8] == results["v2 graph"][1][:8]
    say(f"  v4 tokens {'equal the v2 ones' if fused_same else 'differ from the v2 ones'} "
        f"(first 8; random weights may part ways later at a near-tie)")

    # -- one decode step, per kernel (v4, then the first version for comparison)
    for version, fuse in ((4, True), (2, False)):
        gpu.gemv_version, gpu.fuse_norm = version, fuse
        timer = EventTimer()
        with gpu.stream:
            gpu.step.set(np.array([1, cache.length], dtype=np.int32))
            gpu.k.timer = timer
            try:
                gpu.decode_step(cache)
            finally:
                gpu.k.timer = None
            totals = timer.totals()
        step_ms = sum(ms for _, ms in totals.values())
        graph_mode = "v4 graph" if version == 4 else "v2 graph"
        say(f"\none decode step, per kernel, v{version}{' fused-norm' if fuse else ''} (eager, CUDA events around "
            f"each launch; sum {step_ms:.3f} ms of GPU time vs {1e3 / results[graph_mode][0]:.3f} ms per token "
            f"with the graph)")
        say(f"  {'kernel':<34} {'launches':>8} {'total µs':>9} {'µs each':>8} {'share':>6}")
        for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            say(f"  {name:<34} {n:8d} {ms * 1e3:9.1f} {ms * 1e3 / n:8.2f} {100 * ms / step_ms:5.1f}%")
        n_launches = sum(n for n, _ in totals.values())
        say(f"  {n_launches} launches per step")
    gpu.gemv_version, gpu.fuse_norm = 4, True

    # -- one prefill, per kernel (cuBLAS GEMMs included): where TTFT goes
    timer = EventTimer()
    real_gemm = gpu.gemm

    def timed_gemm(a, w, out, accumulate=False):
        rows = w.shape[0]
        label = {gpu.qkv_width: "qkv", cfg.dim: "o/down", 2 * cfg.ffn_dim: "gate_up"}.get(rows, "lm_head")
        timer(f"cuBLAS gemm {label}", lambda: real_gemm(a, w, out, accumulate))
    cache.reset()
    with gpu.stream:
        gpu.k.timer, gpu.gemm = timer, timed_gemm
        try:
            gpu.prefill(prompt, cache)
        finally:
            gpu.k.timer = None
            del gpu.gemm                                   # back to the class's method
        totals = timer.totals()
    pf_ms = sum(ms for _, ms in totals.values())
    say(f"\none prefill of {ttft_len} tokens, per kernel (CUDA events around each launch; sum {pf_ms:.2f} ms "
        f"vs TTFT {ttft * 1e3:.1f} ms)")
    say(f"  {'kernel':<34} {'launches':>8} {'total µs':>9} {'µs each':>8} {'share':>6}")
    for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        say(f"  {name:<34} {n:8d} {ms * 1e3:9.1f} {ms * 1e3 / n:8.2f} {100 * ms / pf_ms:5.1f}%")

    # -- prefill attention: the tiled kernel vs the decode kernel with one query per token (the first version)
    def attention_us(mode: str) -> tuple[float, float]:
        """(µs of attention launches in one prefill, TTFT ms) with gpu.prefill_attention = mode."""
        gpu.prefill_attention = mode
        try:
            ts = []
            for _ in range(3):
                cache.reset()
                start = time.perf_counter()
                gpu.prefill(prompt, cache)
                ts.append(time.perf_counter() - start)
            t = EventTimer()
            cache.reset()
            with gpu.stream:
                gpu.k.timer = t
                try:
                    gpu.prefill(prompt, cache)
                finally:
                    gpu.k.timer = None
            us = sum(ms for name, (_, ms) in t.totals().items() if "attention" in name) * 1e3
            return us, statistics.median(ts[1:]) * 1e3
        finally:
            gpu.prefill_attention = "tiled"
    old_us, old_ttft = attention_us("decode")
    new_us, new_ttft = attention_us("tiled")
    say(f"\nprefill attention: old vs new µs: {old_us:.0f} vs {new_us:.0f} ({old_us / max(new_us, 1e-9):.1f}x; "
        f"{cfg.n_layers} layers, {ttft_len} tokens; old = decode kernel one query per token, new = tiled "
        f"prefill_attention.cu{'' if gpu.k.prefill_attention_supported(cfg.head_dim) else ': head_dim too large, fell back'}); "
        f"TTFT {old_ttft:.1f} vs {new_ttft:.1f} ms")

    best = max(("v4 graph", "v2 graph", "v2 graph+fused-norm"), key=lambda m: results[m][0])
    graph_tps, eager_tps = results[best][0], results["v4 eager"][0]
    say(f"\nsummary ({label}, {dtype}, batch 1; "
        f"best decode mode: {best})")
    rows = [("decode tok/s", f"{graph_tps:.1f}", "≥ 250"), ("decode tok/s, v4 eager", f"{eager_tps:.1f}", ""),
            ("decode tok/s, v2 graph", f"{results['v2 graph'][0]:.1f}", ""),
            ("GB/s", f"{per_token * graph_tps / 1e9:.0f}", ""),
            ("% of copy bandwidth", f"{100 * per_token * graph_tps / bw:.0f}%", "≥ 85%"),
            (f"TTFT {ttft_len} tokens, ms", f"{ttft * 1e3:.1f}", "≤ 20")]
    say(f"  {'':<24} {'measured':>10} {'target':>8}")
    for name, value, target in rows:
        say(f"  {name:<24} {value:>10} {target if show_targets else '':>8}")


def bench_hf(cfg: ModelConfig, n_new: int, prompt_len: int, ttft_len: int, bw: float | None) -> None:
    """The same workload through HF transformers (eager, fp16, random weights built on the device)."""
    import torch
    import transformers
    from transformers import MistralConfig, MistralForCausalLM
    hf_cfg = MistralConfig(hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                           num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                           vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len,
                           sliding_window=cfg.sliding_window, rope_theta=cfg.rope_theta)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        torch.set_default_dtype(torch.float16)
        try:
            model = MistralForCausalLM(hf_cfg).eval()
        finally:
            torch.set_default_dtype(torch.float32)

    def run(plen: int, n: int) -> float:
        ids = torch.randint(0, cfg.vocab_size, (1, plen), device=dev)
        with torch.no_grad():
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run(8, 4)                                                   # warm-up
    ttft = statistics.median(run(ttft_len, 1) for _ in range(3))
    short_first = run(prompt_len, 1)
    total = run(prompt_len, n_new)
    tps = (n_new - 1) / (total - short_first)
    say(f"\nHF transformers {transformers.__version__} (torch {torch.__version__}), eager fp16, same shape and workload")
    say(f"  TTFT {ttft_len} tokens {ttft * 1e3:.1f} ms; decode {tps:.1f} tok/s" +
        (f" ({100 * tps * 2 * sum(p.numel() for p in model.parameters()) / bw:.0f}% of copy BW)" if bw else ""))


def run_bench(config: ModelConfig, label: str, dtype: str = "float16", n_new: int = 128, prompt_len: int = 16,
              ttft_len: int = 512, peer: bool = True, quant: str | None = None, group_size: int = 128) -> int:
    """`minillm bench --device cuda`: the benchmark part alone, for any model shape, then HF on the same shape
    (HF in fp16 also next to int8/int4: eager transformers has no int8/int4 kernels of its own)."""
    import cupy as cp
    if quant:
        from minillm.cuda.qbench import bench_quant
        bench_quant(config, label, quant, dtype, n_new, prompt_len, ttft_len, group_size,
                    show_targets=config == bench_config(False))
    else:
        bench(False, dtype, n_new, prompt_len, ttft_len, config=config, label=label)
    if peer:
        cp.get_default_memory_pool().free_all_blocks()
        try:
            bench_hf(config, n_new, prompt_len, ttft_len, BANDWIDTH.get("copy"))
        except Exception as e:  # noqa: BLE001 - a missing torch/transformers is not a minillm failure
            say(f"\nHF transformers comparison skipped: {type(e).__name__}: {e}")
    return 1 if FAILED else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer checks and a small model (a first smoke run)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"], help="benchmark weights")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length before the timed decode")
    ap.add_argument("--ttft-tokens", type=int, default=512)
    ap.add_argument("--no-bench", action="store_true", help="checks only")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison (never run with --quick)")
    args = ap.parse_args(argv)

    from minillm.cuda import available
    if not available():
        try:
            import cupy
            why = f"CuPy {cupy.__version__} sees no CUDA device"
        except Exception as e:  # noqa: BLE001
            why = f"CuPy is not importable ({type(e).__name__})"
        print(f"selfcheck: no GPU: {why}; run this on the GPU machine", file=sys.stderr)
        return 2

    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    say(f"minillm GPU selfcheck on {name} (sm_{props['major']}{props['minor']}, {props['multiProcessorCount']} SMs, "
        f"{props['totalGlobalMem'] / 2**30:.0f} GiB), CuPy {cp.__version__}, CUDA runtime "
        f"{cp.cuda.runtime.runtimeGetVersion()}, {time.strftime('%Y-%m-%d')}")
    t0 = time.perf_counter()
    kernel_checks(args.quick)
    model_checks(args.quick)
    say(f"(checks took {time.perf_counter() - t0:.1f} s, NVRTC compiles included)")
    if not args.no_bench:
        try:
            bench(args.quick, args.dtype, args.new_tokens, args.prompt, args.ttft_tokens)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            verdict("benchmark", False, f"raised {type(e).__name__}: {e}")
        if not (args.quick or args.no_hf):
            cp.get_default_memory_pool().free_all_blocks()       # our 7B model is gone: give HF the room
            try:
                bench_hf(bench_config(False), args.new_tokens, args.prompt, args.ttft_tokens, BANDWIDTH.get("copy"))
            except Exception as e:  # noqa: BLE001 - a missing torch/transformers is not a minillm failure
                say(f"\nHF transformers comparison skipped: {type(e).__name__}: {e}")
    say(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if FAILED:
        say(f"selfcheck: {len(FAILED)} FAILED: {', '.join(FAILED)}")
        return 1
    say("selfcheck: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
