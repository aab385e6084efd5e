"""Lesson 13 — launch overhead and CUDA graphs: count the kernels of a decode step, then launch them all at once.

A decode step on the GPU is a chain of small kernels: per layer a few GEMVs, attention, norms (lesson 12).
Every launch from Python costs host time: CuPy packs the arguments, the driver queues the launch
(about 10 µs for a small CuPy operation, measured on an H200 machine). While the host queues launch
n + 1 the GPU runs launch n; when the kernels are shorter than their launches, the GPU waits for Python.

A CUDA graph removes that: the decode step is recorded once (CuPy stream capture: the kernels, their
arguments and their order) and replayed with one launch per token. What changes from token to token,
the token id and its position, sits in a device buffer that the kernels read, so one graph serves every
step (`GPUTransformer(use_graph=True)`, the default; `use_graph=False` launches the same kernels one by
one). Fusing kernels (gemv v4: RMSNorm, RoPE, KV append, SwiGLU folded into the GEMVs) cuts the count.
The engine ships only v4 with every fusion; the earlier decode steps (gemv v2, norms as their own launches)
live in the laboratory, minillm/cuda/dev/lab.py, which runs them on the same weights (llm.c's dev/cuda way).

On the CPU we count the launches of each decode configuration by running the engine's own decode step
with a recording stand-in for the GPU, and time the engine's Python per launch. On a GPU we measure what
one launch costs eager and in a graph, and decode steps of a SmolLM2-135M-shaped and a Mistral-7B-shaped
model (random weights) with and without the graph.

Run: python lessons/13_cuda_graphs.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 12 (first kernels)",
    ],
    "objectives": [
        "count the launches of one decode step, recorded on the CPU",
        "measure what a launch costs the host, and what a CUDA graph saves (on a GPU)",
    ],
    "study_time": "40 min, plus 20 min for exercise 13 (launches per token)",
    "check_questions": [
        "Why is a small model's decode step bound by launches rather than by bytes?",
        "What does a CUDA graph need to read the token and position of each step?",
    ],
    "try_this": [
        "MINILLM_LESSON_MODEL=random:mistral-7b and compare the launch count",
        "on a GPU: decode with use_graph=False and True",
    ],
}
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.model.config import PRESETS
from minillm.course.measure import Spread, load_line
from minillm.course import (print_table, quick, record_decode_launches, recording_decode_step, run_gpu_parts,
                            transfer_bytes_reference, why_no_gpu)

SHAPES = {"SmolLM2-135M": "smollm2-135m", "Mistral-7B": "mistral-7b"}
# (label, gemv_version, fuse_norm): the decode step's versions, the first (the lab's) to the shipped one
CONFIGS = [("v2, norm separate", 2, False), ("v2 + norm fused (v3)", 2, True),
           ("v4, norm separate", 4, False), ("v4 + norm fused (default)", 4, True)]
# Measured on an H200 (2026-11-29, CuPy 14.2; the copy bandwidth is in lessons/BENCHMARKS.md), quoted for the
# estimate the CPU can make; the GPU parts measure both on your GPU.
QUOTED_LAUNCH_US, QUOTED_COPY_BW = 10.0, 4.25e12


# NEW: launches per token, from the engine's own decode step ------------------------------------------
def layer_split(config, version: int, fuse: bool) -> tuple[int, int]:
    """(launches per layer, launches outside the layers) of one decode step."""
    with_layers = len(record_decode_launches(config, version, fuse))
    without = len(record_decode_launches(_layers(config, 0), version, fuse))
    return (with_layers - without) // config.n_layers, without


def _layers(config, n: int):
    import dataclasses
    return dataclasses.replace(config, n_layers=n)


def python_us_per_launch(config, version: int, fuse: bool, repeats: int) -> Spread:
    """µs the engine's Python spends per launch (Kernels wrappers, argument packing), without CuPy or the
    driver: the recorded decode step over `repeats` runs, each divided by its launches."""
    step, launches = recording_decode_step(config, version, fuse)
    samples = []
    for _ in range(repeats):
        launches.clear()
        start = time.perf_counter()
        step()
        samples.append(1e6 * (time.perf_counter() - start) / len(launches))
    return Spread(tuple(samples))


def weights_read_per_token(config) -> int:
    """fp16 bytes one decode step streams: every matrix once (the LM head too), one embedding row."""
    upload = transfer_bytes_reference(config, 2)[0]
    return upload if config.tie_embeddings else upload - config.vocab_size * config.dim * 2
# -------------------------------------------------------------------------------------------------------


# NEW: on the GPU: one launch, eager vs in a graph -------------------------------------------------------
def launch_costs(n: int) -> dict[str, float]:
    """µs per launch of an empty kernel and of a one-element CuPy add, n in a row: host time to queue
    them, wall time until they finished, and the same n empty kernels replayed as one CUDA graph."""
    import cupy as cp
    empty = cp.RawKernel(r'extern "C" __global__ void nothing() {}', "nothing")
    a = cp.zeros(1, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    out = {}
    with stream:
        for name, launch in (("empty kernel", lambda: empty((1,), (32,), ())), ("CuPy a += 1", lambda: a.__iadd__(1))):
            launch()                                            # compile / warm up
            stream.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                launch()
            queued = time.perf_counter() - start
            stream.synchronize()
            out[f"{name}: host µs to queue"] = 1e6 * queued / n
            out[f"{name}: wall µs"] = 1e6 * (time.perf_counter() - start) / n
        stream.begin_capture()                                  # record n launches; nothing runs yet
        for _ in range(n):
            empty((1,), (32,), ())
        graph = stream.end_capture()
        graph.launch(stream)                                    # the first replay uploads the graph
        stream.synchronize()
        start = time.perf_counter()
        graph.launch(stream)
        stream.synchronize()
        out["empty kernel in a graph: wall µs"] = 1e6 * (time.perf_counter() - start) / n
    return out


def decode_timings(preset: str, n_tokens: int) -> list[dict]:
    """For each configuration: launches counted on the GPU, µs per token eager and with the graph, host µs
    to queue one eager step, and GPU µs of one graph replay. Random fp16 weights made on the device."""
    import cupy as cp
    from minillm.cuda.dev.lab import LabTransformer
    from minillm.cuda.gpu_model import GPUTransformer
    cfg = PRESETS[preset].config
    start = time.perf_counter()
    gpu = GPUTransformer.random(cfg, "float16", seed=0)
    print(f"  {preset}: random fp16 weights made on the device in {time.perf_counter() - start:.1f} s "
          f"({gpu.weight_bytes / 1e9:.2f} GB read per token)")
    cache = gpu.new_cache(n_tokens + 8)
    rows = []
    for label, version, fuse in CONFIGS:
        run = LabTransformer.of(gpu, gemv_version=version, fuse_norm=fuse)   # same weights, that step's kernels
        counted = []

        def count(name, launch):
            counted.append(name)
            launch()
        with run.stream:                                        # one eager step, every launch counted
            run.step.set(np.array([1, 0], dtype=np.int32))
            run.k.timer = count
            try:
                run.decode_step(cache)
            finally:
                run.k.timer = None
            run.stream.synchronize()
        expected = len(record_decode_launches(cfg, version, fuse, capacity=cache.max_seq_len))
        if len(counted) != expected:
            raise AssertionError(f"{label}: {len(counted)} launches on the GPU, the CPU recording says {expected}")
        per_token = {mode: token_us(run.with_options(use_graph=mode), cache, n_tokens)      # graph off, on
                     for mode in (False, True)}
        rows.append(dict(label=label, launches=len(counted), eager=per_token[False], graph=per_token[True],
                         queue=queue_us(run, cache), replay=replay_us(run, cache),
                         python=python_us_per_launch(cfg, version, fuse, 5).median))
    del gpu, cache
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def token_us(gpu, cache, n: int) -> float:
    """Median µs of gpu.decode (step buffer up, the step, logits down, sync), after 3 warm-up tokens
    (with gpu.use_graph, the first decode captures the graph)."""
    cache.reset()
    for _ in range(3):
        gpu.decode(1, cache)
    cache.reset()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        gpu.decode(1, cache)                         # a fixed token: the step alone, no sampling
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def queue_us(gpu, cache, reps: int = 7) -> float:
    """Median host µs to queue one eager decode step (no sync inside: what Python and the driver cost)."""
    samples = []
    with gpu.stream:
        for _ in range(reps):
            gpu.stream.synchronize()
            start = time.perf_counter()
            gpu.decode_step(cache)
            samples.append(time.perf_counter() - start)
        gpu.stream.synchronize()
    return 1e6 * statistics.median(samples)


def replay_us(gpu, cache, reps: int = 7) -> float:
    """Median GPU µs of one replay of this cache's captured graph (CUDA events around the launch)."""
    import cupy as cp
    samples = []
    with gpu.stream:
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(gpu.stream)
            cache.graph.launch(gpu.stream)
            end.record(gpu.stream)
            end.synchronize()
            samples.append(1e3 * cp.cuda.get_elapsed_time(start, end))
    return statistics.median(samples)
