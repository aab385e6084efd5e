"""The compact GPU report over the weight formats, and long-context decode with the 16-bit and the
int8 KV cache: `python -m minillm.cuda.dev.qbench [--formats float16,int8,int4] [--kv-cache]`.
The shipped decode step's kernels, each timed in a graph: `minillm bench --device cuda` (tools/gpu_bench.py).
"""
from __future__ import annotations

import time

import numpy as np

from minillm.cuda.dev.attention import attention_us
from minillm.cuda.dev.common import TARGETS, against_target, say
from minillm.cuda.dev.gemv import quant_versions_us
from minillm.cuda.dev.lab import as_lab_model
from minillm.cuda.selfcheck import bench_config
from minillm.cuda.timing import BANDWIDTH, copy_bandwidth, decode_bytes, decode_tok_s, device_name
from minillm.model.config import ModelConfig


def report(cfg: ModelConfig, label: str, formats=("float16", "int8", "int4"), n_new: int = 128,
           prompt_len: int = 16) -> dict:
    """One compact run over the weight formats: decode tok/s with the graph, attention v2 vs v3 and quantized
    v1 vs v2 side by side. Prints as it goes."""
    import cupy as cp
    from minillm.cuda.gpu_model import GPUTransformer
    bw = BANDWIDTH["copy"] = copy_bandwidth(2048 << 20)
    say(f"copy bandwidth {bw / 1e12:.2f} TB/s; model {label}")
    results = {}
    for fmt in formats:
        quant = None if fmt == "float16" else fmt
        gpu = GPUTransformer.random(cfg, "float16", seed=0, quant=quant)
        say(f"\n== {fmt}: {gpu.weight_bytes / 1e9:.2f} GB of weights a token")
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
        runs = {"graph": decode_tok_s(gpu, cache, short, n_new)[0]}
        if fmt == "float16":
            v2 = as_lab_model(gpu).with_settings(attention_version=2)
            runs["graph, attention v2"] = decode_tok_s(v2, cache, short, n_new)[0]
        for mode, tps in runs.items():
            say(f"  decode {mode}: {tps:.1f} tok/s, {per_token * tps / 1e9:.0f} GB/s, {100 * per_token * tps / bw:.0f}% "
                f"of copy; {against_target(tps, TARGETS[fmt], device_name())}")
        results[fmt] = {"tok_s": runs}
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
            model = as_lab_model(gpu.with_options(kv_cache=kv_cache)).with_settings(
                attention_int8_codes_per_lane=codes_per_lane)
            cache = model.new_cache(context + n_new + 8)        # 16-bit or int8, as the variant's kv_cache
            _fill_random(cache)
            kv_bytes = cache.nbytes * (context + n_new / 2) / cache.max_seq_len
            tps = _decode_from(model, cache, context, n_new)
            per_token = gpu.weight_bytes + kv_bytes
            out[kind, context] = tps
            say(f"  {context:6d} keys, {kind:>6} cache: {tps:6.1f} tok/s, reads {per_token / 1e9:5.2f} GB a token "
                f"({kv_bytes / 1e9:4.2f} GB of K/V), {per_token * tps / 1e9:5.0f} GB/s, "
                f"{100 * per_token * tps / bw:3.0f}% of copy")
            del cache
            cp.get_default_memory_pool().free_all_blocks()
        say(f"  int8 / 16-bit at {context} keys: {out['int8', context] / out['16-bit', context]:.2f}x "
            f"(8 codes a lane: {out['int8/8', context] / out['16-bit', context]:.2f}x)")
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
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.qbench", description=report.__doc__.split("\n")[0])
    ap.add_argument("--formats", default="float16,int8,int4")
    ap.add_argument("--kv-cache", action="store_true", help="Instead: long-context decode, 16-bit vs int8 KV cache.")
    args = ap.parse_args()
    if args.kv_cache:
        kv_cache_report(bench_config(False), "Mistral-7B shape", contexts=(4096, 32000), n_new=48)
    else:
        report(bench_config(False), "Mistral-7B shape", tuple(args.formats.split(",")))
