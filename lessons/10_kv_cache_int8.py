"""Lesson 10 — an int8 KV cache: a quarter of the cache's bytes, and what that buys in users × context.

Lessons 08-09 shrank the weights, which every user shares. The KV cache is per user and grows with
every token (lesson 02), so at long contexts it, not the weights, decides how many users fit a GPU.
`minillm.model.kv_cache.Int8KVCache` stores keys and values as int8 with one fp32 scale per (layer, KV
head, position) vector of head_dim values: scale = max|k| / 127. We measure its error on SmolLM2's
real keys and values, its effect on perplexity, its bytes per token, and ask the capacity planner
what it means for Mistral-7B on an H100 (`minillm plan --kv-dtype int8`). Then attention straight
from the codes, as the GPU kernel reads them (a scale once per key, never a widened cache), and, on a
GPU, long-context decode with the 16-bit and the int8 cache side by side.

Run: python lessons/10_kv_cache_int8.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 02 (the KV cache)",
        "lesson 08 (int8 per row)",
    ],
    "objectives": [
        "quantize keys and values per (token, head) vector and measure the error at each granularity",
        "measure perplexity and top-1 agreement with an int8 cache",
        "read what halving the cache buys in users (`minillm plan --kv-dtype int8`)",
    ],
    "study_time": "45 min, plus 20 min for exercise 10 (int8 KV vectors)",
    "check_questions": [
        "Why does a scale per (token, head) vector suit a cache that grows one token at a time?",
        "Why is halving the cache's bytes not halving the decode time on a GPU?",
    ],
    "try_this": [
        "minillm generate --kv-cache int8 \"The capital of France is\"",
        "minillm plan -m mistral-7b --context 32768 --kv-dtype int8",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.model.attention import attend
from minillm.course import lesson_model, print_table, quick, run_gpu_parts, save_plot
from minillm.tools.evaluate import eval_text, perplexity
from minillm.model.kv_cache import Int8KVCache, KVCache
from minillm.tools.planner import kv_bytes_per_token, plan
from minillm.model.quant import quantize_int8


# NEW: int8 with one scale per vector, at three granularities ----------------------------------------
def int8_roundtrip(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Quantize x to int8 with one scale per slice reduced over `axes`, and back.   -> fp32 like x"""
    scale = np.abs(x).max(axis=axes, keepdims=True) / 127.0
    q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)), -127, 127)
    return q * scale
# ---------------------------------------------------------------------------------------------------


# NEW: attention straight from the codes, the way the GPU kernel reads them --------------------------
def attend_codes(q, k8, k_scale, v8, v_scale):
    """attend(q, k8·k_scale, v8·v_scale) without widening the cache: the scale of a key multiplies its
    score once (q·(k8·s) = (q·k8)·s), and a value's scale multiplies its probability once.
    q: [T, n_heads, hd]   k8, v8: int8 [n_kv, L, hd]   k_scale, v_scale: [n_kv, L]   -> [T, n_heads * hd]"""
    T, n_heads, hd = q.shape
    n_kv, L, _ = k8.shape
    group = n_heads // n_kv
    q = q.reshape(T, n_kv, group, hd).transpose(1, 0, 2, 3).reshape(n_kv, T * group, hd) / np.sqrt(hd)
    scores = (q @ k8.transpose(0, 2, 1).astype(np.float32)) * k_scale[:, None, :]   # [n_kv, T*group, L]
    scores += np.triu(np.full((T, L), -np.inf, np.float32), L - T + 1).repeat(group, axis=0)[None]  # causal
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p * v_scale[:, None, :]) @ v8.astype(np.float32)                         # [n_kv, T*group, hd]
    return out.reshape(n_kv, T, group, hd).transpose(1, 0, 2, 3).reshape(T, n_heads * hd)
# ---------------------------------------------------------------------------------------------------


def kv_decode_on_the_gpu() -> None:
    """Long-context decode with the 16-bit and the int8 KV cache on the device (minillm.cuda.dev.qbench)."""
    from minillm.cuda.dev.qbench import kv_cache_report
    from minillm.cuda.selfcheck import bench_config
    contexts = (1024, 4096) if quick() else (4096, 32000)
    if quick():
        out = kv_cache_report(bench_config(True), "a small Mistral-like model", contexts=contexts, n_new=16)
    else:
        out = kv_cache_report(bench_config(False), "Mistral-7B shape", contexts=contexts, n_new=48)
    ratio = out["int8", contexts[-1]] / out["16-bit", contexts[-1]]
    if ratio < 1.1:
        print(f"At {contexts[-1]} keys the int8 cache reads about half the K/V bytes yet decodes at {ratio:.2f}x:\n"
              "its attention costs the same fp32 multiply-adds per cached value as the 16-bit one (one per query\n"
              "head of the group), and at half the bytes those, not the memory, set its time (BENCHMARKS.md).\n"
              "Its win here is capacity: twice the context, or the users, in the same memory.")
    else:
        print(f"At {contexts[-1]} keys the int8 cache decodes {ratio:.2f}x as fast: the K/V bytes are the time.")


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
    logits_q = model.prefill(ids, int8, all_logits=True)                   # NEW: the int8 cache, same model
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
    quant = perplexity(llm.with_options(kv_cache="int8"), text, context=context, max_tokens=n_tokens)
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

    # 5. Reading the codes directly: the same attention, and the bytes a key costs per layer.
    n_q = 3
    q = np.random.default_rng(0).standard_normal((n_q, cfg.n_heads, cfg.head_dim)).astype(np.float32)
    codes = int8.k[0], int8.k_scale[0], int8.v[0], int8.v_scale[0]     # layer 0: [n_kv, T, hd] and [n_kv, T]
    widened = attend(q, codes[0] * codes[1][..., None], codes[2] * codes[3][..., None])
    direct = attend_codes(q, *codes)
    hd = cfg.head_dim
    print_table(f"attention from the int8 codes (layer 0, {n_q} queries over {len(ids)} keys): "
                f"max |difference| to widen-then-attend {np.abs(direct - widened).max():.1e}",
                ["cache", "bytes a key reads per layer and KV head (K + V)", "vs 16-bit"],
                [["16-bit (the GPU's default)", 2 * 2 * hd, "1.00"],
                 ["int8 + fp32 scale per vector", 2 * (hd + 4), f"{(hd + 4) / (2 * hd):.2f}"]])
    print("The GPU kernel (decode_attention.cu, attention_gqa*_int8) does exactly this per key: codes widened in\n"
          "registers, one multiply by the key's scale on its score, one by the value's scale on its probability.")
    failed = run_gpu_parts([("long-context decode, 16-bit vs int8 KV cache (python -m minillm.cuda.dev.qbench "
                             "--kv-cache)", kv_decode_on_the_gpu)])

    def draw(ax):
        x = full.k[layers[-1]][0]                                           # [T, hd] one head's keys
        ax.plot(np.abs(x).max(axis=1), label="max |k| per position (sets its scale)")
        ax.axhline(np.abs(x).max(), color="gray", ls="--", label="one scale for all positions")
        ax.set_xlabel("position"), ax.set_ylabel("max |k|"), ax.legend()
        ax.set_title(f"Lesson 10: layer {layers[-1]} keys, head 0: why a scale per token")
    save_plot("10_kv_int8.png", draw)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
