"""Lesson 10 — an int8 KV cache: a quarter of the cache's bytes, and what that buys in users × context.

Lessons 08-09 shrank the weights, which every user shares. The KV cache is per user and grows with
every token (lesson 02), so at long contexts it, not the weights, decides how many users fit a GPU.
`minillm.kv_cache.Int8KVCache` stores keys and values as int8 with one fp32 scale per (layer, KV
head, position) vector of head_dim values: scale = max|k| / 127. We measure its error on SmolLM2's
real keys and values, its effect on perplexity, its bytes per token, and ask the capacity planner
what it means for Mistral-7B on an H100 (`minillm plan --kv-dtype int8`).

Run: python lessons/10_kv_cache_int8.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.evaluate import eval_text, perplexity
from minillm.kv_cache import Int8KVCache, KVCache
from minillm.planner import kv_bytes_per_token, plan
from minillm.quant import quantize_int8


# NEW: int8 with one scale per vector, at three granularities ----------------------------------------
def int8_roundtrip(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Quantize x to int8 with one scale per slice reduced over `axes`, and back.   -> fp32 like x"""
    scale = np.abs(x).max(axis=axes, keepdims=True) / 127.0
    q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)), -127, 127)
    return q * scale
# ---------------------------------------------------------------------------------------------------


def rel_rms(approx: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(((approx - x) ** 2).mean() / (x ** 2).mean()))


def main():
    small = quick()
    llm = lesson_model()
    cfg, model = llm.config, llm.model
    text = eval_text(600 if small else 4000)
    ids = llm.prompt_ids(text, chat=False)[:32 if small else 256]

    # 1. Real keys and values: prefill into both caches. The errors are measured on the fp32 cache's own
    #    vectors (later layers of the int8 run see slightly different inputs); the logits compare the runs.
    full, int8 = KVCache(cfg, len(ids)), Int8KVCache(cfg, len(ids))
    logits_fp = model.prefill(ids, full, all_logits=True)                  # [T, vocab]
    model.kv_cache_dtype = "int8"
    logits_q = model.prefill(ids, int8, all_logits=True)
    model.kv_cache_dtype = "float32"
    layers = sorted({0, cfg.n_layers // 2, cfg.n_layers - 1})
    err_rows = []
    for layer in layers:
        for kind, exact in (("K", full.k[layer]), ("V", full.v[layer])):   # [n_kv, T, hd] fp32
            # What Int8KVCache.append stores for these very vectors (the engine's per-vector int8).
            w = quantize_int8(exact.reshape(-1, cfg.head_dim))
            back = (w.dequantize()).reshape(exact.shape)
            step = np.broadcast_to(w.scales.reshape(exact.shape[:2])[..., None], exact.shape)
            err_rows.append([layer, kind, f"{np.abs(exact).max():.2f}", f"{rel_rms(back, exact):.4f}",
                             f"{rel_rms(int8_roundtrip(exact, (1, 2)), exact):.4f}",
                             f"{rel_rms(int8_roundtrip(exact, (0, 1, 2)), exact):.4f}",
                             "yes" if np.all(np.abs(back - exact) <= step / 2 * (1 + 1e-5) + 1e-7) else "NO"])

    # 2. Quality: the same model and tokens, fp32 KV vs int8 KV.
    context, n_tokens = (32, 48) if small else (256, 512)
    base = perplexity(llm, text, context=context, max_tokens=n_tokens)
    model.kv_cache_dtype = "int8"
    quant = perplexity(llm, text, context=context, max_tokens=n_tokens)
    model.kv_cache_dtype = "float32"
    agree = float(np.mean(logits_fp.argmax(-1) == logits_q.argmax(-1)))

    # 3. Bytes per token: SmolLM2 as allocated here, and as the planner counts (fp16 scales).
    per_token = [["fp32 (KVCache)", f"{full.nbytes // len(ids):,}", f"{kv_bytes_per_token(cfg, 'fp32'):,}"],
                 ["fp16", "", f"{kv_bytes_per_token(cfg, 'fp16'):,}"],
                 ["int8 + scale per vector (Int8KVCache)", f"{int8.nbytes // len(ids):,}",
                  f"{kv_bytes_per_token(cfg, 'int8'):,}"]]

    # 4. Users × context: Mistral-7B on one H100 (bf16 weights), fp16 KV vs int8 KV.
    plan_rows = []
    for context_len in (4096, 32768):
        plans = {kv: plan("mistral-7b", "h100", "bf16", kv, context_len) for kv in ("fp16", "int8")}
        plan_rows.append([f"{context_len:,}", f"{plans['fp16'].kv_bytes_per_token:,}",
                          f"{plans['int8'].kv_bytes_per_token:,}", plans["fp16"].max_users, plans["int8"].max_users,
                          f"{plans['int8'].max_users / max(plans['fp16'].max_users, 1):.2f}x",
                          f"{plans['fp16'].tok_s_total:,.0f}", f"{plans['int8'].tok_s_total:,.0f}"])

    print_table(f"Lesson 10 — int8 KV error on SmolLM2's real keys and values ({len(ids)} tokens; relative RMS error)",
                ["layer", "K/V", "max |x|", "per token+head (engine)", "per head", "per layer", "err <= scale/2"],
                err_rows)
    print("One scale per (head, position) vector tracks the tokens whose keys are large; a scale shared over\n"
          "all positions is set by the largest token and coarsens every other one.")
    print_table(f"quality: fp32 KV vs int8 KV ({base.n_tokens} tokens of eval_text, windows of {context})",
                ["KV cache", "perplexity", "Δ perplexity", f"top-1 agree ({len(ids)} tok)",
                 f"max |Δ logit| ({len(ids)} tok)"],
                [["fp32", f"{base.ppl:.3f}", "+0.00%", "100%", "0"],
                 ["int8", f"{quant.ppl:.3f}", f"{100 * (quant.ppl / base.ppl - 1):+.2f}%", f"{agree:.0%}",
                  f"{np.abs(logits_q - logits_fp).max():.3f}"]])
    print_table(f"bytes per token of SmolLM2's cache ({cfg.n_layers} layers x 2 x {cfg.n_kv_heads} KV heads x "
                f"{cfg.head_dim} values)", ["KV cache", "measured here", "planner (fp16 scales)"], per_token)
    print_table("what it buys: Mistral-7B, bf16 weights, one H100-80GB (minillm plan mistral-7b --kv-dtype int8)",
                ["context", "KV B/token fp16", "KV B/token int8", "users fp16", "users int8", "more users",
                 "tok/s fp16", "tok/s int8"], plan_rows)
    print("At the memory limit every user's cache is read each decode step, so int8 KV also halves that traffic:\n"
          "nearly twice the users at about the same time per step. (The planner's roofline; nothing measured.)")

    def draw(ax):
        x = full.k[layers[-1]][0]                                           # [T, hd] one head's keys
        ax.plot(np.abs(x).max(axis=1), label="max |k| per position (sets its scale)")
        ax.axhline(np.abs(x).max(), color="gray", ls="--", label="one scale for all positions")
        ax.set_xlabel("position"), ax.set_ylabel("max |k|"), ax.legend()
        ax.set_title(f"Lesson 10: layer {layers[-1]} keys, head 0: why a scale per token")
    save_plot("10_kv_int8.png", draw)


if __name__ == "__main__":
    main()
