"""`minillm bench serve`: many users at once, measured the way serving engines are measured.

A closed loop of `concurrency` clients: each sends a request, waits for its last token, sends the next,
until `requests` are done. The same requests run through five servers:

    sequential            one request at a time (llm.generate's loop, a contiguous KV cache; on the GPU
                          GPUTransformer's CUDA-graph decode: the fastest single-request path, so the
                          speedups below are over the best that batch 1 gets, not over a straw man)
    continuous batching   the Engine: every running request in one forward pass per step, paged KV
    + prefix caching      the Engine reusing the KV blocks of prompts' shared prefixes
    + int8 KV             the same with int8 keys and values (a quarter of the CPU's fp32 KV bytes)
    + speculative         the same with ngram speculative decoding (engine/speculative; CPU only): random
                          prompts give prompt lookup little to find, so this row shows what drafts cost
                          when they miss (lesson 20 and `minillm bench --speculative` show when they hit)

and each prints requests/s, output tokens/s, time to first token (mean, p90; waiting in the queue
counts: that is what a user feels), mean inter-token latency, and the peak KV bytes in use. On the GPU
the pool is 16-bit, and the int8 KV row holds int8 codes with a scale per position and head (about half).

The modes run in interleaved rounds: every round runs each mode once, in an order that rotates from
round to round, and each row is that mode's median round. Run one after another, a neighbour's burst of
work lands on whichever modes happen to run then and shows up as a fake speedup (issue 16: "+ prefix
caching 2.1x" with no cache hits); interleaved, it slows every mode alike. The load average is printed
at the start and the end, with a warning when it moved, and the spread column says how far a mode's
rounds were apart.

Two workloads: "random" (random prompt and output lengths, no sharing) and "agentic" (every prompt
starts with one long system prompt, `prefix_share` of its tokens, as agents' tool-laden prompts do).
Prompts are random token ids and every request runs to its output length (EOS ignored), so all
servers do exactly the same work (speculation: the same tokens, in fewer target passes when drafts land).
"""
from __future__ import annotations

import csv
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minillm.engine.batched import check_supported
from minillm.engine.engine import Engine
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.resources import install_hint

MODES = {"sequential": None,
         "continuous batching": dict(prefix_caching=False),
         "+ prefix caching": dict(prefix_caching=True),
         "+ int8 KV": dict(prefix_caching=True, kv_cache="int8"),
         "+ speculative": dict(prefix_caching=True, kv_cache="int8", speculative="ngram")}
FIRST_ID = 100                      # prompts avoid the low ids, where special tokens live


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]


