"""Lesson 03 — prefill vs decode: two phases with different bottlenecks, placed on this machine's roofline.

With the cache from lesson 02, generation has two phases. Prefill runs P prompt positions at once:
big matrix-matrix products that reuse each weight P times (compute-bound, sets time-to-first-token).
Decode runs one position: matrix-vector products that read every weight for 2 FLOPs (memory-bound,
sets the inter-token latency). Arithmetic intensity (FLOPs per byte moved) tells which limit applies;
the roofline of this machine (measured matmul FLOP/s and memory bandwidth) says how fast each can go.

Run: python lessons/03_prefill_vs_decode.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.tools.bench import copy_bandwidth, gemv_bandwidth, matmul_flops, prefill_flops
from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.resources import reference


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
    # take a second): a 16 MB GEMV would stream from cache and put the ridge anywhere.
    peak_flops = matmul_flops(n=1536)
    gemv_bw = gemv_bandwidth(nbytes=256 << 20)
    copy_bw = copy_bandwidth(nbytes=256 << 20)
    ridge = peak_flops / gemv_bw                                         # FLOP/byte where the roof bends

    lengths, n_decode = ([4, 16], 2) if small else ([16, 64, 256, 512], 6)
    rng = np.random.default_rng(0)
    model.prefill([1, 2], model.new_cache(2))                            # warm up (first touch of the weights)
    rows, points = [], []
    for n in lengths:
        prompt = rng.integers(100, cfg.vocab_size, n).tolist()
        ttft, itl = min(time_phases(model, prompt, n_decode) for _ in range(1 if small else 2))
        p_flops, p_ai = prefill_intensity(model, n)
        d_flops, d_ai = decode_intensity(model, n)
        points.append((n, p_ai, p_flops / ttft, d_ai, d_flops / itl))
        rows.append([n, f"{ttft * 1e3:.0f}", f"{n / ttft:.0f}", f"{itl * 1e3:.1f}", f"{1 / itl:.1f}",
                     f"{p_ai:.1f}", f"{d_ai:.2f}", f"{p_flops / ttft / 1e9:.1f}",
                     f"{decode_bytes_per_token(model, n) / itl / 1e9:.1f}"])

    print_table("Lesson 03 — this machine's roofline (measured with NumPy)",
                ["ceiling", "value"],
                [["fp32 matmul", f"{peak_flops / 1e9:.1f} GFLOP/s"],
                 ["fp32 GEMV stream (decode's bandwidth)", f"{gemv_bw / 1e9:.1f} GB/s"],
                 ["copy (read + write)", f"{copy_bw / 1e9:.1f} GB/s"],
                 ["ridge point: matmul / GEMV bandwidth", f"{ridge:.1f} FLOP/byte"],
                 ["weights read per forward pass", f"{weight_bytes(model) / 1e6:.0f} MB"]])
    print_table("prefill (TTFT) vs decode (inter-token latency) as the prompt grows",
                ["prompt tokens", "TTFT ms", "prefill tok/s", "ITL ms", "decode tok/s",
                 "prefill FLOP/B", "decode FLOP/B", "prefill GFLOP/s", "decode GB/s"], rows)
    # the project's own figures for this model (`minillm bench`, 512-token prompt), to set yours beside
    print(reference("cpu.ttft512.smollm2.fp32.1-thread"))
    print(reference("cpu.decode.smollm2.fp32.1-thread"))
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
