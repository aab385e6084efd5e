"""Speculative decoding's step costs on the GPU, at a model shape whose real weights are not here.

Random weights make acceptance meaningless (a random model's int4 copy or first layers agree with it by
chance only), so this measures what the GPU decides, the costs, and takes the acceptance from SmolLM2's
real weights on the CPU (lessons/BENCHMARKS.md, issue 18), saying so:

    plain     one decode step (the CUDA graph)                                       t_plain
    verify    a forward over the pending token + k drafts, every row's logits back, then the rollback   t_verify(k)
    draft     int4: the int4 copy's decode graph; layers:N: the first N layers' graph; ngram: a lookup on the host

    tokens per pass  E = (1 - α^(k+1)) / (1 - α)   for a per-draft acceptance α (drafts accepted in order)
    tok/s            E / (k · t_draft + t_verify(k))           vs 1 / t_plain
    break-even α     the α at which speculation only ties plain decoding

    python -m minillm.cuda.dev.speculative [--preset mistral-7b] [--quick] [--alpha int4=0.6 ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from minillm.model.config import PRESETS
from minillm.cuda.dev.common import plain_table, require_gpu

# Per-draft acceptance measured on SmolLM2-135M-Instruct's real weights on the CPU (BENCHMARKS.md, issue 18;
# `minillm bench --speculative X` on the copy-heavy prompts): ngram 50% at k = 8, int4 63% at k = 4,
# early exit 4% (layers:20 of 30: SmolLM2 was not trained for it).
MEASURED_ALPHA = {"ngram": 0.50, "int4": 0.63, "layers": 0.04}


def tokens_per_pass(alpha: float, k: int) -> float:
    """Expected tokens a verify pass emits with k drafts, each accepted with probability alpha until the
    first rejection, plus the corrected or bonus token."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def break_even_alpha(k: int, cost_ratio: float) -> float | None:
    """The alpha at which tokens_per_pass equals cost_ratio (a speculative pass's time over a plain step's);
    None when even alpha = 1 does not pay."""
    if tokens_per_pass(1.0, k) < cost_ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_pass(mid, k) < cost_ratio else (lo, mid)
    return hi