def random_workload(n: int, vocab: int, prompt_len: int, output_len: int, seed: int = 0) -> Workload:
    """Prompt and output lengths uniform in [len/2, 3 len/2]; nothing shared."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len * 3 // 2 + 1, n)
    prompts = [rng.integers(FIRST_ID, vocab, m).tolist() for m in lengths]
    return Workload("random", prompts, _output_lens(rng, n, output_len))


def agentic_workload(n: int, vocab: int, prompt_len: int, output_len: int, prefix_share: float,
                     seed: int = 0) -> Workload:
    """One shared system prompt (prefix_share of prompt_len tokens), then each request's own part."""
    rng = np.random.default_rng(seed + 1)
    system = rng.integers(FIRST_ID, vocab, int(round(prefix_share * prompt_len))).tolist()
    own = max(1, prompt_len - len(system))
    prompts = [system + rng.integers(FIRST_ID, vocab, rng.integers(max(1, own // 2), own * 3 // 2 + 1)).tolist()
               for _ in range(n)]
    return Workload(f"agentic ({prefix_share:.0%} shared)", prompts, _output_lens(rng, n, output_len))


def _output_lens(rng, n: int, output_len: int) -> list[int]:
    return rng.integers(max(1, output_len // 2), output_len * 3 // 2 + 1, n).tolist()


@dataclass
class Result:
    workload: str
    mode: str
    wall_s: float
    output_tokens: int
    ttft_s: list[float]             # per request, queueing included
    itl_s: list[float]              # per request: mean gap between its tokens
    peak_kv_bytes: int
    prefix_hit_tokens: int = 0
    extra: dict = field(default_factory=dict)
    rounds: int = 1
    spread: float = 0.0             # (fastest - slowest round) / median round, output tok/s

    def row(self) -> dict:
        itl = [x for x in self.itl_s if x > 0]
        return {"workload": self.workload, "mode": self.mode, "requests": len(self.ttft_s),
                "requests_per_s": len(self.ttft_s) / self.wall_s, "output_tok_per_s": self.output_tokens / self.wall_s,
                "ttft_mean_s": float(np.mean(self.ttft_s)), "ttft_p90_s": float(np.percentile(self.ttft_s, 90)),
                "itl_mean_s": float(np.mean(itl)) if itl else 0.0, "peak_kv_bytes": self.peak_kv_bytes,
                "prefix_hit_tokens": self.prefix_hit_tokens, "wall_s": self.wall_s, "rounds": self.rounds,
                "tok_per_s_spread": self.spread}


# ---- the servers ----------------------------------------------------------------------------------

def run_sequential(llm, w: Workload, concurrency: int) -> Result:
    """One request at a time, first come first served; request i is sent when request i - concurrency
    is done (its client is free again), so waiting in the queue shows in its TTFT."""
    t0 = time.perf_counter()
    finished, ttft, itl, tokens = [], [], [], 0
    for i, (prompt, n_out) in enumerate(zip(w.prompts, w.output_lens)):
        arrival = finished[i - concurrency] if i >= concurrency else 0.0
        start = time.perf_counter() - t0
        g = generate_ids(llm.model, prompt, n_out, SamplingParams())          # no stop ids: runs to n_out
        finished.append(time.perf_counter() - t0)
        tokens += len(g.token_ids)
        ttft.append(start - arrival + g.ttft_s)
        itl.append(g.decode_s / (len(g.token_ids) - 1) if len(g.token_ids) > 1 else 0.0)
    kv_bytes = 2 if _on_gpu(llm) else 4                                      # the GPU's contiguous cache is 16-bit
    peak = max(llm.config.kv_bytes_per_token(kv_bytes) * (len(p) + m) for p, m in zip(w.prompts, w.output_lens))
    return Result(w.name, "sequential", finished[-1], tokens, ttft, itl, peak)


def run_engine(llm, w: Workload, concurrency: int, mode: str, **engine_options) -> Result:
    """The closed loop through the engine: `concurrency` requests in flight, a new one as one finishes."""
    engine = Engine(llm, max_batch=concurrency, **engine_options)
    n, t0 = len(w.prompts), time.perf_counter()
    arrival, first, last, count = [0.0] * n, [None] * n, [0.0] * n, [0] * n
    live: dict[int, int] = {}                                               # request id -> workload index

    def send(i: int) -> None:
        live[engine.add_request(w.prompts[i], max_tokens=w.output_lens[i], ignore_eos=True)] = i
        arrival[i] = time.perf_counter() - t0
    for i in range(min(concurrency, n)):
        send(i)
    sent = min(concurrency, n)
    while live:
        events = engine.step()
        now = time.perf_counter() - t0
        for e in events:
            i = live[e.request_id]
            if e.token_ids:
                first[i] = now if first[i] is None else first[i]
                last[i], count[i] = now, count[i] + len(e.token_ids)
            if e.finished:
                del live[e.request_id]
                if sent < n:
                    send(sent)
                    sent += 1
    ttft = [f - a for f, a in zip(first, arrival)]
    itl = [(l - f) / (c - 1) if c > 1 else 0.0 for f, l, c in zip(first, last, count)]
    stats = engine.stats()
    return Result(w.name, mode, time.perf_counter() - t0, sum(count), ttft, itl, stats["peak_kv_bytes"],
                  stats["prefix_hit_tokens"], dict(preemptions=stats["preemptions"]))


def run(llm, workloads: list[Workload], concurrency: int, rounds: int = 3, echo=print) -> list[Result]:
    """Every workload through every server, in `rounds` interleaved rounds; prints one table per
    workload (each row: the mode's median round) and the load average around the whole run."""
    check_supported(llm.model)
    on_gpu = _on_gpu(llm)
    generate_ids(llm.model, workloads[0].prompts[0][:8], 2, SamplingParams())   # warm up: first calls are slow
    modes = [m for m, options in MODES.items()   # the GPU engine has no speculative step yet (issue 23)
             if not (on_gpu and options and "speculative" in options)]
    if on_gpu:      # and the engine's first step compiles paged_attention.cu: keep that out of the timings
        Engine(llm, num_blocks=64).generate([p[:40] for p in workloads[0].prompts[:4]], max_tokens=2)
        for mode in modes:     # each pool geometry's decode graphs, captured once: the runs' engines recycle them
            if MODES[mode] is not None:
                Engine(llm, max_batch=concurrency, **MODES[mode]).runner.capture_buckets(concurrency)
    load_start = load_average()
    echo(f"load average (1 min): {_load(load_start)} on {os.cpu_count()} cores; {rounds} interleaved rounds")
    results = []
    for w in workloads:
        echo(f"\n{w.name}: {len(w.prompts)} requests, {concurrency} concurrent, prompts "
             f"{int(np.mean([len(p) for p in w.prompts]))} tokens and outputs {int(np.mean(w.output_lens))} "
             f"tokens on average")
        per_mode: dict[str, list[Result]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in round_order(modes, r):
                per_mode[mode].append(run_mode(llm, w, concurrency, mode))
        rows = [median_round(per_mode[m]) for m in modes]
        echo(format_table(rows))
        results += rows
    echo_load_at_end(load_start, echo)
    return results


def round_order(modes: list[str], r: int) -> list[str]:
    """The modes in round r's order: rotated a step each round, so that no mode always runs first."""
    return modes[r % len(modes):] + modes[:r % len(modes)]


def echo_load_at_end(load_start: float | None, echo) -> None:
    """The load average at both ends of the run, and a warning when it moved (load_warning)."""
    load_end = load_average()
    echo(f"load average (1 min): {_load(load_start)} at the start, {_load(load_end)} at the end")
    warning = load_warning(load_start, load_end)
    if warning:
        echo(warning)


def run_mode(llm, w: Workload, concurrency: int, mode: str) -> Result:
    options = MODES[mode]
    return run_sequential(llm, w, concurrency) if options is None else run_engine(llm, w, concurrency, mode, **options)


def median_round(results: list[Result]) -> Result:
    """A mode's median round by output tok/s (of an even count, the slower of the middle two), with
    the number of rounds and their spread."""
    speeds = sorted(r.row()["output_tok_per_s"] for r in results)
    median = speeds[(len(speeds) - 1) // 2]
    chosen = next(r for r in results if r.row()["output_tok_per_s"] == median)
    chosen.rounds, chosen.spread = len(results), (speeds[-1] - speeds[0]) / median if median else 0.0
    return chosen


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, all users), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):            # Windows
        return None


def load_warning(start: float | None, end: float | None, cores: int | None = None) -> str | None:
    """A warning when the machine's load moved by half a core or more during the run: other work then
    slowed some rounds more than others, and the spread column shows by how much."""
    if start is None or end is None or abs(end - start) < 0.5:
        return None
    cores = cores or os.cpu_count() or 1
    return (f"warning: the load average moved from {start:.2f} to {end:.2f} during the run ({cores} cores): "
            f"other work shared the machine, so compare modes with care (see the spread column; more "
            f"--rounds help)")


def _load(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def _on_gpu(llm) -> bool:
    return llm.batching.device == "cuda"


def format_table(results: list[Result]) -> str:
    header = (f"{'':22s} {'req/s':>7s} {'out tok/s':>9s} {'TTFT mean':>10s} {'TTFT p90':>9s} {'ITL mean':>9s} "
              f"{'peak KV':>9s} {'cache hits':>10s} {'spread':>7s}")
    lines = [header, "-" * len(header)]
    base = results[0].row()["output_tok_per_s"] if results else 0.0
    for r in results:
        d = r.row()
        speedup = f" ({d['output_tok_per_s'] / base:.1f}x)" if base and r is not results[0] else ""
        lines.append(f"{r.mode:22s} {d['requests_per_s']:7.2f} {d['output_tok_per_s']:9.1f} "
                     f"{d['ttft_mean_s'] * 1e3:8.0f}ms {d['ttft_p90_s'] * 1e3:7.0f}ms {d['itl_mean_s'] * 1e3:7.1f}ms "
                     f"{_mb(d['peak_kv_bytes']):>9s} {d['prefix_hit_tokens']:10d} "
                     f"{_spread(r)}{speedup}")
    return "\n".join(lines)


def _spread(r: Result) -> str:
    """How far the mode's rounds were apart (±half the range, % of the median); '-' for one round."""
    return f"{'-':>7s}" if r.rounds < 2 else f"{'±' + format(50 * r.spread, '.0f') + '%':>7s}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def write_csv(results: list[Result], path: str | Path) -> Path:
    path = Path(path)
    rows = [r.row() for r in results]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_png(results: list[Result], path: str | Path) -> Path | None:
    """Output tok/s and mean TTFT per server, one group of bars per workload; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = list(dict.fromkeys(r.workload for r in results))
    modes = list(MODES)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(modes)
    modes = [m for m in modes if any(r.mode == m for r in results)]          # a skipped mode has no bars
    for j, mode in enumerate(modes):
        rows = [next(r.row() for r in results if r.workload == w and r.mode == mode) for w in workloads]
        x = np.arange(len(workloads)) + j * width
        axes[0].bar(x, [d["output_tok_per_s"] for d in rows], width, label=mode)
        axes[1].bar(x, [d["ttft_mean_s"] * 1e3 for d in rows], width, label=mode)
    for ax, title in zip(axes, ["output tokens/s (higher is better)", "mean TTFT, ms (lower is better)"]):
        ax.set_xticks(np.arange(len(workloads)) + 0.4 - width / 2, workloads)
        ax.set_title(title)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_cli(llm, n_requests: int = 16, concurrency: int = 8, prefix_share: float = 0.75, workload: str = "both",
            prompt_len: int = 128, output_len: int = 32, csv_path=None, png_path=None, seed: int = 0,
            rounds: int = 3, echo=print) -> list[Result]:
    """What `minillm bench serve` does: build the workloads, run them, print, write the CSV and PNG."""
    from minillm.errors import MiniLLMError
    longest = prompt_len * 3 // 2 + output_len * 3 // 2
    if longest >= llm.config.max_seq_len:
        raise MiniLLMError(f"prompts and outputs of up to {longest} tokens do not fit this model's context of "
                           f"{llm.config.max_seq_len}: lower --prompt-len or --output-len")
    vocab, workloads = llm.config.vocab_size, []
    if workload in ("random", "both"):
        workloads.append(random_workload(n_requests, vocab, prompt_len, output_len, seed))
    if workload in ("agentic", "both"):
        workloads.append(agentic_workload(n_requests, vocab, prompt_len, output_len, prefix_share, seed))
    results = run(llm, workloads, concurrency, rounds, echo)
    if csv_path:
        echo(f"csv: {write_csv(results, csv_path)}")
    if png_path:
        path = write_png(results, png_path)
        echo(f"png: {path}" if path else f"png skipped: matplotlib is not installed ({install_hint('lessons')})")
    return results
