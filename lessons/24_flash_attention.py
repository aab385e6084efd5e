"""Lesson 24 — FlashAttention: attention in tiles, with a running max, a running sum and a rescaled accumulator.

Read it after lesson 03 (prefill vs decode). Prefill attention computes softmax(q·Kᵀ/√d)·V for T
queries against T keys. Written plainly, it builds the T×T score matrix, softmaxes it and multiplies
by V: on a GPU the scores go to HBM and come back twice, and at long prompts they are the largest
array in the model. FlashAttention (Dao et al., 2022) never builds it: it walks the keys in tiles and
keeps, per query row, three things: the largest score seen (m), the sum of exp(score - m) (l), and
the sum of exp(score - m)·v (acc). When a tile brings a larger max, l and acc are rescaled by
exp(m_old - m_new), so each key is touched once and the result is exact (not an approximation).

This lesson writes those tiles in NumPy and checks them against minillm's attention; measures the
memory the T×T matrix would take; counts the HBM bytes of the naive and the tiled versions; and maps
the NumPy loops onto kernels/prefill_attention.cu (thread blocks, warps, shared memory). On a GPU it
times that kernel, and the same tiles on the tensor cores (kernels/prefill_attention_mma.cu, what the
engine prefills with), against a naive one. Exercise 24 writes the merge of two partial results.

Run: python lessons/24_flash_attention.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 03 (prefill)",
        "lesson 04 (softmax)",
    ],
    "objectives": [
        "compute attention over key tiles with a running max, running sum and rescaled accumulator",
        "measure peak memory against the full T×T table",
        "count the global-memory bytes of naive, one-query and tiled kernels",
    ],
    "study_time": "60 min, plus 30 min for exercise 24 (merging softmax partials)",
    "check_questions": [
        "Why can the softmax be normalized once at the end instead of per tile?",
        "Which bytes does tiling save, and which re-reads does a bigger query tile cut?",
    ],
    "try_this": [
        "change the tile sizes in the accuracy table and check the error stays below 1e-6",
        "on a GPU: compare the fp32 FMA tiles with the tensor-core kernel at T = 4096",
    ],
}
import math
import os
import re
import sys
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import print_table, quick, run_gpu_parts, save_plot
from minillm.course.measure import load_line
from minillm.model.attention import attend, grouped_attention

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "prefill_attention.cu"


# NEW: attention in tiles over keys: running max m, running sum l, rescaled accumulator acc -------------
def flash_attention(q, k, v, q_tile=32, k_tile=32, sliding_window=None, traffic=None):
    """softmax(q·kᵀ/√d + mask)·v without ever holding more than a [q_tile, k_tile] block of scores.

    q: [T, n_heads, hd] (the last T of L positions)   k, v: [n_kv, L, hd]   -> [T, n_heads * hd]
    Rows are (token, query head of one KV head's group), as in prefill_attention.cu. `traffic`, a
    dict, counts the bytes each tile would move between HBM and the chip (fp32 q/out, k/v as given)."""
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    group = n_heads // n_kv
    rows = (q / math.sqrt(hd)).reshape(T, n_kv, group, hd).transpose(1, 0, 2, 3).reshape(n_kv, T * group, hd)
    row_pos = (L - T) + np.arange(T * group) // group          # [T*group] each row's absolute position
    out = np.empty_like(rows)                                   # [n_kv, T*group, hd]
    for h in range(n_kv):                                       # the kernel's grid.y
        for r0 in range(0, T * group, q_tile):                  # the kernel's grid.x: one thread block
            qt, pos = rows[h, r0:r0 + q_tile], row_pos[r0:r0 + q_tile]          # [Br, hd], [Br]
            m = np.full(len(qt), -np.inf, np.float32)          # running max per row
            l = np.zeros(len(qt), np.float32)                   # running sum of exp(s - m)
            acc = np.zeros_like(qt)                             # running sum of exp(s - m)·v   [Br, hd]
            lo = 0 if sliding_window is None else max(0, pos[0] - sliding_window + 1)
            for k0 in range(lo, pos[-1] + 1, k_tile):           # only key tiles some row may see
                kt, vt = k[h, k0:min(k0 + k_tile, pos[-1] + 1)], v[h, k0:min(k0 + k_tile, pos[-1] + 1)]
                s = qt @ kt.T                                   # [Br, Bc] this tile's scores, on chip
                k_pos = np.arange(k0, k0 + len(kt))
                seen = k_pos[None, :] <= pos[:, None]           # causal
                if sliding_window is not None:
                    seen &= k_pos[None, :] > pos[:, None] - sliding_window
                s = np.where(seen, s, -np.inf)
                m_new = np.maximum(m, s.max(axis=1))            # [Br]
                safe = np.where(m_new == -np.inf, 0.0, m_new)   # a row that has seen nothing stays at 0
                corr = np.exp(m - safe)                         # exp(m_old - m_new) <= 1: rescale the past
                p = np.exp(s - safe[:, None])                   # [Br, Bc], each <= 1: never overflows
                l = l * corr + p.sum(axis=1)
                acc = acc * corr[:, None] + p @ vt              # [Br, hd]
                m = m_new
                if traffic is not None:
                    traffic["k, v tiles"] = traffic.get("k, v tiles", 0) + kt.nbytes + vt.nbytes
            out[h, r0:r0 + q_tile] = acc / l[:, None]           # normalize once, at the end
            if traffic is not None:
                traffic["q, out"] = traffic.get("q, out", 0) + 2 * qt.nbytes
    return out.reshape(n_kv, T, group, hd).transpose(1, 0, 2, 3).reshape(T, n_heads * hd)


# NEW: the HBM bytes of each way, counted from the shapes --------------------------------------------------
def naive_traffic(T, n_heads, n_kv, hd, kv_bytes=2):
    """Three kernels (scores = q·kᵀ; softmax; p·v), the [H, T, T] fp32 table through HBM in between:
    q, k read; S written; S read, P written; P, v read; out written."""
    table = n_heads * T * T * 4
    return {"q, out": 2 * T * n_heads * hd * 4, "k, v tiles": 2 * n_kv * T * hd * kv_bytes,
            "score table": 4 * table}


def tiled_traffic(T, n_heads, n_kv, hd, q_tile, k_tile, kv_bytes=2):
    """flash_attention's loop, shapes only: each block reads its q tile once, every key tile its rows
    may see once, and writes its output once. q_tile = 1 is the decode kernel used for prefill."""
    group = n_heads // n_kv
    kv = 0
    for r0 in range(0, T * group, q_tile):
        last = (min(r0 + q_tile, T * group) - 1) // group       # the tile's last token sees keys 0..last
        kv += 2 * (last + 1) * hd * kv_bytes
    return {"q, out": 2 * T * n_heads * hd * 4, "k, v tiles": n_kv * kv, "score table": 0}


# NEW: what the kernel's tiles are: its #defines, and the shared memory they take ----------------------
def kernel_tiles() -> dict[str, int]:
    """PF_ROWS, PF_WARPS, PF_KT as #defined in kernels/prefill_attention.cu (read, not copied)."""
    text = KERNEL.read_text()
    return {name: int(re.search(rf"#define {name} (\d+)", text).group(1)) for name in ("PF_ROWS", "PF_WARPS", "PF_KT")}


def shared_bytes(HD: int, rows: int, warps: int, kt: int) -> dict[str, int]:
    """The kernel's __shared__ arrays for head-dim bound HD: Qs fp32, Ks/Vs 16-bit, Ps fp32."""
    return {"Qs (q tile, fp32)": rows * HD * 4, "Ks (key tile, 16-bit, padded)": kt * (HD + 4) * 2,
            "Vs (value tile, 16-bit)": kt * HD * 2, "Ps (probabilities, fp32)": warps * (rows // warps) * kt * 4}


def peak_bytes(fn) -> int:
    """Peak bytes NumPy allocated while fn() ran (tracemalloc sees NumPy's buffers)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def mb(n: float) -> str:
    return f"{n / 2**20:,.1f}"


# ---------------------------------------------------------------------------------------------------------

def gpu_tiled_vs_naive() -> None:
    """prefill_attention.cu (fp32 FMAs) and prefill_attention_mma.cu (tensor cores) vs the decode kernel
    used for prefill vs a naive three-step CuPy attention."""
    import cupy as cp
    from minillm.cuda.dev.lab import LabKernels, lab_settings
    from minillm.cuda.timing import time_gpu
    k = LabKernels("float16", lab_settings(prefill_attention_version=1))   # the tiles on fp32 FMAs (the lab's)
    k_mma = k.with_settings(prefill_attention_version=2)                   # the same tiles on tensor cores
    H, n_kv, hd = 32, 8, 128                                   # Mistral-7B's attention layout
    group, rng = H // n_kv, np.random.default_rng(0)
    rows = []
    for T in ((128, 512) if quick() else (512, 2048, 4096)):
        qkv = cp.asarray(rng.standard_normal((T, (H + 2 * n_kv) * hd), dtype=np.float32))
        kc = cp.asarray(rng.standard_normal((n_kv, T, hd)).astype(np.float16))
        vc = cp.asarray(rng.standard_normal((n_kv, T, hd)).astype(np.float16))
        pos = cp.zeros(1, cp.int32)
        out = {name: cp.empty((T, H * hd), cp.float32) for name in ("tiled", "mma", "decode", "naive")}
        parts = (cp.empty((T, H, 1), cp.float32), cp.empty((T, H, 1), cp.float32), cp.empty((T, H, 1, hd), cp.float32))
        kf, vf = kc.astype(cp.float32), vc.astype(cp.float32)
        mask = cp.triu(cp.full((T, T), -cp.inf, cp.float32), k=1)

        def tiled():
            k.prefill_attention(qkv, T, H, n_kv, hd, kc, vc, pos, None, out["tiled"])

        def mma():
            k_mma.prefill_attention(qkv, T, H, n_kv, hd, kc, vc, pos, None, out["mma"])

        def decode():
            k.attention(qkv, T, H, n_kv, hd, kc, vc, pos, None, parts, out["decode"])

        def naive():                                           # the [n_kv, T*group, T] table lives in HBM
            q = qkv[:, :H * hd].reshape(T, n_kv, group, hd).transpose(1, 0, 2, 3).reshape(n_kv, T * group, hd)
            s = (q @ kf.transpose(0, 2, 1)) * np.float32(1 / math.sqrt(hd))          # [n_kv, T*group, T]
            s = s.reshape(n_kv, T, group, T) + mask[None, :, None, :]
            s = cp.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            o = s.reshape(n_kv, T * group, T) @ vf                                     # [n_kv, T*group, hd]
            out["naive"][:] = o.reshape(n_kv, T, group, hd).transpose(1, 0, 2, 3).reshape(T, H * hd)
        fns = (("tiled", tiled), ("mma", mma), ("decode", decode), ("naive", naive))
        times = {name: time_gpu(fn, reps=5) for name, fn in fns}
        want = cp.asnumpy(out["naive"])
        err = max(float(np.abs(cp.asnumpy(out[n]) - want).max()) for n in ("tiled", "mma", "decode"))
        flops = 4 * H * hd * T * (T + 1) / 2                   # q·k and p·v over the causal half
        rows.append([T, f"{times['tiled'] * 1e3:,.0f}", f"{times['mma'] * 1e3:,.0f}", f"{times['decode'] * 1e3:,.0f}",
                     f"{times['naive'] * 1e3:,.0f}", f"{times['decode'] / times['tiled']:.1f}x",
                     f"{times['tiled'] / times['mma']:.1f}x", f"{times['naive'] / times['tiled']:.1f}x",
                     f"{flops / times['tiled'] / 1e9:.2f}", f"{flops / times['mma'] / 1e9:.1f}", mb(H * T * T * 4),
                     f"{err:.1e}"])
    print_table("one layer of prefill attention, Mistral-7B heads (32 query / 8 KV, hd 128), fp16 K/V, µs (CUDA events)",
                ["T", "tiled, fp32 FMAs", "tiled, tensor cores", "decode kernel, a query a block",
                 "naive (T×T in HBM)", "decode / tiled", "FMAs / tensor cores", "naive / tiled", "FMA TFLOP/s",
                 "tensor-core TFLOP/s", "naive table MiB", "max |diff|"], rows)
    print(f"At T = {rows[-1][0]} the tiles on fp32 FMAs are {rows[-1][5]} the decode kernel's speed and {rows[-1][7]} the\n"
          f"naive one's, without its {rows[-1][10]} MiB table, at {rows[-1][8]} TFLOP/s against an fp32 peak of about 67:\n"
          f"arithmetic, not bytes, is their limit. The same tiles on the tensor cores (prefill_attention_mma.cu:\n"
          f"mma.sync m16n8k16, Q and P rounded to 16 bits, fp32 accumulators) run {rows[-1][6]} faster; the engine\n"
          "prefills with them where head_dim is 64 or 128: TTFT 512 19.5 -> 14.6 ms on the H200.")


def main():
    small = quick()
    rng = np.random.default_rng(0)

    # 1. The tiles are exact: equal to minillm's attention at several T and tile sizes.
    rows = []
    H, n_kv, hd = 9, 3, 64                                       # SmolLM2-135M's attention layout
    cases = [(1, 0, 32, 32, None), (7, 0, 16, 16, None), (64, 0, 32, 32, None), (100, 28, 32, 16, None),
             (200, 0, 64, 128, None), (200, 0, 32, 32, 48)] + ([] if small else [(512, 0, 32, 32, None),
                                                                                (512, 0, 128, 64, None)])
    for T, cached, qt, kt, window in cases:
        L = cached + T
        q = rng.standard_normal((T, H, hd)).astype(np.float32)
        k, v = (rng.standard_normal((n_kv, L, hd)).astype(np.float32) for _ in range(2))
        want = attend(q, k, v, window)
        got = flash_attention(q, k, v, qt, kt, window)
        err = float(np.abs(got - want).max())
        assert err < 1e-5, f"tiled attention differs from attend by {err} at T={T}"
        rows.append([T, cached, qt, kt, window or "-", f"{err:.1e}", "yes" if err < 1e-5 else "NO"])
    print_table("Lesson 24 — FlashAttention in NumPy vs minillm.model.attention.attend (SmolLM2 heads: 9 query, "
                "3 KV, hd 64)", ["T (queries)", "cached keys", "query tile", "key tile", "window",
                                 "max |tiled - attend|", "< 1e-5"], rows)

    # 2. The memory it avoids: the T×T score table, measured at growing T.
    rows, peaks = [], []
    for T in ((128, 256, 512) if small else (256, 1024, 2048, 4096)):
        q = rng.standard_normal((T, 2, 64)).astype(np.float32)
        k, v = (rng.standard_normal((1, T, 64)).astype(np.float32) for _ in range(2))
        whole = peak_bytes(lambda: attend(q, k, v))
        blocked = peak_bytes(lambda: grouped_attention(q, k, v))
        start = time.perf_counter()
        tiled = peak_bytes(lambda: flash_attention(q, k, v, 64, 64))
        tiled_s = time.perf_counter() - start
        peaks.append((T, whole, blocked, tiled))
        rows.append([T, mb(2 * T * T * 4), mb(whole), mb(blocked), mb(tiled), f"{whole / tiled:.0f}x",
                     f"{tiled_s * 1e3:.0f}"])
    print_table("peak NumPy memory of one attention call (2 query heads, 1 KV head, hd 64), MiB (tracemalloc)",
                ["T", "scores T×T×heads fp32", "attend (whole table)", "grouped_attention (128-query blocks)",
                 "tiled 64×64", "attend / tiled", "tiled ms (Python loop)"], rows)
    print(f"tiled ms: one run each, under tracemalloc (slower than without it); {load_line()}")
    print("The whole table grows as T²; minillm's CPU prefill (grouped_attention) already cuts it to 128 query rows\n"
          "× T keys, which grows as T; tiling the keys too leaves a constant [64, 64] block plus the output.\n"
          "In NumPy the tiles cost a Python loop per tile: on a CPU the point is the memory, on a GPU the bytes.")

    # 3. HBM traffic, counted: naive vs tiled (Mistral-7B layer shapes, fp16 K/V, fp32 q and out).
    tiles = kernel_tiles()
    counted = {}
    T0 = 64
    q = rng.standard_normal((T0, 32, 128)).astype(np.float32)
    k16, v16 = (rng.standard_normal((8, T0, 128)).astype(np.float16) for _ in range(2))
    flash_attention(q, k16, v16, tiles["PF_ROWS"], tiles["PF_KT"], traffic=counted)
    formula = tiled_traffic(T0, 32, 8, 128, tiles["PF_ROWS"], tiles["PF_KT"])
    assert counted["k, v tiles"] == formula["k, v tiles"], (counted, formula)
    rows = []
    for T in ((512, 2048) if small else (512, 2048, 8192, 32768)):
        ways = {"naive: three kernels, T×T table in HBM": naive_traffic(T, 32, 8, 128),
                "a query row a block (the decode kernel in prefill)": tiled_traffic(T, 32, 8, 128, 1, tiles["PF_KT"]),
                "tiled, 128 rows × 64 keys (FlashAttention-2's larger tiles)": tiled_traffic(T, 32, 8, 128, 128, 64),
                f"tiled, {tiles['PF_ROWS']} rows × {tiles['PF_KT']} keys (prefill_attention.cu)":
                    tiled_traffic(T, 32, 8, 128, tiles["PF_ROWS"], tiles["PF_KT"])}
        tiled_total = sum(list(ways.values())[-1].values())
        for name, t in ways.items():
            total = sum(t.values())
            rows.append([T, name, mb(t["q, out"]), mb(t["k, v tiles"]), mb(t["score table"]), mb(total),
                         f"{total / tiled_total:.1f}x"])
    print_table(f"global-memory bytes of one layer's prefill attention (HBM when no re-read hits L2), Mistral-7B "
                f"heads (32 query / 8 KV, hd 128), MiB (counted while computing at T={T0}: equal to the formula)",
                ["T", "way", "q + out", "K/V reads", "score table", "total", "vs tiled"], rows)
    print("The naive way moves 16·H·T² bytes of scores (write S, read S, write P, read P); the tiled way none,\n"
          "but each query tile re-reads every key it may see: about H·T²·hd·2/rows bytes, so larger query\n"
          "tiles read less (FlashAttention's IO count, T²·d²/SRAM). One query per block reads each key 32\n"
          "times more than a tile of 32 rows; most of those re-reads hit L2 (one KV head's K/V at T = 2048 is\n"
          "1 MiB), which is why that kernel's prefill was slow, yet not 30x slower (lessons/BENCHMARKS.md).")

    # 4. The same tiles on a GPU: how prefill_attention.cu maps them.
    rows_, warps, kt = tiles["PF_ROWS"], tiles["PF_WARPS"], tiles["PF_KT"]
    print_table(f"flash_attention (this lesson) -> kernels/prefill_attention.cu (PF_ROWS {rows_}, PF_WARPS {warps}, "
                f"PF_KT {kt})", ["in NumPy", "in the kernel"],
                [["for h in range(n_kv)", "blockIdx.y: one KV head (its group's query heads share its K/V)"],
                 [f"for r0 in range(0, T*group, {rows_}): a query tile",
                  f"blockIdx.x: one thread block of {32 * warps} threads ({warps} warps × {rows_ // warps} rows each)"],
                 ["qt = rows[h, r0:r0+32] / √d", "Qs[32][HD] fp32 in shared memory, scaled once"],
                 [f"for k0 in range(lo, last + 1, {kt}): a key tile",
                  f"{kt} keys of K and V staged in shared memory (Ks, Vs, 16-bit), then __syncthreads()"],
                 ["s = qt @ kt.T", f"lane j computes key j's score for its warp's {rows_ // warps} rows"],
                 ["m_new = max(m, s.max(1)); p.sum(1)", "warp_max, warp_sum: shuffles across the 32 lanes"],
                 ["corr = exp(m - m_new); l, acc rescaled", "m[8], l[8], acc[8][HD/32] in each lane's registers"],
                 ["acc += p @ vt", "p to shared memory (Ps), lane d adds p·v for dims d, d+32, ..."],
                 ["out = acc / l", "one write per row, at the end: the T×T table never exists"]])
    shapes = [("SmolLM2-135M", 9, 3, 64), ("Mistral-7B", 32, 8, 128)]
    rows = []
    for name, Hq, kvh, d in shapes:
        HD = next(b for b in (32, 64, 128) if d <= b)
        smem = shared_bytes(HD, rows_, warps, kt)
        T = 512
        grid = (math.ceil(T * (Hq // kvh) / rows_), kvh)
        rows.append([name, f"{Hq}/{kvh}/{d}", f"{grid[0]} × {grid[1]} = {grid[0] * grid[1]}",
                     f"{rows_} rows = {rows_ / (Hq // kvh):.3g} tokens × {Hq // kvh} heads",
                     " + ".join(f"{v:,}" for v in smem.values()), f"{sum(smem.values()):,}"])
    print_table("the launch at T = 512, and shared memory per block (Qs + Ks + Vs + Ps; the static limit is 49,152 B)",
                ["model", "heads q/kv/hd", "grid (query tiles × KV heads)", "a tile is", "shared bytes",
                 "total"], rows)

    failed = run_gpu_parts([("the tiled kernels (FMAs, tensor cores) vs the decode kernel vs naive attention, one layer",
                             gpu_tiled_vs_naive)])

    def draw(ax):
        T = [p[0] for p in peaks]
        for i, label in ((1, "attend (T×T table)"), (2, "grouped_attention (128-row blocks)"), (3, "tiled 64×64")):
            ax.plot(T, [p[i] / 2**20 for p in peaks], marker="o", label=label)
        ax.set_xscale("log", base=2), ax.set_yscale("log")
        ax.set_xlabel("T (queries = keys)"), ax.set_ylabel("peak MiB"), ax.legend()
        ax.set_title("Lesson 24: memory of one attention call")
    save_plot("24_flash_attention_memory.png", draw)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
