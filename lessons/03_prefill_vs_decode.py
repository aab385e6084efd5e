"""Lesson 03 — prefill vs decode: two phases with different bottlenecks, placed on this machine's roofline.

With the cache from lesson 02, generation has two phases. Prefill runs P prompt positions at once:
big matrix-matrix products that reuse each weight P times (compute-bound, sets time-to-first-token).
Decode runs one position: matrix-vector products that read every weight for 2 FLOPs (memory-bound,
sets the inter-token latency). Arithmetic intensity (FLOPs per byte moved) tells which limit applies;
the roofline of this machine (measured matmul FLOP/s and memory bandwidth) says how fast each can go.

Run: python lessons/03_prefill_vs_decode.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 02 (the KV cache)",
        "FLOPs and bytes: a matrix-vector product does 2 FLOPs a weight",
    ],
    "objectives": [
        "measure time to first token and inter-token latency as the prompt grows",
        "compute arithmetic intensity (FLOP/byte) of prefill and decode",
        "place both phases on this machine's measured roofline and say which limit each hits",
    ],
    "study_time": "50 min, plus 20 min for exercise 03 (RoPE)",
    "check_questions": [
        "Why is decode memory-bound at batch 1 while prefill is compute-bound?",
        "If a machine's bandwidth doubles, which of TTFT and ITL improves, and by about how much?",
        "What does a measured point above the roofline tell you about the measurement?",
    ],
    "try_this": [
        "run it twice, once with other programs busy: the load line and the check say how far to trust it",
        "compare your decode tok/s with the reference line printed under the table",
    ],
}
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.tools.bench import copy_bandwidth, gemv_bandwidth, matmul_flops, prefill_flops
from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.resources import reference
from minillm.course.measure import Spread, beside_reference, check, load_average, load_line


def time_phases(model, prompt: list[int], n_decode: int) -> tuple[float, float]:
    """(time to first token, median inter-token latency) in seconds, with lesson 02's cache."""
    cache = model.new_cache(len(prompt) + n_decode)
    start = time.perf_counter()
    token = int(np.argmax(model.prefill(prompt, cache)))
    ttft = time.perf_counter() - start
    steps = []
    for _ in range(n_decode):
        start = time.perf_counter()
        token = int(np.argmax(model.decode(token, cache)))
        steps.append(time.perf_counter() - start)
    return ttft, statistics.median(steps)


# NEW: arithmetic intensity of each phase -----------------------------------------------------------
def weight_bytes(model) -> int:
    """Bytes of weights one forward pass reads (each matrix once, whatever the number of positions)."""
    return sum(a.nbytes for a in model.weights_read_per_token())     # the embedding: only T rows are read

def decode_bytes_per_token(model, context: int) -> int:
    """One decode step reads every weight once, plus the cached K and V of `context` positions."""
    return weight_bytes(model) + model.config.kv_bytes_per_token(4) * context


def prefill_intensity(model, n: int) -> tuple[float, float]:
    """(FLOPs, FLOPs per byte) of prefilling n tokens: the weights are read once for all n rows."""
    cfg = model.config
    flops = prefill_flops(cfg, n)
    moved = weight_bytes(model) + cfg.kv_bytes_per_token(4) * n       # + the K, V it writes
    return flops, flops / moved


def decode_intensity(model, context: int) -> tuple[float, float]:
    """(FLOPs, FLOPs per byte) of one decode step at `context` cached positions."""
    cfg = model.config
    per_layer = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim
    flops = 2 * cfg.n_layers * per_layer + 2 * cfg.vocab_size * cfg.dim    # 2 FLOPs per weight read
    flops += 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context      # attention over the cache
    return flops, flops / decode_bytes_per_token(model, context)          # weights + the cache read
# ---------------------------------------------------------------------------------------------------


