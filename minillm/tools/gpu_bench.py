"""`minillm bench --device cuda`: the shipped GPU path on random weights of a preset's shape, made on the device.

One report for 16-bit and int8/int4 weights: the copy bandwidth and the roofline; each kernel of the decode step
timed in a CUDA graph over all layers (16-bit: cuBLAS on the same matrices beside it); TTFT; decode tok/s eager and
with the graph (their tokens must be equal, else exit status 1); one decode step and one prefill per kernel; a
summary beside the project's current figure (minillm/data/current_figures.json); then HF transformers on the same
shape in a process of its own (tools/hf_peer.py). Earlier kernel versions are timed in minillm/cuda/dev.
"""
from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from minillm.cuda.selfcheck import FAILED, SHORT, say, verdict
from minillm.cuda.timing import (EventTimer, copy_bandwidth, decode_bytes, decode_tok_s, graph_us, prefill_ttft,
                                 time_gpu)
from minillm.model.config import ModelConfig
from minillm.resources import figure as current_figure

MATRICES = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}     # kind -> GPULayer field


def run(preset: str, config: ModelConfig, dtype: str = "float16", quant: str | None = None, group_size: int = 128,
        n_new: int = 128, prompt_len: int = 16, ttft_len: int = 512, peer: bool = True) -> int:
    """The report, then (peer) HF transformers on the same shape. -> exit status: 1 if a check failed."""
    import cupy as cp
    ours = measure(preset, config, dtype, quant, group_size, n_new, prompt_len, ttft_len)
    if peer:
        gc.collect()                                         # minillm's model is gone (cycles included) ...
        cp.get_default_memory_pool().free_all_blocks()       # ... and its memory back to the device, for HF
        hf_beside(config, n_new, prompt_len, ttft_len, ours)
    return 1 if FAILED else 0


def measure(preset: str, config: ModelConfig, dtype: str, quant: str | None, group_size: int, n_new: int,
            prompt_len: int, ttft_len: int) -> dict:
    """Print the report for random weights of `config`'s shape. -> {"tok_s": with the graph, "ttft_s": ...}"""
    from minillm.cuda.gpu_model import GPUTransformer
    fmt = quant or SHORT[dtype]
    if quant == "int4" and group_size != 128:
        fmt = f"int4-g{group_size}"                       # the figures' int4 is in groups of 128
    bw = copy_bandwidth(2048 << 20)
    t0 = time.perf_counter()
    gpu = GPUTransformer.random(config, dtype, seed=0, quant=quant, group_size=group_size)
    groups = f" in groups of {group_size}" if quant == "int4" else ""
    weights = f"{dtype} weights" if quant is None else f"{quant}{groups} layer weights + {dtype} LM head"
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s (device to device, bytes read + written)")
    say(f"model: {preset} shape, random {weights}, made on the device in {time.perf_counter() - t0:.1f} s: "
        f"{gpu.weight_bytes / 1e9:.3f} GB read per decode step; roofline {bw / gpu.weight_bytes:.0f} tok/s")
    step_kernels(gpu, bw)

    cache = gpu.new_cache(max(ttft_len, prompt_len + n_new) + 8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, ttft_len)
    ttft = prefill_ttft(gpu, cache, prompt)
    say(f"\nprefill {ttft_len} tokens: TTFT {ttft * 1e3:.1f} ms (median of 3 after a warm-up, host logits included)")

    short = rng.integers(0, config.vocab_size, prompt_len)
    results = {"eager": decode_tok_s(gpu.with_options(use_graph=False), cache, short, n_new),
               "graph": decode_tok_s(gpu, cache, short, n_new)}
    same = results["eager"][1] == results["graph"][1]
    verdict(f"{preset} {fmt} decode: graph tokens == eager tokens", same,
            "" if same else "the graph replay diverged from eager launches")
    per_token, kv_read = decode_bytes(config, gpu.weight_bytes, prompt_len, n_new)
    say(f"\ndecode, batch 1, {n_new} new tokens after a {prompt_len}-token prompt (host argmax each step): "
        f"{per_token / 1e9:.3f} GB a token (weights {gpu.weight_bytes / 1e9:.3f} + KV {kv_read / 1e6:.1f} MB on average)")
    say(f"  {'mode':<6} {'tok/s':>8} {'ms/token':>9} {'GB/s':>6} {'% copy BW':>10}")
    for mode, (tps, _) in results.items():
        say(f"  {mode:<6} {tps:8.1f} {1e3 / tps:9.2f} {per_token * tps / 1e9:6.0f} {100 * per_token * tps / bw:9.0f}%")
    tps = results["graph"][0]

    def one_step():
        gpu.step.set(np.array([1, cache.length], dtype=np.int32))
        gpu.decode_step(cache)
    totals = per_kernel(gpu, one_step)
    step_ms = sum(ms for _, ms in totals.values())
    say(f"\none decode step, per kernel (eager, CUDA events around each launch: {sum(n for n, _ in totals.values())} "
        f"launches, {step_ms:.3f} ms of GPU time vs {1e3 / tps:.3f} ms per token with the graph)")
    print_kernels(totals, step_ms)

    cache.reset()
    totals = per_kernel(gpu, lambda: gpu.prefill(prompt, cache), timed_gemms=True)
    prefill_ms = sum(ms for _, ms in totals.values())
    say(f"\none prefill of {ttft_len} tokens, per kernel (CUDA events around each launch and each cuBLAS GEMM"
        f"{', its widening included' if quant else ''}: {prefill_ms:.2f} ms vs TTFT {ttft * 1e3:.1f} ms)")
    print_kernels(totals, prefill_ms)

    summary(preset, fmt, [("decode tok/s", f"{tps:.1f}", "decode"),
                          ("decode tok/s, eager", f"{results['eager'][0]:.1f}", None),
                          ("GB/s", f"{per_token * tps / 1e9:.0f}", None),
                          ("% of copy bandwidth", f"{100 * per_token * tps / bw:.0f}%", None),
                          (f"TTFT {ttft_len} tokens, ms", f"{ttft * 1e3:.1f}", f"ttft{ttft_len}")])
    return {"tok_s": tps, "ttft_s": ttft}


