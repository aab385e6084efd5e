"""Timing int8/int4 decode on the GPU: `minillm bench --device cuda --random-weights --quant int8|int4`.

Same workload and table as the fp16 benchmark (minillm.cuda.selfcheck.bench): random weights of a preset's
shape made on the device, TTFT of a 512-token prompt, decode tok/s over 128 new tokens with the CUDA graph,
bytes actually read per token (int8/int4 codes + scales (+ mins), the 16-bit LM head, the KV cache), GB/s
and % of the measured copy bandwidth; then each quantized GEMV alone next to fp16 v4 on the same shape, and
where one decode step spends its time. `gemv_points` is what lesson 14 plots on the roofline.
"""
from __future__ import annotations

import time

import numpy as np

from minillm.model.config import ModelConfig
from minillm.cuda.selfcheck import (BANDWIDTH, EventTimer, copy_bandwidth, decode_bytes, decode_tok_s, prefill_ttft,
                        report_decode, say, time_gpu, verdict)

TARGETS = {"float16": 250, "int8": 430, "int4": 650}     # issue #6, Mistral-7B shape, tok/s


def matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The four matrices of a layer as the decode step multiplies them (q|k|v and gate|up stacked)."""
    hd = cfg.head_dim
    return {"qkv": ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, cfg.dim), "o": (cfg.dim, cfg.n_heads * hd),
            "gate_up": (2 * cfg.ffn_dim, cfg.dim), "down": (cfg.dim, cfg.ffn_dim)}


def gemv_points(cfg: ModelConfig, formats=("float16", "int8", "int4"), group_size: int = 128):
    """Each layer matrix of `cfg` alone, in each weight format: [(format, matrix, shape, bytes, µs)].
    Plain GEMV (y = W·x, no fusion), timed inside a CUDA graph over enough copies of the matrix (random,
    made on the device) that none is still in L2 when its turn comes again."""
    import cupy as cp
    from minillm.cuda.kernels import Kernels
    from minillm.cuda.qweights import QuantMatrix
    k = Kernels("float16")
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
            us = graph_us(lambda i: k.gemv(copies[i % len(copies)], x, y, version=4), 2 * len(copies))
            points.append((fmt, name, (rows, cols), int(first.nbytes), us))
    return points


def graph_us(fn, n: int, reps: int = 5) -> float:
    """µs per call of fn(i), i = 0 .. n-1, captured as one CUDA graph and replayed (median of `reps`): no
    host launch cost, the gaps between dependent kernels stay, as in the decode step's own graph."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn(0)                                               # load / warm outside the capture
        stream.begin_capture()
        try:
            for i in range(n):
                fn(i)
        finally:
            graph = stream.end_capture()
        ms = time_gpu(lambda: graph.launch(stream), reps)
    return ms * 1e3 / n


