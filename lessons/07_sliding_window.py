"""Lesson 07 — sliding window and capacity planning: a KV cache that stops growing, and how many users fit a GPU.

Lessons 02 and 05-06 made each token's cache entry smaller; the cache still grew with every token.
Mistral-7B v0.1 attends to the last W = 4096 positions only (a sliding window), so older keys and
values can never be read again: a rolling buffer of W slots (`minillm.model.kv_cache.RollingKVCache`,
position p in slot p % W) holds all the model can use, and memory stops at the window. We run a
small random Mistral-shaped model both ways and check they give the same logits, then ask the
capacity planner (`minillm plan`) what that means on real GPUs: users that fit at each context.

Run: python lessons/07_sliding_window.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 02 (the KV cache)",
        "lesson 05 (cache bytes per user)",
    ],
    "objectives": [
        "keep only the last W positions in a rolling buffer and show it is exact for a windowed model",
        "turn bytes per token into users per GPU with `minillm plan`",
    ],
    "study_time": "40 min, plus 20 min for exercise 07 (the sliding-window mask)",
    "check_questions": [
        "Past the window, why does a longer context cost a windowed model no more memory per user?",
        "Which three numbers does the planner need to count users at a context?",
    ],
    "try_this": [
        "minillm plan -m mistral-7b --gpu l4 --context 32768",
        "change the window (`window`) and check the rolling cache still matches the full one",
    ],
}
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.tools.bench import random_model
from minillm.model.config import PRESETS, ModelConfig
from minillm.course import hf_tensors, out_dir, print_table, quick, save_plot
from minillm.course.measure import Spread, load_line
from minillm.model.kv_cache import KVCache, RollingKVCache
from minillm.model.transformer import Transformer
from minillm.tools.planner import GB, PlanError, decode_roofline, plan, plot_plan


def small_mistral(window: int) -> ModelConfig:
    """Mistral's layout (GQA 4:1, a sliding window) at a size that decodes in about a millisecond."""
    return ModelConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768,
                       rope_theta=10000.0, max_seq_len=8192, sliding_window=window, family="mistral")


def run_both(model, ids: list[int], prompt_len: int, checkpoints: list[int]) -> list[list]:
    """Prefill the prompt, then decode the rest of `ids` one token at a time into a full cache and a
    rolling one; at each checkpoint, the bytes each holds, their logits' difference and ms/token."""
    cfg = model.config
    full = KVCache(cfg, len(ids))                            # every position: what lesson 02 allocates
    rolling = RollingKVCache(cfg, cfg.sliding_window)        # W slots, reused forever
    no_window = Transformer(cfg.replace(sliding_window=None), hf_tensors(model))   # same weights, no window
    plain = KVCache(cfg, len(ids))
    first = [m.prefill(ids[:prompt_len], c) for m, c in ((model, full), (model, rolling), (no_window, plain))]
    rows = [["prefill", prompt_len, f"{full.length * cfg.kv_bytes_per_token(4):,}", f"{rolling.nbytes:,}",
             f"{np.abs(first[1] - first[0]).max():.1e}", f"{np.abs(first[2] - first[0]).max():.1e}", "", ""]]
    ms_full, ms_rolling = [], []
    for pos in range(prompt_len, len(ids)):
        start = time.perf_counter()
        want = model.decode(ids[pos], full)                  # attends over all L keys, masks all but W
        ms_full.append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        got = model.decode(ids[pos], rolling)                # attends over the W slots only
        ms_rolling.append(1e3 * (time.perf_counter() - start))
        ignoring_window = no_window.decode(ids[pos], plain)
        if pos + 1 in checkpoints:
            rows.append(["decode", pos + 1, f"{full.length * cfg.kv_bytes_per_token(4):,}", f"{rolling.nbytes:,}",
                         f"{np.abs(got - want).max():.1e}", f"{np.abs(ignoring_window - want).max():.1e}",
                         Spread(tuple(ms_full[-16:])).format(1, 2), Spread(tuple(ms_rolling[-16:])).format(1, 2)])
    return rows


