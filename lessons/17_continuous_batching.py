"""Lesson 17 — continuous batching: watch the scheduler admit, batch, preempt and finish, step by step.

Decode reads every weight once per step (lesson 03) whether the step serves one user or sixteen, so
serving many users at once is nearly free, if they can share steps. Static batching groups requests and
runs each group until its longest answer is done: short answers idle in the batch, newcomers wait for
the whole group. Continuous batching (Orca; vLLM) decides again at every step: finished requests leave,
waiting ones join, a long prompt enters in chunks beside the running decodes, and when the KV pool is
full the newest request is preempted (its blocks freed, recomputed later). `minillm.Engine` is that
loop: `step()` = schedule (scheduler.py) + one batched forward pass (batched.py) + sampling. On a GPU the
lesson also times that forward pass eagerly and as a CUDA graph per batch bucket (cuda/gpu_batched.py), and
the attention of a step full of prompt chunks: one key at a time (the paged kernels) vs on the tensor cores.
Exercise 17.2 has you write that step's decision (who runs how many tokens, whom to preempt) as a policy;
the grader replays it on its own block pool, so what it checks is what this lesson prints: every request
finishes, and the pool never hands out a block it does not have.

Run: python lessons/17_continuous_batching.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 16 (paged KV)",
    ],
    "objectives": [
        "follow the scheduler step by step: prefill chunks, decodes, preemption by recompute",
        "show batched greedy tokens equal each request alone",
        "measure throughput and TTFT of sequential, static and continuous batching",
    ],
    "study_time": "60 min, plus 30 min for exercise 17 (packing a batch)",
    "check_questions": [
        "Why does a decode step for B users cost little more than for one?",
        "What would happen to a full pool without preemption?",
    ],
    "try_this": [
        "minillm bench serve -m smollm2-135m --random-weights --requests 16",
        "shrink the pool in the step-by-step table and count the preemptions",
    ],
}
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.engine.batched import SeqChunk
from minillm.course import lesson_model, print_table, quick, run_gpu_parts, save_plot
from minillm.course.measure import Spread, beside_reference, check, interleaved, load_average, load_line
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams


# NEW: watching the scheduler: what each step runs, who waits, what the pool holds --------------------
def traced_steps(engine: Engine, max_rows: int) -> list[list]:
    """Run the engine to the end, one table row per step."""
    scheduler, rows, seen = engine.scheduler, [], {}
    schedule = scheduler.schedule

    def schedule_and_describe():                 # the batch, described before the model runs it
        batch = schedule()
        seen["batch"] = [describe(seq, n) for seq, n in batch]
        return batch
    scheduler.schedule = schedule_and_describe
    while engine.has_unfinished():
        was_running = list(scheduler.running)
        events = engine.step()
        s = engine.stats()
        preempted = [f"r{q.request_id}" for q in scheduler.waiting if q in was_running]
        rows.append([s["steps"], "  ".join(seen.get("batch", [])) or "-",
                     " ".join(f"r{q.request_id}" for q in scheduler.waiting) or "-",
                     f"{s['blocks_used']}/{s['blocks_total']}",
                     " ".join(f"r{e.request_id}" for e in events if e.finished) or "-",
                     " ".join(preempted) or "-"])
        seen.clear()
    scheduler.schedule = schedule
    return rows[:max_rows]


def describe(seq, n: int) -> str:
    start = seq.num_computed
    if start >= seq.prompt_len:
        return f"r{seq.request_id}:decode@{start}"
    kind = "prefill" if len(seq.tokens) == seq.prompt_len else "recompute"
    return f"r{seq.request_id}:{kind} {start}-{start + n - 1}"
# ---------------------------------------------------------------------------------------------------


def offline(llm, prompts, outs, max_batch: int, static: bool) -> tuple[float, float]:
    """Every request queued at t = 0. Static: groups of max_batch, each run to its end before the
    next starts. Continuous: the engine refills the batch every step.   -> (output tok/s, mean TTFT s)"""
    engine, first, t0, total = Engine(llm, max_batch=max_batch), {}, time.perf_counter(), 0
    groups = [range(i, i + max_batch) for i in range(0, len(prompts), max_batch)] if static else [range(len(prompts))]
    for group in groups:
        ids = {engine.add_request(prompts[i], max_tokens=outs[i], ignore_eos=True): i for i in group if i < len(prompts)}
        while engine.has_unfinished():
            for e in engine.step():
                first.setdefault(ids[e.request_id], time.perf_counter() - t0)
                total += len(e.token_ids)
    return total / (time.perf_counter() - t0), float(np.mean(list(first.values())))


def sequential(llm, prompts, outs) -> tuple[float, float]:
    t0, first, total = time.perf_counter(), [], 0
    for p, m in zip(prompts, outs):
        start = time.perf_counter() - t0
        g = generate_ids(llm.model, p, m, SamplingParams())
        first.append(start + g.ttft_s)
        total += len(g.token_ids)
    return total / (time.perf_counter() - t0), float(np.mean(first))


def step_times(engine: Engine, sizes: list[int], context: int, rounds: int) -> dict[int, Spread]:
    """Seconds of one decode step for B sequences of `context` positions each, for each B in `sizes`; the
    batch sizes take turns (course/measure.py), so other work on the machine slows them alike."""
    tables = [[engine.blocks.allocate() for _ in range(context // engine.pool.block_size + 1)]
              for _ in range(max(sizes))]                                # the batches share these sequences
    chunks = [SeqChunk([7], context, t) for t in tables]
    times = interleaved({b: lambda b=b: engine.runner.forward(chunks[:b]) for b in sizes}, rounds)
    for t in tables:
        engine.blocks.release_all(t)
    return times


def main():
    small = quick()
    llm = lesson_model()
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(0)

    # 1. Five requests, a batch of 3, 24 tokens a step, a pool of 7 blocks of 8 positions.
    lengths, outs = [20, 6, 33, 12, 9], [4, 14, 3, 6, 8]
    trace_prompts = [rng.integers(100, vocab, n).tolist() for n in lengths]
    engine = Engine(llm, block_size=8, num_blocks=7, max_batch=3, max_batch_tokens=24)
    for p, m in zip(trace_prompts, outs):
        engine.add_request(p, max_tokens=m, ignore_eos=True)
    trace = traced_steps(engine, max_rows=40)

    # 2. Same tokens as one request at a time? (greedy, fp32)
    alone = [generate_ids(llm.model, p, m, SamplingParams()).token_ids for p, m in zip(trace_prompts, outs)]
    together = Engine(llm, block_size=8, num_blocks=7, max_batch=3, max_batch_tokens=24).generate(
        trace_prompts, max_tokens=max(outs))
    same = sum(a == g.token_ids[:len(a)] for a, g in zip(alone, together))

    # 3. Sequential vs static vs continuous batching, all requests queued at once.
    n_req, batch = (6, 3) if small else (12, 6)
    prompts = [rng.integers(100, vocab, rng.integers(8, 24 if small else 64)).tolist() for _ in range(n_req)]
    gen = [int(x) for x in rng.integers(2, 6, n_req)] if small else [int(x) for x in rng.choice([4, 8, 32], n_req)]
    results = {"sequential (one at a time)": sequential(llm, prompts, gen),
               f"static batches of {batch}": offline(llm, prompts, gen, batch, static=True),
               f"continuous, batch {batch}": offline(llm, prompts, gen, batch, static=False)}
    base = results["sequential (one at a time)"][0]
    mode_rows = [[name, f"{tps:.1f}", f"{tps / base:.1f}x", f"{ttft * 1e3:.0f}"] for name, (tps, ttft) in results.items()]

    # 4. Why it works: one decode step for B sequences costs far less than B steps.
    engine = Engine(llm, num_blocks=1024)
    context = 32 if small else 256
    sizes = (1, 2, 4) if small else (1, 2, 4, 8, 16, 32)
    load_start = load_average()
    times = step_times(engine, sizes, context, 1 if small else 3)
    ms = {b: 1e3 * times[b].median for b in sizes}
    batch_rows = [[b, times[b].ms(), times[b].rate(b), f"{b * ms[1] / ms[b]:.1f}x"] for b in sizes]

    print_table("Lesson 17 — the scheduler, step by step (5 requests, max_batch 3, 24 tokens/step, 7 blocks of 8)",
                ["step", "batch: request:what (positions)", "waiting", "blocks", "finished", "preempted"], trace)
    print(f"prompts {lengths}, max_tokens {outs}. A long prompt enters in chunks beside the decodes (the\n"
          "step's token budget); a waiting request joins the step after another leaves; when the pool runs\n"
          "dry the newest running request is preempted: its blocks are freed and it goes back to the front\n"
          "of the queue, to be recomputed (prompt + output so far) from its first block that is not still\n"
          "in the prefix cache.")
    print(f"batched greedy tokens equal each request run alone: {same}/{len(alone)}")
    print_table(f"{n_req} requests queued at once, outputs of {sorted(set(gen))} tokens",
                ["server", "output tok/s", "vs sequential", "mean TTFT ms"], mode_rows)
    print("Static batches wait for their longest answer and make the next group wait too; continuous\n"
          "batching refills every free slot at the next step.")
    speedup = results[f"continuous, batch {batch}"][0] / base
    print(beside_reference("cpu.serve.8-users", speedup) + f" — yours: {n_req} requests at batch {batch}, one run each")
    check("continuous batching serves more tokens per second than one request at a time", speedup > 1,
          f"continuous {speedup:.1f}x sequential")
    print_table(f"one decode step for B sequences of {context} positions (median (min-max) of interleaved rounds)",
                ["B", "ms/step", "tok/s", "speedup"], batch_rows)
    print(load_line(load_start))
    print("The weights are read once per step for the whole batch: until the matmuls turn compute-bound,\n"
          "B sequences cost little more than one. One CPU core turns compute-bound within a few rows (a GPU\n"
          "only past dozens), and OpenBLAS multiplies 2-3 rows more slowly than 1 or 4 (its small-matrix\n"
          "kernels), so the curve here is modest and not smooth.")

    # 5. On a GPU: the same step for B sequences of a Mistral-7B, launched kernel by kernel vs replayed as one CUDA
    #    graph per batch bucket (gpu_batched.py), and attention reading each K/V row once per GQA group.
    failed = run_gpu_parts([("the batched decode step on a GPU: eager vs CUDA graph, per-head vs GQA-group attention",
                             lambda: gpu_batched_step(small)),
                            ("a prefill step's attention: the paged kernels vs the tensor cores",
                             gpu_prefill_attention)])

    def draw(ax):
        ax.plot(sizes, [b * 1e3 / ms[b] for b in sizes], marker="o")
        ax.set_xscale("log", base=2), ax.set_xlabel("sequences per decode step"), ax.set_ylabel("tokens/s")
        ax.set_title("Lesson 17: decode throughput vs batch size")
    save_plot("17_continuous_batching.png", draw)
    return 1 if failed else 0


def gpu_batched_step(small: bool) -> None:
    """minillm.cuda.dev.serve_step: graph logits checked against eager ones first, then ms a step (H200, 64 rows:
    11.6 ms eager, 8.5 ms as a graph; attention 108 -> 65 µs a layer with a block per GQA group)."""
    from minillm.cuda.dev.serve_step import main as serve_step
    if serve_step(["--preset", "smollm2-135m" if small else "mistral-7b", "--batches", "1,8,32,64"]) != 0:
        raise RuntimeError("serve_step's checks failed (graph vs eager logits, or the two attention kernels)")
    print("On a GPU the 64-row step reads the weights once for 64 tokens, as on the CPU; eagerly, ~11 launches a\n"
          "layer from Python cost as much as the weight reads, so the step is captured once per batch bucket\n"
          "(padded rows write nothing) and replayed: minillm bench serve --device cuda measures the whole server.")


def gpu_prefill_attention() -> None:
    """minillm.cuda.dev.paged_attention.prefill_timing: one Mistral-7B layer's attention for 16 prompt chunks of
    128 rows, checked against each other (H200: 554 µs on the paged kernels, 60 µs on the tensor cores)."""
    from minillm.cuda.dev import common
    from minillm.cuda.dev.paged_attention import prefill_timing
    failed = len(common.FAILED)
    prefill_timing()
    if len(common.FAILED) > failed:
        raise RuntimeError("the tensor-core prefill attention differs from the paged kernels")
    print("A decode row has one query, so reading its keys one by one is all there is to do. A prompt chunk has\n"
          "128 queries over the same keys: the tensor-core kernel loads a tile of keys once for 64 query rows and\n"
          "multiplies them as matrices (lesson 24's FlashAttention, its K/V tiles read through the block table).\n"
          "The engine uses it for every step with a prompt chunk over a 16-bit pool (head_dim 64 or 128).")


if __name__ == "__main__":
    sys.exit(main())