def step_kernels(gpu, bw: float) -> None:
    """Each kernel of the decode step, as the step launches it, once per layer in a row (different weights, so
    little stays in L2) inside a CUDA graph: µs per launch; 16-bit weights: cuBLAS on the same matrices beside."""
    import cupy as cp
    c, k, layers = gpu.config, gpu.k, gpu.layers
    n = len(layers)
    cache = gpu.new_cache(256)
    cache.length = 128
    gpu.step.set(np.array([1, 128], dtype=np.int32))
    cp.cuda.Device().synchronize()                         # the copy ran on the default stream
    ones, x, act = cp.ones(c.dim, cp.float32), cp.ones(c.dim, cp.float32), cp.ones(c.ffn_dim, cp.float32)
    y = cp.empty(max(c.dim, gpu.qkv_width), cp.float32)
    gu = cp.empty(c.ffn_dim, cp.float32)
    parts = gpu._decode_parts(cache)
    runs = {
        "qkv": lambda i: k.gemv_qkv(layers[i].wqkv, x, ones, 1e-5, y[:gpu.qkv_width], gpu.step_pos, gpu.inv_freq,
                                    cache.k[i], cache.v[i], c.n_heads, c.n_kv_heads, c.head_dim),
        "attention": lambda i: k.attention(gpu.qkv, 1, c.n_heads, c.n_kv_heads, c.head_dim, cache.k[i], cache.v[i],
                                           gpu.step_pos, c.sliding_window, parts, gpu.attn),
        "o": lambda i: k.gemv(layers[i].wo, gpu.attn[0], y[:c.dim], True),
        "gate_up": lambda i: k.gemv_swiglu(layers[i].w_gate_up, x, ones, 1e-5, gu),
        "down": lambda i: k.gemv(layers[i].w_down, act, y[:c.dim], True),
    }
    dense = isinstance(layers[0].wqkv, cp.ndarray)          # 16-bit: cuBLAS can multiply it as it is
    say(f"\none decode step's kernels, each launched once per layer ({n} in a row) inside a CUDA graph: µs per "
        f"launch, gaps included" + ("; cuBLAS: the same matrices launched eagerly, fp32 accumulation" if dense else ""))
    say(f"  {'kernel':<10} {'shape':>13} {'MB':>7} {'µs':>7} {'TB/s':>6} {'% copy':>7} {'x layers µs':>11}"
        + (f" {'cuBLAS µs':>10}" if dense else ""))
    total = 0.0
    for kind, launch in runs.items():
        us = graph_us(launch, n)
        total += us * n
        if kind == "attention":
            say(f"  {kind:<10} {'':>13} {'':>7} {us:7.1f} {'':>6} {'':>7} {us * n:11.0f}")
            continue
        w = getattr(layers[0], MATRICES[kind])
        row = (f"  {kind:<10} {str(tuple(w.shape)):>13} {w.nbytes / 1e6:7.1f} {us:7.1f} {w.nbytes / us / 1e6:6.2f} "
               f"{100 * w.nbytes / (us * 1e-6) / bw:6.0f}% {us * n:11.0f}")
        if dense:
            a, out = cp.ones((1, w.shape[1]), w.dtype), cp.empty((1, w.shape[0]), cp.float32)
            with gpu.stream:
                ms = time_gpu(lambda: [gpu.gemm(a, getattr(L, MATRICES[kind]), out) for L in layers], 5)
            row += f" {ms * 1e3 / n:10.1f}"
        say(row)
    head = graph_us(lambda i: k.gemv_rmsnorm(gpu.lm_head, x, ones, 1e-5, gpu.logits), 4)
    say(f"  lm_head (16-bit, its norm fused) {head:.1f} µs; all kernels of a step, summed: {(total + head) / 1e3:.3f} ms")