def step_kernels_in_graphs(gpu, bw: float) -> dict:
    """Each GEMV of the decode step (fused as the step runs it) and attention, over all layers in turn (so
    nothing stays in L2 from one launch to the next), timed inside a CUDA graph; fp16 v4 on 8 copies of the
    same shape beside it. Prints the table; returns {kind: µs per launch}."""
    import cupy as cp
    c, k = gpu.config, gpu.k
    cache = gpu.new_cache(256)
    cache.length = 128
    gpu.step.set(np.array([1, 128], dtype=np.int32))
    cp.cuda.Device().synchronize()                         # the copy ran on the default stream
    ones = cp.ones(max(c.dim, c.ffn_dim), cp.float32)
    x, act = cp.ones(c.dim, cp.float32), cp.ones(c.ffn_dim, cp.float32)
    y = cp.empty(max(c.dim, gpu.qkv_width, 2 * c.ffn_dim), cp.float32)    # room for any matrix's rows
    gu = cp.empty(c.ffn_dim, cp.float32)
    parts = gpu._decode_parts(cache)
    n = len(gpu.layers)
    Ls = gpu.layers
    runs = {
        "qkv": lambda i: k.gemv_qkv(Ls[i].wqkv, x, ones[:c.dim], 1e-5, y[:gpu.qkv_width], gpu.step_pos, gpu.inv_freq,
                                    cache.k[i], cache.v[i], c.n_heads, c.n_kv_heads, c.head_dim),
        "attention": lambda i: k.attention(gpu.qkv, 1, c.n_heads, c.n_kv_heads, c.head_dim, cache.k[i], cache.v[i],
                                           gpu.step_pos, c.sliding_window, parts, gpu.attn),
        "o": lambda i: k.gemv(Ls[i].wo, gpu.attn[0], y[:c.dim], True, 4),
        "gate_up": lambda i: k.gemv_swiglu(Ls[i].w_gate_up, x, ones[:c.dim], 1e-5, gu),
        "down": lambda i: k.gemv(Ls[i].w_down, act, y[:c.dim], True, 4),
    }
    out = {}
    say(f"\none decode step's kernels, each kind launched once per layer ({n} in a row, different weights) inside "
        f"a CUDA graph: µs per launch, gaps included; fp16 v4 on the same shape (8 copies in turn)")
    say(f"  {'kernel':<10} {'shape':>13} {'MB':>7} {'µs':>7} {'TB/s':>6} {'% copy':>7} {'x layers µs':>11} "
        f"{'fp16 µs':>8} {'fp16 TB/s':>9}")
    for kind, run in runs.items():
        us = out[kind] = graph_us(run, n)
        if kind == "attention":
            say(f"  {kind:<10} {'':>13} {'':>7} {us:7.1f} {'':>6} {'':>7} {us * n:11.0f}")
            continue
        w = getattr(Ls[0], {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}[kind])
        rows, cols = w.shape
        dense = [cp.empty((rows, cols), cp.float16) for _ in range(8)]
        for j, d in enumerate(dense):
            k.fill_uniform(d, 100 + j, 0.01)
        xin = act if kind == "down" else x
        f16 = graph_us(lambda i: k.gemv(dense[i % 8], xin, y[:rows], False, 4), 16)
        say(f"  {kind:<10} {str((rows, cols)):>13} {w.nbytes / 1e6:7.1f} {us:7.1f} {w.nbytes / us / 1e6:6.2f} "
            f"{100 * w.nbytes / (us * 1e-6) / bw:6.0f}% {us * n:11.0f} {f16:8.1f} {2 * rows * cols / f16 / 1e6:9.2f}")
    head_us = out["lm_head"] = graph_us(lambda i: k.gemv_rmsnorm(gpu.lm_head, x, ones[:c.dim], 1e-5, gpu.logits,
                                                                 version=4), 4)
    total = sum(v * (1 if kind == "lm_head" else n) for kind, v in out.items())
    say(f"  lm_head (16-bit) {head_us:.1f} µs; all kernels of a step, summed: {total / 1e3:.3f} ms")
    out["sum_ms"] = total / 1e3
    return out


def _decode_tok_s(gpu, cache, prompt, n_new: int, use_graph: bool = True) -> tuple[float, list[int]]:
    """selfcheck.decode_tok_s with or without the CUDA graph (the graph is back on after)."""
    gpu.use_graph = use_graph
    try:
        return decode_tok_s(gpu, cache, prompt, n_new)
    finally:
        gpu.use_graph = True


def _per_kernel(gpu, cache, run) -> tuple[dict, float]:
    """CUDA events around every launch of run() (eager): {kernel: (launches, ms)}, total ms."""
    timer = EventTimer()
    with gpu.stream:
        gpu.k.timer = timer
        try:
            run()
        finally:
            gpu.k.timer = None
        totals = timer.totals()
    return totals, sum(ms for _, ms in totals.values())


