"""Lesson 01 — a forward pass by hand: text -> tokens -> embeddings -> 30 layers -> logits -> next token.

Everything the engine does in `Transformer.forward` is written out here from its small pieces
(rmsnorm, rope, swiglu, linear), with no KV cache: to pick each new token the loop runs the whole
prefix through the model again. We check our forward against the engine's `llm.logits`, then time
the naive loop and watch tokens/s fall as the prefix grows. Lesson 02 removes that waste.

Run: python lessons/01_forward_pass.py      (MINILLM_LESSON_QUICK=1 for a seconds-long smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "Python and NumPy arrays (shapes, @, broadcasting)",
        "what a token and a vocabulary are",
    ],
    "objectives": [
        "trace one Llama forward pass: embeddings, rmsnorm, attention with RoPE, SwiGLU, logits",
        "check a hand-written forward against the engine's logits to float precision",
        "explain why decoding without a cache slows down as the text grows",
    ],
    "study_time": "45 min, plus 20 min for exercise 01 (rmsnorm)",
    "check_questions": [
        "Which operations in a block mix information across positions, and which act on each position alone?",
        "Without a cache, how does the work for token N+1 compare with the work for token N?",
    ],
    "try_this": [
        "MINILLM_LESSON_MODEL=random:smollm2-135m: same speeds, gibberish text",
        "change the prompt lengths the lesson times and watch tokens/s fall",
    ],
}
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.backend import as_f32
from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.course.measure import check, interleaved, load_average, load_line
from minillm.model.layers import apply_rope, linear, rmsnorm, rope_tables, swiglu

# NEW: the whole model, by hand ----------------------------------------------------------------------
# One function per box of the Llama diagram. Shapes: T positions, dim 576, 9 query heads and 3 KV
# heads of head_dim 64, vocab 49152 (for SmolLM2-135M).


def forward(model, ids: list[int], last_only: bool = False) -> np.ndarray:
    """Logits for every position of ids (or only the last), recomputing everything.  -> [T, vocab]"""
    cfg = model.config
    cos, sin = rope_tables(np.arange(len(ids)), model.inv_freq)          # [T, hd/2] each
    x = as_f32(model.embed[ids])                                         # [T, dim]: one row per token
    for layer in model.layers:                                           # 30 identical blocks
        x = x + attention(rmsnorm(x, layer.attn_norm, cfg.norm_eps), layer, cfg, cos, sin)
        x = x + swiglu(rmsnorm(x, layer.mlp_norm, cfg.norm_eps), layer.w_gate, layer.w_up, layer.w_down)
    if last_only:
        x = x[-1:]                       # the next token needs only the last row: skip 49152×576 per row
    return linear(rmsnorm(x, model.final_norm, cfg.norm_eps), model.lm_head)   # [T, vocab]


def attention(h: np.ndarray, layer, cfg, cos, sin) -> np.ndarray:
    """Causal self-attention with grouped KV heads.    h: [T, dim] -> [T, dim]"""
    T, hd = h.shape[0], cfg.head_dim
    q = linear(h, layer.wq).reshape(T, cfg.n_heads, hd)                  # [T, 9, 64]
    k = linear(h, layer.wk).reshape(T, cfg.n_kv_heads, hd)               # [T, 3, 64]
    v = linear(h, layer.wv).reshape(T, cfg.n_kv_heads, hd)               # [T, 3, 64]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)              # position enters here, and only here
    group = cfg.n_heads // cfg.n_kv_heads                                # 3 query heads share each KV head
    k = np.repeat(k, group, axis=1).transpose(1, 2, 0)                   # [9, 64, T]
    v = np.repeat(v, group, axis=1).transpose(1, 0, 2)                   # [9, T, 64]
    scores = q.transpose(1, 0, 2) @ k / math.sqrt(hd)                    # [9, T, T]
    scores += np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)   # causal: no peeking at later tokens
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)                       # softmax over keys
    out = (weights @ v).transpose(1, 0, 2).reshape(T, cfg.n_heads * hd)  # [T, 576]
    return linear(out, layer.wo)                                         # [T, dim]


def generate_naive(model, ids: list[int], n_new: int) -> tuple[list[int], float]:
    """Greedy decoding without a cache: every step runs the WHOLE prefix again.  -> (new ids, seconds)"""
    ids, start = list(ids), time.perf_counter()
    for _ in range(n_new):
        logits = forward(model, ids, last_only=True)                     # [1, vocab]: cost grows with len(ids)
        ids.append(int(np.argmax(logits[0])))
    return ids[-n_new:], time.perf_counter() - start
# ----------------------------------------------------------------------------------------------------


def main():
    llm = lesson_model()
    model, tok = llm.model, llm.tokenizer

    text = "The capital of France is"
    ids = tok.encode(text)
    print(f"\ntext   {text!r}\ntokens {ids}  ({len(ids)} tokens: {[tok.decode([i]) for i in ids]})")

    # Our forward against the engine's: the same arithmetic, so the error should be float32 rounding.
    ours = forward(model, ids)                                           # [T, vocab]
    engine = llm.logits(ids)                                             # [T, vocab]
    error = float(np.abs(ours - engine).max())
    next_id = int(np.argmax(ours[-1]))
    print(f"next token: {tok.decode([next_id])!r} (id {next_id}); "
          f"max |ours - llm.logits| = {error:.2e} over {ours.size:,} logits")

    new, _ = generate_naive(model, ids, 4 if quick() else 12)
    print(f"greedy continuation: {text + tok.decode(new)!r}")

    # The naive loop's speed against prompt length: each step processes the whole prefix. The lengths take
    # turns, round after round (course/measure.py), so other work on the machine slows them alike.
    lengths, n_new, rounds = ([4, 8], 2, 1) if quick() else ([8, 32, 128, 256], 2, 3)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(100, llm.config.vocab_size, n).tolist() for n in lengths}
    load_start = load_average()
    spreads = interleaved({n: lambda p=prompts[n]: generate_naive(model, p, n_new) for n in lengths}, rounds)
    rows, speeds = [], []
    for n in lengths:
        positions = sum(range(n, n + n_new))                             # rows pushed through 30 layers
        speeds.append(spreads[n].per(n_new))
        rows.append([n, n_new, f"{positions:,}", spreads[n].ms(), spreads[n].rate(n_new)])
    print_table("Lesson 01 — what we measured on this machine",
                ["check", "value"],
                [["max abs error, hand forward vs llm.logits", f"{error:.2e}"],
                 ["same next token", str(next_id == int(np.argmax(engine[-1])))]])
    print_table(f"naive generation (no KV cache): tokens/s falls as the prefix grows (median (min-max) of {rounds} "
                f"interleaved rounds)", ["prompt tokens", "new tokens", "positions processed", "ms", "tokens/s"], rows)
    print(load_line(load_start))
    check("without a cache, speed falls as the prefix grows", speeds[-1] < speeds[0],
          f"{speeds[0]:.1f} tok/s at {lengths[0]} tokens, {speeds[-1]:.1f} at {lengths[-1]}")
    save_plot("01_naive_tokens_per_s.png", lambda ax: (
        ax.plot(lengths, speeds, "o-"), ax.set_xscale("log", base=2),
        ax.set_xlabel("prompt length (tokens)"), ax.set_ylabel("tokens/s (no cache)"),
        ax.set_title("Lesson 01: naive generation slows as the prefix grows"), ax.grid(alpha=0.3)))


if __name__ == "__main__":
    main()
