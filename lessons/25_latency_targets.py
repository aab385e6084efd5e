"""Lesson 25 — planning for a latency target: which GPU, which precision, how many users at once.

A service promises its users a time per output token (say 30 ms: faster than reading) and a time to
first token (say 300 ms). Lesson 03 showed a decode step reads every weight once for the whole batch,
so more users at once make tokens cheaper, until the step itself breaks the promise. Lesson 17's
continuous batching adds a second cost: each arriving prompt is prefilled between decode steps, and
every running user waits for it. With B users each decoding N_out tokens, B / N_out prompts arrive per
step, so

    time per output token = t_step(B) + (B / N_out) × t_prefill      time to first token = t_step(B) + t_prefill

The serving workshop's workflow, in two commands: rank the GPUs by dollars per 1M output tokens at the
per-token target (`minillm plan --latency-ms 30 --min-batch 8`), then on the chosen GPU find the precision
and batch that meet both targets (`minillm plan --latency-ms 30 --ttft-ms 300 --gpu h100`). Then we do the
same on this machine, measured: the decode step at every batch, one prefill, and the largest batch that
keeps the promise (exercise 25 writes that choice).

Run: python lessons/25_latency_targets.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 03 (decode reads the weights once a step)",
        "lesson 07 (the planner: users from bytes)",
        "lesson 17 (continuous batching)",
    ],
    "objectives": [
        "state a service's promise as a time per output token and a time to first token",
        "model how arriving prompts' prefills stall a batch, and find the largest batch that keeps both promises",
        "run the workshop's workflow: rank GPUs by $ per 1M tokens, then pick precision and batch on one",
        "measure the decode step at every batch on this machine and choose a batch from the measurements",
    ],
    "study_time": "50 min, plus 25 min for exercise 25 (the batch for a target)",
    "check_questions": [
        "Why does a bigger batch make tokens cheaper, and what stops it growing forever?",
        "With outputs of 8 tokens instead of 256, what happens to the largest batch that meets 30 ms, and why?",
        "Why can int4 weights serve more users at the same target than bf16 on the same GPU?",
    ],
    "try_this": [
        "minillm plan -m llama-3-8b --latency-ms 30 --min-batch 8",
        "minillm plan -m llama-3-8b --gpu l40s --latency-ms 30 --ttft-ms 300 --output-tokens 32",
        "raise LATENCY_FACTOR in this lesson and watch the measured batch grow; shorten output_tokens and watch it shrink",
    ],
}
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.course.ex_deploy import batch_for_target_reference
from minillm.course.measure import check, interleaved, load_average, load_line
from minillm.engine.batched import SeqChunk
from minillm.engine.engine import Engine
from minillm.tools.bench import gemv_bandwidth, matmul_flops
from minillm.tools.latency_plan import meet_targets, targets_cli
from minillm.tools.planner import GPU, plan, rank_cli

LATENCY_FACTOR = 3.0     # this machine's per-token target: 3 × one user's decode step
TTFT_FACTOR = 2.0        # its first-token target: 2 × one prompt's prefill


# NEW: the measured decode step at every batch, and one prefill ------------------------------------
def step_contestants(engine: Engine, batches: list[int], context: int) -> dict[str, callable]:
    """One decode step of `batch` sequences at `context` positions, for each batch: ready to time."""
    tables = [[engine.blocks.allocate() for _ in range(context // engine.pool.block_size + 1)]
              for _ in range(max(batches))]                                    # the batches share these users
    chunks = [SeqChunk([7], context, t) for t in tables]                      # one new token each
    return {f"batch {b}": lambda b=b: engine.runner.forward(chunks[:b]) for b in batches}


def this_machine(name: str = "this CPU") -> GPU:
    """The planner's GPU record for this CPU: measured GEMV bandwidth and matmul FLOP/s, its RAM, no price."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        memory = 8e9
    return GPU(name, float(memory), gemv_bandwidth(nbytes=256 << 20), matmul_flops(n=1536), 0.0)
# ---------------------------------------------------------------------------------------------------