def _print_kernels(totals: dict, total_ms: float) -> None:
    say(f"  {'kernel':<34} {'launches':>8} {'total µs':>9} {'µs each':>8} {'share':>6}")
    for name, (n, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        say(f"  {name:<34} {n:8d} {ms * 1e3:9.1f} {ms * 1e3 / n:8.2f} {100 * ms / total_ms:5.1f}%")


def bench_quant(cfg: ModelConfig, label: str, quant: str, dtype: str = "float16", n_new: int = 128,
                prompt_len: int = 16, ttft_len: int = 512, group_size: int = 128,
                show_targets: bool = False, sweep: bool = False) -> dict:
    """Benchmark a random-weight model of cfg's shape with int8/int4 layer matrices; print the table.
    sweep: also time decode with the quantized GEMV's other settings (grid, prefetching)."""
    from minillm.cuda.gpu_model import GPUTransformer

    say("\ncopy bandwidth")
    bw = BANDWIDTH["copy"] = copy_bandwidth(2048 << 20)
    say(f"  device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")
    t0 = time.perf_counter()
    gpu = GPUTransformer.random(cfg, dtype, seed=0, quant=quant, group_size=group_size)
    wbytes = gpu.weight_bytes
    head = gpu.lm_head.nbytes
    say(f"\nmodel: {label}, random {quant}{f' (groups of {group_size})' if quant == 'int4' else ''} layer weights "
        f"+ {dtype} LM head, made on the device in {time.perf_counter() - t0:.1f} s: {wbytes / 1e9:.3f} GB read per "
        f"decode step ({head / 1e9:.3f} GB of it the 16-bit LM head); roofline {bw / wbytes:.0f} tok/s")

    # -- each kind of kernel of the decode step, 32 launches (one per layer) replayed as a CUDA graph
    table = step_kernels_in_graphs(gpu, bw)
    # -- prefill (TTFT): each quantized matrix widened to 16 bits, then cuBLAS
    cache = gpu.new_cache(max(ttft_len, prompt_len + n_new) + 8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, ttft_len)
    ttft = prefill_ttft(gpu, cache, prompt)
    say(f"\nprefill {ttft_len} tokens: TTFT {ttft * 1e3:.1f} ms (median of 3 after a warm-up)")

    # -- decode: eager, graph (and the grid sweep)
    short = rng.integers(0, cfg.vocab_size, prompt_len)
    results = {"eager": _decode_tok_s(gpu, cache, short, n_new, use_graph=False),
               "graph": _decode_tok_s(gpu, cache, short, n_new)}
    same = results["eager"][1] == results["graph"][1]
    verdict(f"{label} {quant} decode: graph tokens == eager tokens", same,
            "" if same else "the graph replay diverged from eager launches")
    if sweep:          # other settings of the quantized GEMV (Kernels' tunables), each with its own graph
        k, defaults = gpu.k, (gpu.k.quant_blocks_per_sm, gpu.k.quant_flags, gpu.prefetch_next)
        for label_, blocks, flags, nxt in [("L2 look-ahead", 2, 1, False), ("next-GEMV prefetch", 2, 0, True),
                                           ("look-ahead + next GEMV", 2, 1, True),
                                           ("look-ahead 2 + next GEMV", 2, 3, True),
                                           ("1 block/SM", 1, 0, False), ("unbounded grid", 0, 0, False)]:
            k.quant_blocks_per_sm, k.quant_flags, gpu.prefetch_next = blocks, flags, nxt
            results[f"graph, {label_}"] = _decode_tok_s(gpu, cache, short, n_new)
        k.quant_blocks_per_sm, k.quant_flags, gpu.prefetch_next = defaults
    per_token = report_decode(cfg, wbytes, prompt_len, n_new, results, bw, width=34)

    # -- where one prefill spends its time (the decode step's kernels: the graph table above)
    cache.reset()
    totals, pf_ms = _per_kernel(gpu, cache, lambda: gpu.prefill(prompt, cache))
    graph_ms = 1e3 / results["graph"][0]
    say(f"\ndecode step: {graph_ms:.3f} ms per token with the graph; its kernels timed kind by kind in graphs "
        f"sum to {table['sum_ms']:.3f} ms")
    say(f"\none prefill of {ttft_len} tokens, per kernel (cuBLAS GEMMs not timed one by one; sum of our "
        f"kernels {pf_ms:.2f} ms vs TTFT {ttft * 1e3:.1f} ms)")
    _print_kernels(totals, pf_ms)

    tps = results["graph"][0]
    target = TARGETS[quant] if show_targets else None
    say(f"\nsummary ({label}, {quant} layer weights, {dtype} head and activations, batch 1)")
    say(f"  {'':<24} {'measured':>10} {'target':>8}")
    for name, value, want in [("decode tok/s", f"{tps:.1f}", f"≥ {target}" if target else ""),
                              ("decode tok/s, eager", f"{results['eager'][0]:.1f}", ""),
                              ("GB/s", f"{per_token * tps / 1e9:.0f}", ""),
                              ("% of copy bandwidth", f"{100 * per_token * tps / bw:.0f}%", ""),
                              (f"TTFT {ttft_len} tokens, ms", f"{ttft * 1e3:.1f}", "")]:
        say(f"  {name:<24} {value:>10} {want:>8}")
    if target:
        gap = tps / target - 1
        say(f"  {'met' if gap >= 0 else 'missed'}: {100 * gap:+.0f}% against {target} tok/s")
    return {"tok_s": tps, "gb_s": per_token * tps / 1e9, "copy_bw": bw, "bytes_per_token": per_token,
            "ttft_s": ttft, "step_kernels": table, "results": {m: r[0] for m, r in results.items()}}


# ---- the compact report: `python -m minillm.cuda.qbench` -------------------------------------------------------
def attention_us(gpu, lengths=(144, 640, 2048), versions=(2, 3)) -> dict:
    """Decode attention alone, µs a launch inside a CUDA graph (32 layers in turn, each its own K/V), at a few
    context lengths, for each kernel version (Kernels.attention_version). -> {(length, version): µs}"""
    import cupy as cp
    c, k = gpu.config, gpu.k
    cache = gpu.new_cache(max(lengths) + 8)
    rng = cp.random.default_rng(3)
    for a in (cache.k, cache.v):
        a[...] = rng.standard_normal(a.shape, dtype=cp.float32).astype(a.dtype)
    gpu.qkv[...] = rng.standard_normal(gpu.qkv.shape, dtype=cp.float32)
    parts = gpu._decode_parts(cache)
    cp.cuda.Device().synchronize()
    out, old = {}, k.attention_version
    try:
        for length in lengths:
            gpu.step_pos.set(np.array([length - 1], np.int32))
            cp.cuda.Device().synchronize()
            for v in versions:
                k.attention_version = v
                out[length, v] = graph_us(lambda i: k.attention(gpu.qkv, 1, c.n_heads, c.n_kv_heads, c.head_dim,
                                                                cache.k[i], cache.v[i], gpu.step_pos, c.sliding_window,
                                                                parts, gpu.attn), len(gpu.layers))
    finally:
        k.attention_version = old
    return out


def quant_versions_us(gpu) -> dict:
    """Each quantized layer matrix as a plain GEMV (y = W·x), v1 (fp32 x) against v2 (fp16 x, HFMA2), µs a
    launch in a CUDA graph over all layers in turn. -> {(matrix, version): µs}"""
    import cupy as cp
    k, n = gpu.k, len(gpu.layers)
    out = {}
    for name, attr in (("qkv", "wqkv"), ("o", "wo"), ("gate_up", "w_gate_up"), ("down", "w_down")):
        w0 = getattr(gpu.layers[0], attr)
        rows, cols = w0.shape
        x = cp.asarray(np.random.default_rng(0).standard_normal(cols).astype(np.float32))
        y = cp.empty(rows, cp.float32)
        for v in (1, 2):
            k.quant_version = v
            try:
                out[name, v] = graph_us(lambda i: k.gemv(getattr(gpu.layers[i], attr), x, y, version=4), n)
            finally:
                k.quant_version = 2
    return out


def report(cfg: ModelConfig, label: str, formats=("float16", "int8", "int4"), n_new: int = 128,
           prompt_len: int = 16) -> dict:
    """One compact run over the weight formats: per-kernel µs in graphs (the decode step's kernels), decode
    tok/s with the graph, attention v2 vs v3 and quantized v1 vs v2 side by side. Prints as it goes."""
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    bw = BANDWIDTH["copy"] = copy_bandwidth(2048 << 20)
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s; model {label}")
    results = {}
    for fmt in formats:
        quant = None if fmt == "float16" else fmt
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=quant)
        say(f"\n== {fmt}: {gpu.weight_bytes / 1e9:.2f} GB of weights a token")
        table = step_kernels_in_graphs(gpu, bw)
        if fmt == "float16":
            att = attention_us(gpu)
            say("  attention alone, µs a layer in a graph: " + ", ".join(
                f"{L} keys v2 {att[L, 2]:.1f} / v3 {att[L, 3]:.1f}" for L in sorted({L for L, _ in att})))
            results["attention"] = att
        else:
            qv = quant_versions_us(gpu)
            say("  plain GEMV, µs in a graph, v1 (fp32 x) -> v2 (fp16 x, HFMA2): " + ", ".join(
                f"{m} {qv[m, 1]:.1f} -> {qv[m, 2]:.1f}" for m in ("qkv", "o", "gate_up", "down")))
            results[f"{fmt} gemv versions"] = qv
        cache = gpu.new_cache(prompt_len + n_new + 8)
        short = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len)
        per_token, _ = decode_bytes(cfg, gpu.weight_bytes, prompt_len, n_new)
        runs = {"graph": _decode_tok_s(gpu, cache, short, n_new)[0]}
        if fmt == "float16":
            gpu.k.attention_version = 2
            runs["graph, attention v2"] = _decode_tok_s(gpu, cache, short, n_new)[0]
            gpu.k.attention_version = 3
        for mode, tps in runs.items():
            target = TARGETS[fmt]
            say(f"  decode {mode}: {tps:.1f} tok/s, {per_token * tps / 1e9:.0f} GB/s, {100 * per_token * tps / bw:.0f}% "
                f"of copy, target {target} ({100 * (tps / target - 1):+.0f}%)")
        results[fmt] = {"tok_s": runs, "step_kernels": table}
        del gpu, cache
        cp.get_default_memory_pool().free_all_blocks()
    return results