def _median_ms(fn, reps: int) -> float:
    """Median wall milliseconds of fn(), which ends synchronized (every step here copies logits back)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_costs(preset: str = "mistral-7b", prompt_len: int = 128, ks=(2, 4, 8), layer_drafts=(8, 16),
               reps: int = 30) -> dict:
    """ms of a plain decode step, a verify pass of k + 1 rows (with its rollback) for each k, and one draft
    step of each drafter, on random fp16 weights of `preset`'s shape (the int4 draft: random int4 codes)."""
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.engine.speculative import NgramDrafter
    cfg = PRESETS[preset].config
    target = GPUTransformer.random(cfg, "float16", seed=1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    capacity = prompt_len + 2 * max(ks) + reps + 8
    cache = target.new_cache(capacity)
    target.prefill(prompt, cache)
    costs = {"plain": _median_ms(lambda: _decode_and_rewind(target, cache), reps)}
    for k in ks:
        drafts = rng.integers(0, cfg.vocab_size, k + 1).tolist()
        costs[f"verify {k}"] = _median_ms(lambda: _verify_and_rewind(target, cache, drafts), reps)
    eager = target.with_options(use_graph=False)    # the verify pass launched one by one: what the graph saves
    drafts = rng.integers(0, cfg.vocab_size, 5).tolist()
    costs["verify 4, eager"] = _median_ms(lambda: _verify_and_rewind(eager, cache, drafts), reps)
    for n in layer_drafts:
        draft_cache = target.new_cache(capacity)
        target.prefill(prompt, draft_cache, n_layers=n)
        costs[f"layers:{n}"] = _median_ms(lambda: _decode_and_rewind(target, draft_cache, n), reps)
    int4 = GPUTransformer.random(cfg, "float16", seed=2, quant="int4")
    draft_cache = int4.new_cache(capacity)
    int4.prefill(prompt, draft_cache)
    costs["int4"] = _median_ms(lambda: _decode_and_rewind(int4, draft_cache), reps)
    context = (prompt * 4)[:512]
    costs["ngram"] = _median_ms(lambda: NgramDrafter().propose(context, max(ks)), reps)
    costs["verify_path"] = "one CUDA graph" if target.rows_graph_error is None else f"eager ({target.rows_graph_error})"
    costs["weight_gb"] = target.weight_bytes / 1e9
    costs["int4_weight_gb"] = int4.weight_bytes / 1e9
    return costs


def _decode_and_rewind(model, cache, n_layers=None) -> None:
    model.decode(7, cache, n_layers=n_layers)
    cache.length -= 1           # the next step writes the same position again: the cache stays one length


def _verify_and_rewind(model, cache, rows) -> None:
    length = cache.length
    model.prefill(rows, cache, all_logits=True)
    cache.truncate(length)


def projection(costs: dict, alphas: dict, ks=(2, 4, 8), layer_drafts=(8, 16)) -> list[dict]:
    """One row per (drafter, k): draft and verify ms, tokens per pass at the given alpha, projected tok/s
    and speedup, and the break-even alpha."""
    plain = costs["plain"]
    drafters = ["ngram", "int4"] + [f"layers:{n}" for n in layer_drafts]
    rows = []
    for name in drafters:
        alpha = alphas.get(name, alphas.get(name.split(":")[0]))
        for k in ks:
            spent = k * costs[name] + costs[f"verify {k}"]
            e = tokens_per_pass(alpha, k)
            even = break_even_alpha(k, spent / plain)
            rows.append(dict(drafter=name, k=k, draft_ms=costs[name], verify_ms=costs[f"verify {k}"], alpha=alpha,
                             tokens_per_pass=e, tok_s=1e3 * e / spent, speedup=plain * e / spent,
                             break_even=even))
    return rows


def print_report(preset: str, costs: dict, rows: list[dict], alphas: dict, print_fn=print) -> None:
    plain = costs["plain"]
    print_fn(f"\nspeculative decoding step costs, {preset} shape, random fp16 weights (int4 draft: random int4), "
             f"batch 1")
    print_fn(f"plain decode: {plain:.2f} ms/token = {1e3 / plain:.1f} tok/s "
             f"({costs['weight_gb']:.1f} GB of weights a step; int4 copy {costs['int4_weight_gb']:.1f} GB)")
    print_fn(f"verify pass (k + 1 rows through prefill's GEMMs, logits back, rollback; {costs['verify_path']}): " +
             ", ".join(f"k={key.split(maxsplit=1)[1]} {v:.2f} ms" for key, v in costs.items()
                       if key.startswith("verify ")))
    print_fn("acceptance α per draft from SmolLM2's real weights on the CPU, not from these random weights: "
             + ", ".join(f"{k} {v:.0%}" for k, v in alphas.items()))
    table = [[r["drafter"], r["k"], f"{r['draft_ms']:.3f}", f"{r['verify_ms']:.2f}", f"{r['alpha']:.0%}",
              f"{r['tokens_per_pass']:.2f}", f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}x",
              "never" if r["break_even"] is None else f"{r['break_even']:.0%}"] for r in rows]
    plain_table("projected (tok/pass at α; tok/s = tok/pass / (k · draft + verify)):",
                ["drafter", "k", "draft ms", "verify ms", "α", "tok/pass", "tok/s", "vs plain", "break-even α"], table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="speculative decoding: step costs on the GPU, projected tok/s")
    parser.add_argument("--preset", default="mistral-7b", choices=sorted(PRESETS))
    parser.add_argument("--quick", action="store_true", help="few repeats")
    parser.add_argument("--alpha", action="append", default=[], metavar="DRAFTER=A",
                        help="acceptance per draft to project with (default: SmolLM2's, measured on the CPU)")
    args = parser.parse_args(argv)
    alphas = dict(MEASURED_ALPHA)
    for item in args.alpha:
        name, _, value = item.partition("=")
        alphas[name] = float(value)
    if not require_gpu("minillm.cuda.dev.speculative"):
        return 1
    costs = step_costs(args.preset, reps=5 if args.quick else 30)
    print_report(args.preset, costs, projection(costs, alphas), alphas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
