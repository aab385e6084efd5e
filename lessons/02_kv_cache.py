"""Lesson 02 — the KV cache: keep every layer's keys and values, and process each new token once.

Lesson 01 pushed the whole prefix through 30 layers for every new token: generating N tokens after
a prompt of P processes about N·P + N²/2 positions (O(N²)). Keys and values of old positions never
change, so the engine stores them (`llm.model.new_cache`), runs the prompt once (`prefill`) and then
one position per token (`decode`): P + N positions (O(N)). The price is memory, which we count.
Exercise 02 writes new positions into the cache; exercise 02.2 attends the new queries over all of it.
With both (and 01, 03), `minillm generate --student DIR` runs SmolLM2 on your own attention layer.

Run: python lessons/02_kv_cache.py      (MINILLM_LESSON_QUICK=1 for a seconds-long smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 01 (the forward pass)",
    ],
    "objectives": [
        "cache keys and values so each new token costs O(N), not O(N²)",
        "price the cache in bytes per token: 2 × layers × KV heads × head_dim × bytes",
        "show cached and recomputed logits agree",
    ],
    "study_time": "40 min, plus 20 min for exercise 02 (the cache write)",
    "check_questions": [
        "Why can the keys and values of old tokens be stored but not the queries?",
        "How many bytes per token does Mistral-7B's cache take in fp16, and which factors set it?",
    ],
    "try_this": [
        "generate longer outputs and compare the speedup of the cache at each length",
        "compute kv_bytes_per_token for another preset (minillm info llama-2-7b)",
    ],
}
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm import PRESETS
from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.course.measure import beside_reference, check, interleaved, load_average, load_line


def generate_naive(model, ids: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """Lesson 01's loop, on the engine's forward: a fresh (throwaway) cache every step."""
    ids, times = list(ids), []
    for _ in range(n_new):
        start = time.perf_counter()
        logits = model.prefill(ids, model.new_cache(len(ids)))          # the whole prefix again
        ids.append(int(np.argmax(logits)))
        times.append(time.perf_counter() - start)
    return ids[-n_new:], times


# NEW: generation with a KV cache ----------------------------------------------------------------
def generate_cached(model, ids: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """Prefill once, then decode one position per token against the cache."""
    cache = model.new_cache(len(ids) + n_new)       # preallocated: [layers, kv_heads, max_seq, head_dim] × 2
    start = time.perf_counter()
    logits = model.prefill(ids, cache)              # P positions, once; the cache now holds P
    new, times = [], []
    for step in range(n_new):
        new.append(int(np.argmax(logits)))
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        if step + 1 < n_new:
            logits = model.decode(new[-1], cache)   # ONE position: its k, v are appended, old ones read
    return new, times


def positions_processed(prompt: int, n_new: int) -> tuple[int, int]:
    """Rows pushed through the layers: (without cache, with cache)."""
    naive = sum(prompt + i for i in range(n_new))   # every step re-runs the prefix: O(N²)
    cached = prompt + (n_new - 1)                   # each position once: O(N)
    return naive, cached


def layer_flops(cfg, new: int, context: int) -> float:
    """Matrix FLOPs of the 30 layers for `new` positions attending to `context` positions in all."""
    weights = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim
    attention = 2 * cfg.n_heads * cfg.head_dim * new * context          # q·kᵀ and weights·v
    return 2 * cfg.n_layers * (weights * new + attention)
# -------------------------------------------------------------------------------------------------


def main():
    llm = lesson_model()
    model, cfg = llm.model, llm.config
    rng = np.random.default_rng(0)
    prompt_len = 8 if quick() else 16
    prompt = rng.integers(100, cfg.vocab_size, prompt_len).tolist()
    model.prefill(prompt[:2], model.new_cache(2))                       # warm up: first touch of the weights

    # 1. Same tokens? Cached decoding must give the naive loop's logits, up to float32 rounding.
    n_check = 3 if quick() else 8
    naive_ids, _ = generate_naive(model, prompt, n_check)
    cached_ids, _ = generate_cached(model, prompt, n_check)
    full = prompt + cached_ids[:-1]
    cache = model.new_cache(len(full))
    model.prefill(full[:-1], cache)
    decoded = model.decode(full[-1], cache)                             # [vocab], from the cache
    recomputed = model.prefill(full, model.new_cache(len(full)))        # [vocab], from scratch
    error = float(np.abs(decoded - recomputed).max())

    # 2. Speed and work against the number of generated tokens. The two loops take turns, round after
    # round (course/measure.py), so other work on the machine slows both alike.
    sweep, rounds = ([4, 8], 1) if quick() else ([8, 24, 40], 2)
    rows, curves, steps = [], {}, {}
    load_start = load_average()
    loops = {"no cache": generate_naive, "KV cache": generate_cached}

    def run(name: str, n: int):
        steps[name] = loops[name](model, prompt, n)[1]                   # per-token times, for the plot
    for n in sweep:
        spreads = interleaved({name: functools.partial(run, name, n) for name in loops}, rounds, warmup=False)
        p_naive, p_cached = positions_processed(prompt_len, n)
        f_naive = sum(layer_flops(cfg, prompt_len + i, prompt_len + i) for i in range(n))
        f_cached = layer_flops(cfg, prompt_len, prompt_len) + sum(
            layer_flops(cfg, 1, prompt_len + i) for i in range(1, n))
        speedup = spreads["no cache"].median / spreads["KV cache"].median
        rows.append([n, f"{p_naive:,}", f"{p_cached:,}", f"{f_naive / 1e9:.1f}", f"{f_cached / 1e9:.1f}",
                     spreads["no cache"].rate(n), spreads["KV cache"].rate(n), f"{speedup:.1f}x"])
        curves = dict(steps)                                             # per-token times of the longest run

    # 3. What the cache costs: bytes per token = 2 (K and V) × layers × kv_heads × head_dim × bytes.
    memory = []
    for name in ["smollm2-135m", "mistral-7b", "llama-2-7b"]:
        c = PRESETS[name].config
        per_token = c.kv_bytes_per_token(2)
        memory.append([f"{name} fp16", c.n_layers, c.n_kv_heads, c.head_dim, f"{per_token:,}",
                       f"{per_token * 4096 / 2**30:.2f}"])
    measured = model.new_cache(1024)
    memory.append(["this run: engine's fp32 cache", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                   f"{measured.nbytes // 1024:,}", f"{measured.nbytes // 1024 * 4096 / 2**30:.2f}"])

    print_table("Lesson 02 — what we measured on this machine",
                ["check", "value"],
                [["max abs error, cached decode vs full recompute (next-token logits)", f"{error:.2e}"],
                 ["same greedy tokens", str(naive_ids == cached_ids)]])
    print_table(f"work and speed for a {prompt_len}-token prompt: O(N²) without the cache, O(N) with it",
                ["new tokens", "positions (no cache)", "positions (cache)", "GFLOP (no cache)",
                 "GFLOP (cache)", "tok/s (no cache)", "tok/s (cache)", "speedup"], rows)
    print(f"tok/s: median (min-max) of {rounds} interleaved rounds; {load_line(load_start)}")
    decode_steps = curves["KV cache"][1:]                                # the first token's time is the prefill
    print(beside_reference("cpu.decode.smollm2.fp32.1-thread", 1 / float(np.median(decode_steps))))
    check("the cache makes generation faster, more so the longer the text", speedup > 1,
          f"{speedup:.1f}x at {sweep[-1]} new tokens")
    print_table("KV cache memory: 2 × layers × kv_heads × head_dim × bytes per value",
                ["model", "layers", "kv heads", "head dim", "bytes/token", "GiB at 4096 tokens"], memory)
    save_plot("02_time_per_token.png", lambda ax: (
        [ax.plot(np.arange(1, len(t) + 1), np.array(t) * 1e3, "o-", ms=3, label=k) for k, t in curves.items()],
        ax.set_xlabel("token number"), ax.set_ylabel("ms for this token"), ax.legend(), ax.grid(alpha=0.3),
        ax.set_title("Lesson 02: without a cache each token costs more than the last")))


if __name__ == "__main__":
    main()