def kv_cache_report(cfg: ModelConfig, label: str, contexts=(4096, 32000), n_new: int = 64) -> dict:
    """Decode at long contexts with the 16-bit and the int8 KV cache (fp16 weights): tok/s with the graph,
    the bytes a token reads (weights + every cached K/V byte) and GB/s. At batch 1 the cache is read once
    per token like the weights, so its bytes become time once the context is long: at 32k tokens a
    Mistral-7B-shaped 16-bit cache is 4.3 GB against 14.5 GB of weights. The caches are filled with random
    values up to `context` (prefill is not what is timed). -> {(cache, context): tok/s}"""
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    cfg = cfg.replace(sliding_window=None, max_seq_len=max(contexts) + n_new + 8)   # every key is read
    bw = BANDWIDTH.get("copy") or copy_bandwidth(2048 << 20)
    gpu = GPUTransformer.random(cfg, "float16", seed=0)
    say(f"\n== KV cache, {label} without a sliding window, fp16 weights ({gpu.weight_bytes / 1e9:.2f} GB), "
        f"copy {bw / 1e12:.2f} TB/s")
    out = {}
    variants = [("16-bit", "auto", 16), ("int8", "int8", 16), ("int8/8", "int8", 8)]  # int8/8: the first kernel
    for context in contexts:
        for kind, kv_cache, codes_per_lane in variants:
            gpu.kv_cache = kv_cache                      # new_cache follows it; the graph is the cache's own
            gpu.k.attention_int8_codes_per_lane = codes_per_lane
            cache = gpu.new_cache(context + n_new + 8)
            _fill_random(cache)
            kv_bytes = cache.nbytes * (context + n_new / 2) / cache.max_seq_len
            tps = _decode_from(gpu, cache, context, n_new)
            per_token = gpu.weight_bytes + kv_bytes
            out[kind, context] = tps
            say(f"  {context:6d} keys, {kind:>6} cache: {tps:6.1f} tok/s, reads {per_token / 1e9:5.2f} GB a token "
                f"({kv_bytes / 1e9:4.2f} GB of K/V), {per_token * tps / 1e9:5.0f} GB/s, "
                f"{100 * per_token * tps / bw:3.0f}% of copy")
            del cache
            cp.get_default_memory_pool().free_all_blocks()
        say(f"  int8 / 16-bit at {context} keys: {out['int8', context] / out['16-bit', context]:.2f}x "
            f"(8 codes a lane: {out['int8/8', context] / out['16-bit', context]:.2f}x)")
    gpu.kv_cache = "auto"
    gpu.k.attention_int8_codes_per_lane = type(gpu.k).attention_int8_codes_per_lane
    return out