def per_kernel(gpu, run, timed_gemms: bool = False) -> dict:
    """CUDA events around every launch of run() (eager) -> {kernel: (launches, ms)}. timed_gemms: each cuBLAS
    GEMM timed too, named by its matrix (a quantized matrix's widening inside its GEMM's time)."""
    timer = EventTimer()
    names = {id(getattr(L, field)): kind for L in gpu.layers for kind, field in MATRICES.items()}
    gemm = gpu.gemm

    def timed_gemm(a, w, out, accumulate=False):
        gpu.k.timer = None                                  # the widening kernel counts in the GEMM, not twice
        try:
            timer(f"cuBLAS gemm {names.get(id(w), 'lm_head')}", lambda: gemm(a, w, out, accumulate))
        finally:
            gpu.k.timer = timer
    with gpu.stream:
        gpu.k.timer = timer
        if timed_gemms:
            gpu.gemm = timed_gemm
        try:
            run()
        finally:
            gpu.k.timer = None
            if timed_gemms:
                del gpu.gemm                                # back to the class's method
        return timer.totals()


def print_kernels(totals: dict, total_ms: float) -> None:
    say(f"  {'kernel':<34} {'launches':>8} {'total µs':>9} {'µs each':>8} {'share':>6}")
    for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        say(f"  {name:<34} {n:8d} {ms * 1e3:9.1f} {ms * 1e3 / n:8.2f} {100 * ms / total_ms:5.1f}%")


def reference(what: str, preset: str, fmt: str) -> str:
    """'reference: 191 tok/s (one H100 80 GB, 2026-12-06)': the current figure gpu.<what>.<preset>.<fmt>, or ''
    when the figures have none of that shape and format."""
    try:
        figure = current_figure(f"gpu.{what}.{preset}.{fmt}")
    except KeyError:
        return ""
    return f"reference: {figure['values']['minillm']:,} {figure['unit']} ({figure['machine']}, {figure['date']})"


def summary(preset: str, fmt: str, rows: list[tuple[str, str, str | None]]) -> None:
    """Each row's name, measured value and, for a row naming a figure ("decode", "ttft512"), the current figure of
    the same shape and format beside it (lessons/BENCHMARKS.md): no verdict on speed, the machines differ."""
    say(f"\nsummary ({preset} shape, {fmt}, batch 1, CUDA graph)")
    for name, value, what in rows:
        say(f"  {name:<24} {value:>10}   {reference(what, preset, fmt) if what else ''}".rstrip())


def hf_beside(config: ModelConfig, n_new: int, prompt_len: int, ttft_len: int, ours: dict) -> None:
    """HF transformers (eager, fp16, random weights of the same shape made on the GPU) in a process of its own:
    its TTFT and decode tok/s beside minillm's. A peer that cannot start (no torch) is one line, not a failure."""
    from minillm.tools.hf_peer import HFPeer, PeerError
    rng = np.random.default_rng(1)
    long, short = (rng.integers(0, config.vocab_size, n).tolist() for n in (ttft_len, prompt_len))
    try:
        with HFPeer(config=config.to_hf(), device="cuda", dtype="float16") as peer:
            peer.measure(short, 4)                                      # warm-up: CUDA context, cuBLAS, kernels
            ttft = statistics.median(peer.measure(long, 1)["ttft_s"] for _ in range(3))
            tps = peer.measure(short, n_new)["decode_tok_s"]
    except (PeerError, OSError, ValueError) as e:
        say(f"\nHF transformers comparison skipped: {e}")
        return
    say(f"\nHF transformers ({peer.versions}), eager fp16 in its own process, same shape and workload:")
    say(f"  TTFT {ttft_len} tokens: HF {ttft * 1e3:.1f} ms, minillm {ours['ttft_s'] * 1e3:.1f} ms; decode: HF "
        f"{tps:.1f} tok/s (median step), minillm {ours['tok_s']:.1f} tok/s")
