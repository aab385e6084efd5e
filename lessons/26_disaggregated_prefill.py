"""Lesson 26 — disaggregated prefill and decode: two workers, and the KV cache handed between them.

Lesson 03: prefill is compute-bound, decode memory-bound. Lesson 25: on one worker, every arriving
prompt's prefill stalls every running user's next token. Disaggregated serving (DistServe, Splitwise,
Mooncake; vLLM's and SGLang's PD disaggregation) gives each phase its own workers: a prefill worker
runs the prompt, then hands its paged KV blocks and the first token to a decode worker, which copies
them into free blocks of its own pool and decodes as if it had prefilled itself. Decode never stalls;
the price is the handoff, KV bytes/token × prompt tokens once per request, and the prefill workers.

Here both workers are processes on this machine (`minillm/engine/disaggregated.py`): spawned, each loads
its own weights, and the blocks cross a pipe as bytes. We check the greedy tokens equal one process's,
print what crossed and how long it took, then ask the planner when splitting pays on a GPU.

Run: python lessons/26_disaggregated_prefill.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 16 (paged KV: blocks and block tables)",
        "lesson 25 (latency targets: prefill stalls a batch)",
    ],
    "objectives": [
        "run prefill and decode in two processes and hand the prompt's KV blocks from one to the other",
        "show the decode worker's greedy tokens equal a single process's",
        "measure the handoff's bytes and time, and compare them with the prefill they move",
        "read the planner's model of when disaggregation pays: stalls saved against prefill GPUs paid",
    ],
    "study_time": "50 min, plus 25 min for exercise 26 (installing the handed-over blocks)",
    "check_questions": [
        "Why may the decode worker put the handed-over blocks in any free blocks of its pool?",
        "How many bytes does a 4,096-token prompt hand over for Llama-3-8B in bf16, and how long on 50 GB/s?",
        "Why does disaggregation pay more for short answers than for long ones?",
    ],
    "try_this": [
        "minillm plan -m llama-3-8b --latency-ms 30 --ttft-ms 500 --output-tokens 16",
        "change BLOCK_SIZE and check the tokens stay equal while the handoff's padding changes",
    ],
}
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import DEFAULT_LESSON_MODEL, MODEL_ENV, lesson_model, print_table, quick, save_plot
from minillm.course.measure import check, load_average, load_line
from minillm.engine.disaggregated import run_disaggregated
from minillm.model.config import PRESETS
from minillm.tools.latency_plan import meet_targets

BLOCK_SIZE = 16
PROMPT = ("Summarize in one sentence: the committee met on Tuesday to review the budget for the new library, "
          "agreed to move the opening to spring, and asked the architects for a cheaper roof. ")


def load_transformer(spec: str):
    """What each worker runs first: the lesson's model, loaded in its own process (a module-level function,
    so a spawned worker can find it)."""
    if spec.startswith("random:"):
        from minillm.llm import thread_policy
        from minillm.threads import install
        from minillm.tools.bench import random_model
        model = random_model(PRESETS[spec.split(":", 1)[1]].config)
        install(thread_policy(model))                  # BLAS threads measured, as minillm.load does
        return model
    import minillm
    return minillm.load(spec).model


def one_process(model, prompt: list[int], n_new: int) -> tuple[list[int], float, float]:
    """Greedy tokens with prefill and decode in this process: (tokens, prefill s, decode s)."""
    cache = model.new_cache(len(prompt) + n_new)
    start = time.perf_counter()
    tokens = [int(np.argmax(model.prefill(prompt, cache)))]
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    while len(tokens) < n_new:
        tokens.append(int(np.argmax(model.decode(tokens[-1], cache))))
    return tokens, prefill_s, time.perf_counter() - start


def main():
    small = quick()
    llm = lesson_model()
    spec = os.environ.get(MODEL_ENV) or DEFAULT_LESSON_MODEL
    n_new = 4 if small else 16
    repeats = [1] if small else [1, 4]                                  # prompts of 1 and 4 copies of PROMPT
    load_start = load_average()
    rows, runs = [], []
    for copies in repeats:
        prompt = llm.prompt_ids(PROMPT * copies, chat=False)
        want, prefill_s, decode_s = one_process(llm.model, prompt, n_new)
        # NEW: the same request through two processes, the KV blocks crossing a pipe between them
        run = run_disaggregated(functools.partial(load_transformer, spec), prompt, n_new, BLOCK_SIZE)
        runs.append(run)
        same = run.tokens == want
        rows.append([len(prompt), f"{run.handoff_bytes / 1e6:.2f}", f"{run.handoff_s * 1e3:.1f}",
                     f"{run.handoff_bytes / run.handoff_s / 1e9:.2f}", f"{prefill_s * 1e3:.0f}",
                     f"{run.prefill_s * 1e3:.0f}", f"{decode_s / max(n_new - 1, 1) * 1e3:.0f}",
                     f"{run.decode_s / max(n_new - 1, 1) * 1e3:.0f}", "yes" if same else "NO"])
        if not same:
            print(f"tokens differ! one process {want}, two processes {run.tokens}")
    kv_per_token = llm.config.kv_bytes_per_token(4)
    print_table(f"Lesson 26 — one request, prefill and decode in two processes ({n_new} greedy tokens; blocks of "
                f"{BLOCK_SIZE} positions, {kv_per_token:,} bytes of fp32 KV a position)",
                ["prompt tokens", "handoff MB", "handoff ms", "handoff GB/s", "prefill ms (1 proc)",
                 "prefill ms (2 procs)", "decode ms/token (1 proc)", "decode ms/token (2 procs)", "same tokens"], rows)
    print(f"text: {llm.tokenizer.decode(runs[-1].tokens)!r}")
    print(load_line(load_start))
    last = runs[-1]
    check("the handoff costs a small fraction of the prefill it moves off the decode worker",
          last.handoff_s < 0.5 * last.prefill_s,
          f"{last.handoff_s * 1e3:.1f} ms to hand over {last.handoff_bytes / 1e6:.1f} MB vs "
          f"{last.prefill_s * 1e3:.0f} ms of prefill for {last.prompt_tokens} tokens")

    # The planner's model of when it pays (minillm/tools/latency_plan.py), on a GPU: Llama-3-8B on an H100,
    # 30 ms a token, 1 s to the first token, 2,048-token prompts, answers of growing length.
    outputs = [16, 64, 256] if small else [8, 16, 32, 64, 128, 256, 512, 1024]
    plan_rows, curve = [], []
    for n_out in outputs:
        r = meet_targets("llama-3-8b", "h100", 30, 1000, 2048, n_out, dtypes=("bf16",))[0]
        co, dis = r.colocated, r.disaggregated
        gain = dis.tok_s_per_gpu / co.tok_s_per_gpu if co and dis else float("nan")
        curve.append((n_out, gain))
        plan_rows.append([n_out, co.batch if co else "-", f"{co.tok_s_per_gpu:,.0f}" if co else "-",
                          dis.batch if dis else "-", f"{dis.gpus:.2f}" if dis else "-",
                          f"{dis.tok_s_per_gpu:,.0f}" if dis else "-", f"{gain:.2f}x",
                          "pays" if r.disaggregation_pays else "does not pay"])
    print_table("when disaggregation pays, modelled: Llama-3-8B bf16 on H100s, <= 30 ms a token, first token <= 1 s, "
                "2,048-token prompts (minillm plan -m llama-3-8b --latency-ms 30 --ttft-ms 1000 --prompt-tokens 2048 "
                "--output-tokens N)",
                ["output tokens", "colocated batch", "colocated tok/s/GPU", "decode batch", "GPUs (decode + prefill share)",
                 "disaggregated tok/s/GPU", "gain", "verdict"], plan_rows)
    print("Short answers bring a new prompt every few steps: colocated, their prefills stall the batch so often "
          "that it must stay small; split, the decode GPU keeps its whole batch and the prefill GPUs cost less "
          "than the stalls. Long answers rarely stall, and the prefill GPUs are overhead.")

    def draw(ax):
        ax.plot([c[0] for c in curve], [c[1] for c in curve], "o-")
        ax.axhline(1.0, color="gray", linestyle="--", label="break-even")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("output tokens per request"), ax.set_ylabel("tok/s per GPU: disaggregated / colocated")
        ax.set_title("Lesson 26: when splitting prefill from decode pays (modelled)", fontsize=10)
        ax.legend(), ax.grid(alpha=0.3)
    save_plot("26_disaggregation.png", draw)


if __name__ == "__main__":
    main()