def _fill_random(cache) -> None:
    """Random keys and values in a 16-bit or an int8 cache (codes and scales)."""
    import cupy as cp
    rng = cp.random.default_rng(5)
    for a in (cache.k, cache.v):
        if a.dtype == cp.int8:
            a[...] = rng.integers(-127, 128, a.shape, dtype=cp.int32).astype(cp.int8)
        else:
            a[...] = rng.standard_normal(a.shape, dtype=cp.float32).astype(a.dtype)
    for name in ("k_scale", "v_scale"):
        if hasattr(cache, name):
            getattr(cache, name)[...] = 0.01 + rng.random(getattr(cache, name).shape, dtype=cp.float32) / 50
    cp.cuda.Device().synchronize()


def _decode_from(gpu, cache, context: int, n_new: int) -> float:
    """tok/s of n_new decode steps (CUDA graph) after `context` filled positions; one untimed step first."""
    token = 1
    for timed in (False, True):
        cache.length = context
        start = time.perf_counter()
        for _ in range(n_new if timed else 1):
            token = int(np.argmax(gpu.decode(token, cache)))
        elapsed = time.perf_counter() - start
    return n_new / elapsed


if __name__ == "__main__":
    import argparse
    from minillm.cuda.selfcheck import bench_config
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.qbench", description=report.__doc__.split("\n")[0])
    ap.add_argument("--formats", default="float16,int8,int4")
    ap.add_argument("--kv-cache", action="store_true", help="Instead: long-context decode, 16-bit vs int8 KV cache.")
    args = ap.parse_args()
    if args.kv_cache:
        kv_cache_report(bench_config(False), "Mistral-7B shape", contexts=(4096, 32000), n_new=48)
    else:
        report(bench_config(False), "Mistral-7B shape", tuple(args.formats.split(",")))