def main():
    small = quick()
    # 1. The workshop's workflow on GPUs: the planner's roofline model, no GPU needed.
    print("Lesson 25 — step 1: which GPU? (minillm plan -m llama-3-8b --latency-ms 30 --min-batch 8)\n")
    print(rank_cli("llama-3-8b", 30, 8))
    print("\nstep 2: on the H100, which precision and batch keep 30 ms a token and a 300 ms first token for "
          "1,024-token prompts? (minillm plan -m llama-3-8b --gpu h100 --latency-ms 30 --ttft-ms 300)\n")
    print(targets_cli("llama-3-8b", "h100", 30, 300, 1024, 256))

    # 2. The same on this machine, measured.
    llm = lesson_model()
    cfg = llm.config
    batches = [1, 2, 3] if small else list(range(1, 13))
    prompt_len, output_tokens = (32, 16) if small else (128, 128)
    context, rounds = prompt_len + output_tokens, 1 if small else 3
    engine = Engine(llm, block_size=16, max_batch=max(batches))
    load_start = load_average()
    steps = interleaved(step_contestants(engine, batches, context), rounds)      # {name: Spread of seconds}
    prompt = np.random.default_rng(0).integers(100, cfg.vocab_size, prompt_len).tolist()
    prefill = interleaved({"prefill": lambda: llm.model.prefill(prompt, llm.model.new_cache(prompt_len))},
                          rounds)["prefill"]
    cpu = this_machine()
    step_ms = np.array([steps[f"batch {b}"].median * 1e3 for b in batches])       # [max_batch] medians
    modelled = [plan(cfg, cpu, "fp32", "fp32", context, b).step_time_s * 1e3 for b in batches]
    rows = [[b, steps[f"batch {b}"].ms(), f"{b / steps[f'batch {b}'].median:.1f}", f"{m:.1f}",
             f"{step_ms[i] / m:.1f}x"] for i, (b, m) in enumerate(zip(batches, modelled))]
    print_table(f"\nthis machine: one decode step of SmolLM2-shaped {cfg.n_layers} layers at {context} positions a "
                f"user, ms: median (min-max) of {rounds} interleaved rounds; modelled = the planner's roofline "
                f"with this CPU's {cpu.bandwidth / 1e9:.1f} GB/s and {cpu.bf16_flops / 1e9:.0f} GFLOP/s",
                ["batch", "step ms", "tok/s", "modelled ms", "measured / modelled"], rows)
    print(f"prefill of {prompt_len} tokens: {prefill.ms()} ms; {load_line(load_start)}")
    check("a batch of users costs far less than their steps one at a time (decode reads the weights once a step)",
          step_ms[-1] < 0.5 * batches[-1] * step_ms[0],
          f"batch {batches[-1]}: {step_ms[-1]:.0f} ms vs {batches[-1]} × {step_ms[0]:.0f} ms at batch 1")

    # 3. The promise for this machine, and the largest batch that keeps it: exercise 25's function.
    latency_ms, ttft_ms = LATENCY_FACTOR * step_ms[0], TTFT_FACTOR * prefill.median * 1e3
    chosen = batch_for_target_reference(step_ms, prefill.median * 1e3, output_tokens, latency_ms, ttft_ms)
    model_rows = meet_targets(cfg, cpu, latency_ms, ttft_ms, prompt_len, output_tokens, context, ("fp32",), "fp32")
    predicted = model_rows[0].colocated.batch if model_rows[0].colocated else 0
    per_token = step_ms + np.array(batches) / output_tokens * prefill.median * 1e3
    print_table(f"the promise here: <= {latency_ms:.0f} ms a token ({LATENCY_FACTOR:g} × batch 1's step), first token "
                f"<= {ttft_ms:.0f} ms; {output_tokens}-token answers, so batch / {output_tokens} prefills stall "
                f"each step",
                ["batch", "ms a token (step + stalls)", "first token ms", "keeps it"],
                [[b, f"{per_token[i]:.1f}", f"{step_ms[i] + prefill.median * 1e3:.0f}",
                  "yes" if per_token[i] <= latency_ms and step_ms[i] + prefill.median * 1e3 <= ttft_ms else "no"]
                 for i, b in enumerate(batches)])
    top = "" if chosen < batches[-1] else f" (every batch measured keeps it: measure beyond {batches[-1]})"
    print(f"largest batch that keeps the promise, measured: {chosen}{top}; the planner's model of this CPU says "
          f"{predicted or 'none'} (it knows bytes and FLOPs, not Python's cost per step)")

    def draw(ax):
        ax.plot(batches, per_token, "o-", label="measured: step + prefill stalls (a user's ms a token)")
        ax.plot(batches, step_ms, "o:", label="measured: decode step alone")
        ax.plot(batches, modelled, "s--", label="planner's model of this CPU: decode step alone")
        ax.axhline(latency_ms, color="k", linestyle=":", label=f"target {latency_ms:.0f} ms a token")
        if chosen:
            ax.axvline(chosen, color="tab:green", alpha=0.5, label=f"chosen batch {chosen}")
        ax.set_xlabel("batch (users decoding at once)"), ax.set_ylabel("ms per output token")
        ax.set_title("Lesson 25: the largest batch that keeps the latency promise"), ax.legend(), ax.grid(alpha=0.3)
    save_plot("25_latency_target.png", draw)


if __name__ == "__main__":
    main()