# NEW: capacity with and without the rolling buffer ------------------------------------------------
def users_at_limit(p, window: int | None) -> tuple[int, float]:
    """(max users, total tok/s) at p.context when each user keeps only min(context, window) positions.

    The planner (like minillm's full cache) keeps every position; a rolling buffer caps a user's
    cache at the window, so past the window more context costs no memory at all.
    """
    kept = p.context if window is None else min(p.context, window)
    per_user = p.kv_bytes_per_token * kept                                 # bytes
    users = int(p.kv_budget_bytes // per_user) if p.weights_bytes + p.reserve_bytes <= p.gpu.memory_bytes else 0
    if users == 0:
        return 0, 0.0
    _, memory_s, compute_s = decode_roofline(p.weights_bytes, per_user, users, p.config.n_params, p.gpu)
    return users, users / max(memory_s, compute_s)
# ---------------------------------------------------------------------------------------------------


def main():
    small = quick()
    window = 16 if small else 32
    cfg = small_mistral(window)
    model = random_model(cfg, seed=0)
    for layer in model.layers:          # sharper queries and keys: peaked attention, as in a trained model
        layer.wq *= 6.0
        layer.wk *= 6.0
    print(f"model: random weights, Mistral layout: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads} query / "
          f"{cfg.n_kv_heads} KV heads, sliding window W = {window}")
    n_tokens = 4 * window if small else 16 * window                      # far past the window
    prompt_len = 3 * window // 2                                         # a prompt longer than W: prefill rolls too
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, n_tokens).tolist()
    model.prefill(ids[:4], KVCache(cfg, 4))                              # warm up
    checkpoints = sorted({2 * window, 4 * window, 8 * window, n_tokens} & set(range(prompt_len + 1, n_tokens + 1)))
    rows = run_both(model, ids, prompt_len, checkpoints)

    # The planner on real models and GPUs, at bf16 weights and KV, 10% of memory kept in reserve.
    contexts = [4096, 8192] if small else [4096, 8192, 32768]
    capacity = []
    for name in ["mistral-7b", "llama-3-8b"]:
        for gpu in ["h100", "h200", "l4"]:
            for context in contexts:
                p = plan(name, gpu, context=context)
                window_of = p.config.sliding_window
                rolled, rolled_tok_s = users_at_limit(p, window_of)
                note = (f"> {p.config.max_seq_len:,} trained" if context > p.config.max_seq_len else "")
                capacity.append([name, p.gpu.name, f"{context:,}", f"{p.weights_bytes / GB:.1f}",
                                 f"{p.kv_budget_bytes / GB:.1f}", f"{p.kv_bytes_per_user / GB:.2f}",
                                 f"{p.users:,}", f"{p.tok_s_total:,.0f}",
                                 f"{rolled:,}" if window_of else "-", f"{rolled_tok_s:,.0f}" if window_of else "-",
                                 note])
    per_token = []
    for name in ["mistral-7b", "llama-3-8b"]:
        c = PRESETS[name].config
        longest = c.sliding_window or c.max_seq_len                      # the most one user ever keeps
        per_token.append([name, c.n_layers, c.n_kv_heads, c.head_dim, f"{c.kv_bytes_per_token(2):,}",
                          c.sliding_window or "-", f"{c.max_seq_len:,}", f"{c.kv_bytes_per_token(2) * longest / GB:.2f}"])

    print_table(f"Lesson 07 — rolling buffer (W = {window}) vs full cache, same random Mistral-shaped model",
                ["step", "positions", "full cache bytes (fp32)", "rolling cache bytes", "max |rolling - full|",
                 "max |no window - window|", "ms/token full", "ms/token rolling"], rows)
    print(f"ms/token: median (min-max) of the last 16 steps, the two caches taking turns; {load_line()}")
    print("the rolling cache stays at W slots and gives the full cache's logits; the 'no window' column shows "
          "the window is part of the model: attending to everything gives other logits once L > W.")
    print_table("KV cache of the real models, fp16 (what a user costs)",
                ["model", "layers", "kv heads", "head dim", "bytes/token", "window", "max context",
                 "GB/user, rolling (window) or full (max context)"],
                per_token)
    print_table("minillm plan: max users at the memory limit (bf16, 10% reserve); 'rolling' caps each user at the window",
                ["model", "GPU", "context", "weights GB", "KV budget GB", "KV GB/user", "users (full cache)",
                 "tok/s total", "users (rolling)", "tok/s (rolling)", "note"], capacity)

    positions = [r[1] for r in rows]
    save_plot("07_rolling_vs_full_cache.png", lambda ax: (
        ax.plot(positions, [int(r[2].replace(",", "")) / 1e6 for r in rows], "o-", label="full cache (bytes in use)"),
        ax.plot(positions, [int(r[3].replace(",", "")) / 1e6 for r in rows], "s-", label=f"rolling buffer, W = {window}"),
        ax.set_xlabel("positions seen"), ax.set_ylabel("KV cache MB (fp32)"), ax.legend(), ax.grid(alpha=0.3),
        ax.set_title("Lesson 07: a sliding window bounds the cache")))
    for name, gpu in [("mistral-7b", "h100"), ("llama-3-8b", "l4")]:
        try:
            paths = plot_plan(plan(name, gpu, context=8192), out_dir() / f"07_plan_{name}_{gpu}")
            print("plots: " + ", ".join(str(p) for p in paths))
        except PlanError as e:          # no matplotlib: the numbers above still stand
            print(f"plots for {name} on {gpu} skipped: {e}")


if __name__ == "__main__":
    main()