# -------------------------------------------------------------------------------------------------------


def main():
    small = quick()
    n_tokens = 8 if small else 64

    # 1. Launches per token, counted on the CPU from the engine's decode step.
    rows, python_us = [], {}
    for shape, preset in SHAPES.items():
        cfg = PRESETS[preset].config
        for label, version, fuse in CONFIGS:
            n = len(record_decode_launches(cfg, version, fuse))
            per_layer, outside = layer_split(cfg, version, fuse)
            spread = python_us_per_launch(cfg, version, fuse, 3 if small else 10)
            python_us[shape, label] = us = spread.median
            rows.append([shape, label, n, f"{per_layer} x {cfg.n_layers}", outside, spread.format(1, 1),
                         f"{us * n:.0f}"])
    print_table("Lesson 13 — kernel launches per decoded token (GPUTransformer.decode_step, recorded on the CPU)",
                ["shape", "configuration", "launches/token", "per layer", "outside layers",
                 "engine Python µs/launch", "engine Python µs/token"], rows)
    print("'engine Python' is minillm's own launch code (argument checks, packing) timed on this CPU with the\n"
          "launch itself replaced by a recorder: CuPy's and the driver's share of a launch comes on top.\n"
          f"µs/launch: median (min-max) of the runs; {load_line()}")

    mistral = PRESETS["mistral-7b"].config
    kinds = [Counter(name.split()[0] for name in record_decode_launches(mistral, v, f))
             for v, f in ((2, False), (4, True))]
    names = sorted(set(kinds[0]) | set(kinds[1]), key=lambda k: (-kinds[0][k] - kinds[1][k], k))
    print_table("which kernels: Mistral-7B, first version (v2) vs default (v4 + fused norm)",
                ["kernel", "v2 launches", "v4 launches"],
                [[k, kinds[0][k] or "-", kinds[1][k] or "-"] for k in names] +
                [["total", sum(kinds[0].values()), sum(kinds[1].values())]])

    # 2. The estimate the CPU can make, from numbers measured on an H200 (quoted, not measured here).
    est = []
    for shape, preset in SHAPES.items():
        cfg = PRESETS[preset].config
        n = len(record_decode_launches(cfg, 4, True))
        gpu_us = 1e6 * weights_read_per_token(cfg) / QUOTED_COPY_BW
        host_us = n * QUOTED_LAUNCH_US
        est.append([shape, n, f"{weights_read_per_token(cfg) / 1e6:,.0f}", f"{gpu_us:,.0f}", f"{host_us:,.0f}",
                    "host (launches)" if host_us > gpu_us else "GPU (memory)"])
    print_table(f"estimate, v4 default: GPU floor = bytes / {QUOTED_COPY_BW / 1e12:.2f} TB/s, host = launches x "
                f"{QUOTED_LAUNCH_US:.0f} µs (both measured on an H200 and quoted: not measured here)",
                ["shape", "launches", "MB read/token", "GPU floor µs/token", "host µs/token (eager)",
                 "eager is bound by"], est)
    print("Eager, the host queues launch n + 1 while the GPU runs launch n: a token costs about max(host, GPU).\n"
          "A graph turns the host's share into one launch, so a small, host-bound model gains most; a 7B model\n"
          "is memory-bound and gains only the gaps between its kernels. The GPU floor is only a floor: each\n"
          "kernel also takes a few µs however little it reads (lesson 12), which the GPU parts measure.")

    # 3. On a GPU: measured.
    measured = {}

    def one_launch():
        costs = launch_costs(200 if small else 2000)
        measured["launch"] = costs
        print_table(f"one launch, {200 if small else 2000} in a row (µs per launch)", ["what", "µs"],
                    [[k, f"{v:.2f}"] for k, v in costs.items()])
        eager, graph = costs["empty kernel: wall µs"], costs["empty kernel in a graph: wall µs"]
        print(f"an empty kernel costs {eager:.2f} µs launched from Python and {graph:.2f} µs inside a graph: "
              f"the graph saves {eager - graph:.2f} µs a launch")

    def decode_part(shape: str):
        def run():
            if small and shape == "Mistral-7B":
                print("  quick run: the Mistral-7B shape (14.5 GB of random weights) is skipped; run without "
                      "MINILLM_LESSON_QUICK")
                return
            timings = decode_timings(SHAPES[shape], n_tokens)
            measured[shape] = timings
            print_table(f"{shape} shape, fp16, batch 1: µs per token, median of {n_tokens} tokens (a fixed token, "
                        f"so no sampling; each includes the step buffer up, logits down and a sync)",
                        ["configuration", "launches", "eager µs", "graph µs", "saved µs/token", "saved µs/launch",
                         "host µs to queue (eager)", "GPU µs (graph replay)", "graph tok/s"],
                        [[r["label"], r["launches"], f"{r['eager']:.0f}", f"{r['graph']:.0f}",
                          f"{r['eager'] - r['graph']:.0f}", f"{(r['eager'] - r['graph']) / r['launches']:.2f}",
                          f"{r['queue']:.0f}", f"{r['replay']:.0f}", f"{1e6 / r['graph']:.0f}"] for r in timings])
            d = timings[-1]
            bound = "host-bound" if d["queue"] > d["replay"] else "GPU-bound"
            print(f"default config eager: queueing takes {d['queue']:.0f} µs ({d['queue'] / d['launches']:.1f} µs a "
                  f"launch, of which the engine's Python {d['python']:.1f}) vs {d['replay']:.0f} µs of GPU work: "
                  f"{bound}; the launch counts matched the CPU recording.")
        return run

    failed = run_gpu_parts([("what one launch costs: eager from Python vs replayed in a CUDA graph", one_launch),
                            ("decode step, SmolLM2-135M shape: eager vs CUDA graph, per configuration",
                             decode_part("SmolLM2-135M")),
                            ("decode step, Mistral-7B shape: eager vs CUDA graph, per configuration",
                             decode_part("Mistral-7B"))])

    summary = []
    for shape in SHAPES:
        n = len(record_decode_launches(PRESETS[SHAPES[shape]].config, 4, True))
        r = next((t for t in measured.get(shape, []) if t["label"].endswith("(default)")), None)
        if r is None:
            why = "skipped (no GPU)" if why_no_gpu() else ("failed" if failed else "not measured")
            summary.append([shape, n, why, why, why])
        else:
            summary.append([shape, n, f"{r['eager']:.0f}", f"{r['graph']:.0f}",
                            f"{(r['eager'] - r['graph']) / r['launches']:.2f}"])
    print_table("what the CUDA graph saves (v4 + fused norm, the engine's default)",
                ["shape", "launches/token", "eager µs/token", "graph µs/token", "saved µs/launch"], summary)
    if failed:
        sys.exit(f"GPU parts failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