def main():
    llm = lesson_model()
    model, cfg = llm.model, llm.config
    small = quick()

    # The machine's two ceilings, measured with NumPy on this machine. Full size even in a quick run (they
    # take a second): a 16 MB GEMV would stream from cache and put the ridge anywhere. They are measured in
    # every round, between the phases (course/measure.py's interleaving), and the best of them is the roof:
    # a ceiling measured while other work ran would sit below what the phases reach in a quieter moment.
    lengths, n_decode = ([4, 16], 2) if small else ([16, 64, 256, 512], 6)
    rounds = 1 if small else 2
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(100, cfg.vocab_size, n).tolist() for n in lengths}
    model.prefill([1, 2], model.new_cache(2))                            # warm up (first touch of the weights)
    load_start = load_average()
    flops_seen, gemv_seen, phases = [], [], {n: [] for n in lengths}
    for _ in range(rounds):
        flops_seen.append(matmul_flops(n=1536, repeats=2))
        gemv_seen.append(gemv_bandwidth(nbytes=256 << 20, repeats=3))
        for n in lengths:
            phases[n].append(time_phases(model, prompts[n], n_decode))  # (ttft, median itl) seconds
    peak_flops, gemv_bw = max(flops_seen), max(gemv_seen)
    copy_bw = copy_bandwidth(nbytes=256 << 20)
    ridge = peak_flops / gemv_bw                                         # FLOP/byte where the roof bends

    rows, points = [], []
    for n in lengths:
        ttfts, itls = Spread(tuple(p[0] for p in phases[n])), Spread(tuple(p[1] for p in phases[n]))
        ttft, itl = ttfts.median, itls.median
        p_flops, p_ai = prefill_intensity(model, n)
        d_flops, d_ai = decode_intensity(model, n)
        points.append((n, p_ai, p_flops / ttft, d_ai, d_flops / itl))
        rows.append([n, ttfts.ms(0), f"{n / ttft:.0f}", itls.ms(), f"{1 / itl:.1f}",
                     f"{p_ai:.1f}", f"{d_ai:.2f}", f"{p_flops / ttft / 1e9:.1f}",
                     f"{decode_bytes_per_token(model, n) / itl / 1e9:.1f}"])

    print_table("Lesson 03 — this machine's roofline (measured with NumPy)",
                ["ceiling", "value"],
                [["fp32 matmul", f"{peak_flops / 1e9:.1f} GFLOP/s"],
                 ["fp32 GEMV stream (decode's bandwidth)", f"{gemv_bw / 1e9:.1f} GB/s"],
                 ["copy (read + write)", f"{copy_bw / 1e9:.1f} GB/s"],
                 ["ridge point: matmul / GEMV bandwidth", f"{ridge:.1f} FLOP/byte"],
                 ["weights read per forward pass", f"{weight_bytes(model) / 1e6:.0f} MB"]])
    print_table(f"prefill (TTFT) vs decode (inter-token latency) as the prompt grows (ms: median (min-max) of "
                f"{rounds} interleaved rounds)",
                ["prompt tokens", "TTFT ms", "prefill tok/s", "ITL ms", "decode tok/s",
                 "prefill FLOP/B", "decode FLOP/B", "prefill GFLOP/s", "decode GB/s"], rows)
    # the project's own figures for this model (`minillm bench`, 512-token prompt), to set yours beside
    if 512 in lengths:
        print(beside_reference("cpu.ttft512.smollm2.fp32.1-thread", Spread(tuple(p[0] for p in phases[512])).median * 1e3))
    else:
        print(reference("cpu.ttft512.smollm2.fp32.1-thread"))
    print(beside_reference("cpu.decode.smollm2.fp32.1-thread", 1 / Spread(tuple(p[1] for p in phases[lengths[0]])).median))
    print(f"{load_line(load_start)}; matmul {min(flops_seen) / 1e9:.1f}-{max(flops_seen) / 1e9:.1f} GFLOP/s and "
          f"GEMV {min(gemv_seen) / 1e9:.1f}-{max(gemv_seen) / 1e9:.1f} GB/s across the rounds")
    # NEW: a point above the roof means the roof was measured low (other work slowed the ceilings) or the
    # phase fast: either way this run cannot place it, and the lesson says so rather than concluding.
    roof = lambda ai: min(peak_flops, ai * gemv_bw)
    above = [f"{kind} at {n} tokens ({achieved / roof(ai):.0%} of the roof)" for n, p_ai, p_f, d_ai, d_f in points
             for kind, ai, achieved in (("prefill", p_ai, p_f), ("decode", d_ai, d_f)) if achieved > roof(ai)]
    check("every phase runs under this machine's roofline", not above,
          "above the roof: " + ", ".join(above) if above else "all points under it")
    def side(ai: float) -> str:                                          # which roof a point sits under
        return "right of the ridge: compute-bound" if ai > ridge else "left of the ridge: memory-bound"
    print(f"ridge {ridge:.1f} FLOP/byte. Decode sits at ~{points[0][3]:.2f} FLOP/byte, {side(points[0][3])}; "
          f"prefill of {lengths[-1]} tokens at {points[-1][1]:.0f} FLOP/byte, {side(points[-1][1])}.")

    def draw(ax):
        ai = np.logspace(-2, 3, 200)
        ax.plot(ai, np.minimum(peak_flops, ai * gemv_bw) / 1e9, "k-", label="roofline (measured)")
        ax.plot([p[1] for p in points], [p[2] / 1e9 for p in points], "o", label="prefill")
        ax.plot([p[3] for p in points], [p[4] / 1e9 for p in points], "s", label="decode")
        for n, p_ai, p_f, d_ai, d_f in points:
            ax.annotate(f"{n}", (p_ai, p_f / 1e9), textcoords="offset points", xytext=(4, -10), fontsize=8)
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP/byte)"), ax.set_ylabel("GFLOP/s")
        ax.set_title("Lesson 03: prefill and decode on this machine's roofline"), ax.legend(), ax.grid(alpha=0.3)
    save_plot("03_roofline.png", draw)


if __name__ == "__main__":
    main()
