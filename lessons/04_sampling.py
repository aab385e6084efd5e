"""Lesson 04 — sampling: from logits to the next token, greedy, temperature, top-k and top-p.

Lessons 01-03 always took the most likely token (greedy). The model gives a whole distribution;
sampling draws from it, reshaped first: temperature sharpens or flattens it, top-k keeps the k most
likely tokens, top-p keeps the smallest set holding probability p. For one prompt we show what each
setting keeps (tokens, entropy, top probabilities), check the sampler draws what it says, and
generate a short text with each, seeded so every run prints the same.

Run: python lessons/04_sampling.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 01 (logits)",
        "probability: softmax, entropy",
    ],
    "objectives": [
        "turn logits into a distribution and sample from it with temperature, top-k and top-p",
        "measure how many tokens each method keeps and how much entropy is left",
        "make a draw reproducible with a seed",
    ],
    "study_time": "35 min, plus 20 min for exercise 04 (top-p)",
    "check_questions": [
        "What does temperature 0 reduce to, and what does a high temperature do to the entropy?",
        "Why does top-p keep a varying number of tokens while top-k keeps a fixed one?",
    ],
    "try_this": [
        "minillm generate --temperature 1.5 --top-p 0.9 --seed 1 \"Once upon a time\"",
        "lower p step by step until the text turns repetitive",
    ],
}
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.course.measure import beside_reference, load_line
from minillm.engine.sampling import SamplingParams, next_token_distribution

# NEW: the settings we compare, as the engine's SamplingParams -------------------------------------
SETTINGS = {
    "greedy":              SamplingParams(temperature=0.0),
    "temperature 0.5":     SamplingParams(temperature=0.5),
    "temperature 1.0":     SamplingParams(temperature=1.0),
    "temperature 1.5":     SamplingParams(temperature=1.5),
    "top-k 10":            SamplingParams(temperature=1.0, top_k=10),
    "top-p 0.9":           SamplingParams(temperature=1.0, top_p=0.9),
    "T 0.8 top-k 50 p 0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
}


def entropy_bits(probs: np.ndarray) -> float:
    """How many bits of surprise a draw carries on average: 0 for greedy, log2(vocab) for uniform."""
    p = probs[probs > 0]
    return max(0.0, float(-(p * np.log2(p)).sum()))     # max: greedy's 1·log2(1) rounds to -0.0


def empirical_error(probs: np.ndarray, n: int, seed: int) -> float:
    """Draw n tokens the way `Sampler` does and return the largest |frequency - probability|."""
    draws = np.random.default_rng(seed).choice(len(probs), size=n, p=probs)
    freq = np.bincount(draws, minlength=len(probs)) / n
    return float(np.abs(freq - probs).max())
# ---------------------------------------------------------------------------------------------------


def main():
    llm = lesson_model()
    tok = llm.tokenizer
    prompt = "Once upon a time, there was a"
    ids = llm.prompt_ids(prompt)
    logits = llm.logits(ids)[-1]                                         # [vocab]: the next token's scores
    print(f"\nprompt {prompt!r} ({len(ids)} tokens); distributions over its next token")

    n_draws = 2000 if quick() else 20000
    rows, tops, dists = [], [], {}
    for name, params in SETTINGS.items():
        start = time.perf_counter()
        probs = next_token_distribution(logits, params)                  # [vocab], sums to 1
        ms = (time.perf_counter() - start) * 1e3
        dists[name] = probs
        top = np.argsort(-probs)[:3]
        tops.append([name] + [f"{tok.decode([int(i)])!r} {probs[i]:.2f}" if probs[i] > 0 else "(dropped)"
                              for i in top])
        rows.append([name, f"{int((probs > 0).sum()):,}", f"{entropy_bits(probs):.2f}",
                     f"{probs[top[0]]:.3f}", f"{empirical_error(probs, n_draws, seed=0):.4f}", f"{ms:.1f}"])

    n_new = 8 if quick() else 24
    texts, generated = [], {}
    for name, p in SETTINGS.items():
        g = llm.generate(prompt, max_tokens=n_new, temperature=p.temperature, top_k=p.top_k,
                         top_p=p.top_p, seed=0)
        generated[name] = g.text
        texts.append([name, repr(g.text)[:70], f"{g.decode_tok_s:.1f}"])
    again = llm.generate(prompt, max_tokens=n_new, temperature=1.0, top_p=0.9, seed=0).text
    same_seed = again == generated["top-p 0.9"]                          # the seed fixes every draw

    print_table("Lesson 04 — what each setting keeps of the next-token distribution",
                ["setting", "tokens kept", "entropy bits", "top-1 prob",
                 f"max |freq - prob| ({n_draws:,} draws)", "ms to build"], rows)
    print_table("the three most likely tokens under each setting", ["setting", "1st", "2nd", "3rd"], tops)
    print_table(f"{n_new} sampled tokens per setting (seed 0)", ["setting", "text", "decode tok/s"], texts)
    print(f"same seed, same text: {same_seed}")
    # decode speed does not depend on the setting (sampling is microseconds next to a forward pass)
    speeds = [float(row[2]) for row in texts]
    print(f"decode tok/s across settings: {np.median(speeds):.1f} ({min(speeds):.1f}-{max(speeds):.1f}); "
          f"{load_line()}")
    print(beside_reference("cpu.decode.smollm2.fp32.1-thread", float(np.median(speeds))))

    def draw(ax):
        order = np.argsort(-dists["temperature 1.0"])[:15]              # the 15 most likely at T = 1
        width = 0.8 / len(dists)
        for j, (name, probs) in enumerate(dists.items()):
            ax.bar(np.arange(15) + j * width, probs[order], width, label=name)
        ax.set_xticks(np.arange(15) + 0.4, [tok.decode([int(i)]) for i in order], rotation=60, fontsize=7)
        ax.set_ylabel("probability"), ax.legend(fontsize=7)
        ax.set_title("Lesson 04: the next-token distribution under each setting")
    save_plot("04_distributions.png", draw)


if __name__ == "__main__":
    main()
