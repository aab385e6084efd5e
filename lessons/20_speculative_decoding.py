"""Lesson 20 — speculative decoding: draft k tokens cheaply, verify them in one pass, keep what is right.

Decode at batch 1 reads every weight once per token (lesson 03): the arithmetic units mostly wait. So a
pass over k + 1 positions costs about what a pass over one does, and if something cheap could guess
the next k tokens, the target could check them all at once and keep the ones it agrees with. That is
speculative decoding (Leviathan et al., Chen et al., 2023). Four steps, each measured here:

1. The rule that keeps the answer exact: accept a draft x ~ q with probability min(1, p(x)/q(x)); on a
   rejection draw from norm(max(0, p - q)); after k acceptances a bonus token from the last row. The
   emitted token is distributed exactly as p (checked by enumeration below); at temperature 0 it is
   "accept while the draft is the target's argmax", so greedy output is the plain greedy output.
2. What verifying costs: on this CPU OpenBLAS's sgemm is slow for 2-16 rows, slower than as many GEMVs;
   the engine multiplies a block of W at a time as W @ xᵀ instead (model/layers.small_m_matmul). # NEW
3. What a pass yields: with acceptance rate α and k drafts, (1 - α^(k+1)) / (1 - α) tokens.
4. Drafters: prompt lookup (ngram: free, right when the answer copies its prompt), the target's first N
   layers (early exit), the int4 target. A drafter that is often wrong, or costly, makes it slower.
5. On a GPU (skipped without one): the same loop with the GPU model as the target. There a pass over
   k + 1 rows is not free either: cuBLAS's GEMMs for a few rows stream the weights slower than the
   decode GEMV, so the lesson prints each step's cost and the acceptance a drafter needs to break even.

Exercise 20 is step 1's rule; exercise 20.2 is the greedy loop around it: which tokens one verify pass
commits, and how far the KV cache rolls back (the rejected drafts' positions were written by the pass).

Run: python lessons/20_speculative_decoding.py    (MINILLM_LESSON_QUICK=1: smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 04 (sampling)",
        "lesson 03 (a pass over k positions)",
    ],
    "objectives": [
        "accept a draft token with min(1, p/q) and resample from the residual, keeping the output exact",
        "measure what a verify pass over k + 1 positions costs against one decode",
        "measure acceptance, tokens per pass and speedup of ngram, early-exit and int4 drafts",
    ],
    "study_time": "60 min, plus 30 min for exercise 20 (the speculative step)",
    "check_questions": [
        "Why is the emitted distribution exactly p whatever the draft q?",
        "With acceptance α and k drafts, how many tokens does a pass yield on average?",
        "When does a draft make decoding slower than plain?",
    ],
    "try_this": [
        "minillm generate --speculative ngram --draft-tokens 8 on a prompt that asks to repeat text",
        "compare your speedup with the reference line under the table",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course.measure import Spread, beside_reference, check, interleaved, load_average, load_line
from minillm.course import lesson_model, print_table, quick, run_gpu_parts, save_plot
from minillm.course.ex_speculative import emitted_distribution, speculative_step_reference
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.engine.speculative import NgramDrafter, early_exit_drafter, generate_speculative, int4_drafter
from minillm.model.layers import small_m_matmul
from minillm.tools.spec_bench import copy_heavy_prompts


def the_rule_is_exact() -> list:
    """Random p and q on 6 tokens, and a one-hot q (a deterministic drafter): the emitted law vs p."""
    rng = np.random.default_rng(20)
    rows = []
    for name, q in [("random q", rng.dirichlet(np.ones(6))), ("one-hot q (ngram)", np.eye(6)[1]),
                    ("q = p", None)]:
        p = rng.dirichlet(np.ones(6))
        q = p.copy() if q is None else q
        accept = sum(q[d] * speculative_step_reference(p, q, d)[0] for d in range(6))
        rows.append([name, f"{accept:.3f}", f"{np.abs(emitted_distribution(speculative_step_reference, p, q) - p).max():.1e}"])
    return rows


def verify_forms(T_values, repeats: int) -> tuple[list, dict]:
    """One [3072, 576] matrix (SmolLM2's gate|up) times T rows, three ways taking turns (course/measure.py).
    -> (table rows in µs, {T: {form: Spread}})"""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((3072, 576)).astype(np.float32)
    rows, spreads = [], {}
    for T in T_values:
        x = rng.standard_normal((T, 576)).astype(np.float32)
        spreads[T] = t = interleaved({"sgemm": lambda: x @ W.T, "gemvs": lambda: [W @ r for r in x],
                                      "engine": lambda: small_m_matmul(x, W) if T > 1 else x @ W.T}, repeats)
        rows.append([T] + [t[form].format(1e6, 0) for form in ("sgemm", "gemvs", "engine")])
    return rows, spreads


def pass_cost(model, T_values, repeats: int, context: int) -> dict[int, Spread]:
    """The target's forward over T new positions against a cache of `context`: what a verify pass costs,
    the values of T taking turns."""
    cache = model.new_cache(256 + max(T_values))
    model.prefill(list(range(1, context + 1)), cache)

    def run(T):
        model.forward(np.arange(T) + 5, cache)
        cache.truncate(context)
    return interleaved({T: lambda T=T: run(T) for T in T_values}, repeats)


def prompt_ids(llm, p: dict) -> list[int]:
    """A copy-heavy prompt as ids: through the chat template where the model has one."""
    try:
        return llm.prompt_ids(p.get("messages") or p["text"])
    except Exception:                                   # the stand-in tokenizer of random weights
        return llm.tokenizer.encode(p["messages"][-1]["content"] if "messages" in p else p["text"])


def stop_ids(llm) -> set:
    """EOS ends an answer here as in llm.generate: past it a model's text is noise no drafter predicts."""
    return set(getattr(llm.tokenizer, "eos_ids", ())) | set(llm.config.eos_token_ids)


def decode_in_turns(llm, drafters: list, prompts, n: int) -> tuple[list, dict]:
    """Greedy decode of every prompt, plain and with each drafter, taking turns prompt by prompt (course/
    measure.py's interleaving: other work on the machine slows every contestant alike).
    -> (plain results per prompt, {drafter name: stats, with per-prompt speedups over plain})"""
    plain, runs = [], {name: [] for name, _, _ in drafters}
    for ids in prompts:
        plain.append(generate_ids(llm.model, ids, n, SamplingParams(), stop_ids=stop_ids(llm)))
        for name, drafter, k in drafters:
            runs[name].append(generate_speculative(llm.model, drafter, ids, n, SamplingParams(), k,
                                                   stop_ids=stop_ids(llm)))
    return plain, {name: drafter_stats(gs, plain) for name, gs in runs.items()}


def tok_s(g) -> float:
    return (len(g.token_ids) - 1) / g.decode_s if g.decode_s else 0.0


def drafter_stats(runs: list, plain: list) -> dict:
    """Over all prompts: tokens/s, acceptance, tokens per pass, drafting share; per prompt: the speedup."""
    tokens = sum(len(g.token_ids) - 1 for g in runs)
    seconds = sum(g.decode_s for g in runs)
    drafted, accepted = sum(g.speculative.draft_tokens for g in runs), sum(g.speculative.accepted_tokens for g in runs)
    passes, draft_s = sum(g.speculative.target_forwards for g in runs), sum(g.speculative.draft_s for g in runs)
    return dict(tok_s=tokens / seconds if seconds else 0.0, alpha=accepted / drafted if drafted else 0.0,
                per_pass=(accepted + passes) / passes if passes else 0.0, drafts_per_pass=drafted / max(passes, 1),
                draft_share=draft_s / seconds if seconds else 0.0,
                same=all(g.token_ids == want.token_ids for g, want in zip(runs, plain)),
                speedups=Spread(tuple(tok_s(g) / tok_s(want) for g, want in zip(runs, plain) if tok_s(want))))


def main():
    small = quick()
    llm = lesson_model()
    repeats = 2 if small else 7

    print_table("Lesson 20 — the acceptance rule, enumerated over every draft token (6-token vocabulary)",
                ["draft q", "P(accept)", "max |emitted - p|"], the_rule_is_exact())

    T_values = [1, 2, 5] if small else [1, 2, 3, 5, 8, 16]
    load_start = load_average()
    form_rows, forms = verify_forms(T_values, repeats)
    print_table(f"verify forms: [T, 576] @ [3072, 576]ᵀ in µs, median (min-max) of {repeats} interleaved rounds "
                "(one BLAS thread: OPENBLAS_NUM_THREADS=1)",
                ["T rows", "x @ W.T (sgemm)", "T GEMVs", "W-blocks @ xᵀ (engine)"], form_rows)
    context = 32 if small else 200
    cost = pass_cost(llm.model, [1, 2, 5] if small else [1, 2, 3, 5, 9], min(repeats, 3), context)   # ms each: 3 do
    print_table(f"the target's forward over T new positions (cache of {context}): a verify pass of k = T - 1 drafts "
                f"(ms: median (min-max), the Ts taking turns)",
                ["T", "ms", "x one position"], [[T, c.ms(), f"{c.median / cost[1].median:.2f}"] for T, c in cost.items()])
    print(load_line(load_start))
    T_mid = T_values[len(T_values) // 2]
    check(f"at small T the engine's W-blocks @ xᵀ beats OpenBLAS's small-M sgemm (T = {T_mid})",
          forms[T_mid]["engine"].median < forms[T_mid]["sgemm"].median,
          f"engine {forms[T_mid]['engine'].format(1e6, 0)} µs vs sgemm {forms[T_mid]['sgemm'].format(1e6, 0)} µs")
    T_top = max(cost)
    check(f"a verify pass over {T_top} positions costs far less than {T_top} decode steps (under half of them)",
          cost[T_top].median < 0.5 * T_top * cost[1].median, f"{cost[T_top].median / cost[1].median:.2f}x one position")

    # The first prompt of three kinds, 16 tokens each: the model drafters below cost about two plain
    # decodes a token, and this table must fit in the lesson's minute with them.
    n, kinds = (8, ["edit text"]) if small else (16, ["edit code", "repeat text", "edit text"])
    first = {}
    for p in copy_heavy_prompts():
        first.setdefault(p["kind"], p)
    prompts = [prompt_ids(llm, first[kind]) for kind in kinds]
    half = max(1, llm.config.n_layers // 2)
    drafters = [("ngram", NgramDrafter(), k) for k in (2, 8)]
    drafters = [(f"ngram k={k}", d, k) for (_, d, k) in drafters]
    if not small:
        drafters += [(f"layers:{half} (early exit)", early_exit_drafter(llm.model, half), 2),
                     ("int4 self-draft", int4_drafter(llm.model), 2)]
    load_start = load_average()
    plain, stats = decode_in_turns(llm, drafters, prompts, n)
    plain_tok_s = sum(len(g.token_ids) - 1 for g in plain) / sum(g.decode_s for g in plain)
    rows, points = [["plain decode", "-", "-", "1.00", f"{plain_tok_s:.1f}", "1.00x", "-", "-"]], []
    for name, drafter, k in drafters:
        r = stats[name]
        a, m = r["alpha"], r["drafts_per_pass"]          # ngram drafts fewer than k where nothing matches
        predicted = (1 - a ** (m + 1)) / (1 - a) if a < 1 else m + 1
        rows.append([name, k, f"{a:.2f}", f"{r['per_pass']:.2f} (pred {predicted:.2f})", f"{r['tok_s']:.1f}",
                     f"{r['tok_s'] / plain_tok_s:.2f}x ({r['speedups'].low:.2f}-{r['speedups'].high:.2f})",
                     f"{r['draft_share']:.0%}", "yes" if r["same"] else "NO"])
        points.append((name, k, r["tok_s"] / plain_tok_s))
    print_table(f"greedy decode of {len(prompts)} copy-heavy prompts ({', '.join(kinds)}; {n} tokens each): "
                "speculative vs plain",
                ["drafter", "k", "acceptance α", "tokens/pass", "tok/s", "speedup (per-prompt range)", "time drafting",
                 "same tokens"], rows)
    ngram8 = stats["ngram k=8"]["tok_s"] / plain_tok_s
    print(f"plain and every drafter took turns on each prompt; {load_line(load_start)}")
    print(beside_reference("cpu.speculative.ngram", ngram8) + "; the reference decoded six copy-heavy prompts, 64 "
          "tokens each (`minillm bench --speculative ngram --new-tokens 64`): longer answers copy longer spans")
    check("prompt lookup (ngram, k = 8) decodes copy-heavy prompts faster than plain decoding", ngram8 > 1,
          f"{ngram8:.2f}x plain")
    print("Read it: with m drafts a pass, accepted independently with probability α, a pass yields "
          "(1 - α^(m+1)) / (1 - α) tokens (pred); real acceptances come in runs (a copied span is accepted "
          "whole, then nothing matches), so the measured count differs. The speedup is that divided by what a pass "
          "costs (the T = k + 1 row above) plus the drafting. ngram drafts for free, so a larger k pays "
          "wherever the answer copies; a model draft pays its own forward per drafted token, and a weak one "
          "(early exit of a model not trained for it) is rejected so often that it is slower than plain "
          "decoding. The output is the same either way: the target decides every token.")

    def draw(ax):
        labels = [f"{name}\nk={k}" for name, k, _ in points]
        ax.bar(range(len(points)), [s for *_, s in points])
        ax.axhline(1.0, color="gray", linestyle="--", label="plain decode")
        ax.set_xticks(range(len(points)), labels, fontsize=7)
        ax.set_ylabel("decode speedup"), ax.set_title("Lesson 20: speculative decoding on copy-heavy prompts")
        ax.legend()
    save_plot("20_speculative_decoding.png", draw)

    # NEW: the GPU's side of the same trade: what a verify pass and each draft cost there
    failed = run_gpu_parts([("step costs on the GPU (random weights of "
                             f"{'SmolLM2' if small else 'Mistral-7B'}'s shape; α from SmolLM2 on the CPU)",
                             lambda: gpu_step_costs(small))])
    if failed:
        sys.exit(1)


def gpu_step_costs(small: bool) -> None:
    """Plain decode step, verify pass (one CUDA graph) and draft steps on the GPU, and the tok/s they imply
    at the acceptance SmolLM2 reaches on the CPU (minillm.cuda.dev.speculative)."""
    from minillm.cuda.dev.speculative import MEASURED_ALPHA, print_report, projection, step_costs
    preset = "smollm2-135m" if small else "mistral-7b"
    costs = step_costs(preset, reps=5 if small else 20)
    print_report(preset, costs, projection(costs, MEASURED_ALPHA), MEASURED_ALPHA)
    print("Read it: a drafter pays when tokens/pass exceeds (k · draft + verify) / plain, i.e. above the "
          "break-even α. At Mistral-7B's shape on an H200 the verify pass costs ~1.7 plain steps, so only the "
          "free ngram drafts pay (lessons/BENCHMARKS.md); a GEMM that streams few rows as fast as the decode "
          "GEMV would move every break-even down.")


if __name__ == "__main__":
    main()
