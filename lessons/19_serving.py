"""Lesson 19 — serving: from `generate` to an API, and what the API costs.

Every lesson so far called the engine in-process. Users do not: they send HTTP requests to a server
that speaks OpenAI's API and read the answer as a stream of server-sent events (SSE). `minillm serve`
puts the continuous-batching engine behind such an API. One engine thread calls `engine.step()` for
everybody; the HTTP handlers only parse, tokenize, enqueue and await their request's events, so all
connected clients share one batch.

This lesson measures the same model three ways and prints them side by side: `generate` (one
request, no server, lesson 03's loop), the engine in-process, and the engine through HTTP, first for
one request, then for many users at once (serve_bench's closed loop). The gap between the last two
rows is the price of the API: HTTP, JSON, SSE and two threads handing events to each other.

Run: python lessons/19_serving.py      (MINILLM_LESSON_QUICK=1 for a smoke run; needs the serve extra)

Then watch it happen: start `minillm serve`, open http://127.0.0.1:8000 and send three messages, two of
them from a second tab while the first still streams: the engine view beside the chat shows their
requests join one batch, their KV blocks fill the pool (the chat template's shared prefix ringed) and
go back when they finish or you press stop. http://127.0.0.1:8000/plan is `minillm plan` with sliders.
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 17 (continuous batching)",
        "HTTP and JSON",
    ],
    "objectives": [
        "read a streamed completion's raw SSE lines",
        "measure one request through generate(), the Engine and HTTP",
        "compare the server's TTFT/ITL histograms with the clients' clocks",
    ],
    "study_time": "45 min, plus 20 min for exercise 19 (reading an SSE stream)",
    "check_questions": [
        "Why do HTTP handlers only enqueue and await, and who steps the model?",
        "Why is the client's TTFT larger than the server's?",
    ],
    "try_this": [
        "minillm serve -m smollm2-135m, then curl its /v1/completions with \"stream\": true",
        "minillm bench serve --url http://localhost:8000 with more users",
    ],
}
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.course.measure import Spread, check, load_average, load_line
from minillm.engine.generate import generate_ids
from minillm.engine.sampling import SamplingParams
from minillm.resources import install_hint
from minillm.tools.serve_bench import Result, Workload, format_table, random_workload, run_engine

try:
    import httpx

    from minillm.serve.server import create_app, serve_in_thread
    from minillm.tools.serve_client_bench import run_http, server_metrics
except Exception:   # ImportError, or minillm's one-line error that names the extra
    raise SystemExit(f"lesson 19 needs the HTTP server: {install_hint('serve')}") from None


def in_process_generate(llm, w: Workload) -> Result:
    """One request through lesson 03's loop (contiguous cache, no batching), as a table row."""
    g = generate_ids(llm.model, w.prompts[0], w.output_lens[0], SamplingParams())   # no stop ids: full length
    itl = g.decode_s / (len(g.token_ids) - 1) if len(g.token_ids) > 1 else 0.0
    return Result(w.name, "generate()", g.ttft_s + g.decode_s, len(g.token_ids), [g.ttft_s], [itl], 0)


# NEW: what a streamed answer looks like on the wire -------------------------------------------------
def show_the_wire(url: str, model: str, prompt: list[int]) -> list[str]:
    """The raw lines of a streamed /v1/completions answer: `data: {json}` events, then `data: [DONE]`."""
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        return [line for line in response.iter_lines() if line]


def histogram_mean(before: dict, after: dict, name: str) -> float:
    """The mean of what a Prometheus histogram observed between two scrapes: Δ_sum / Δ_count."""
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    return (after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)) / count if count else 0.0
# ---------------------------------------------------------------------------------------------------


def interleaved_runs(runs: dict, repeats: int) -> dict[str, list[Result]]:
    """Every run once a round, in turn, for `repeats` rounds (course/measure.py's order), so other work on the
    machine slows every path alike.  -> {path: [Result of each round]}"""
    results = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return results


def median_run(results: list[Result]) -> Result:
    """The round with the median inter-token latency: the row a table shows beside the range of all rounds."""
    return sorted(results, key=lambda r: r.row()["itl_mean_s"])[(len(results) - 1) // 2]


def main():
    llm = lesson_model()
    from minillm.engine.engine import Engine
    small = quick()
    vocab = llm.config.vocab_size
    n_out, n_users, concurrency, repeats = (3, 2, 2, 1) if small else (32, 12, 8, 2)
    prompt_len, output_len = (8, 3) if small else (48, 24)

    one = random_workload(1, vocab, prompt_len, n_out, seed=1)
    one.output_lens = [n_out]
    many = random_workload(n_users, vocab, prompt_len, output_len, seed=2)
    generate_ids(llm.model, one.prompts[0][:4], 2, SamplingParams())              # warm up

    # The server: the app, its engine, and uvicorn on a free loopback port in a background thread.
    app = create_app(llm, Engine(llm, max_batch=concurrency), "lesson-model")
    with serve_in_thread(app) as url:
        wire = show_the_wire(url, "lesson-model", one.prompts[0])
        load_start = load_average()
        rounds = interleaved_runs({"generate()": lambda: in_process_generate(llm, one),
                                   "Engine, in-process": lambda: run_engine(llm, one, 1, "Engine, in-process"),
                                   "Engine via HTTP": lambda: run_http(url, "lesson-model", one, 1, "Engine via HTTP")},
                                  repeats)
        single = [median_run(results) for results in rounds.values()]
        itls = {name: Spread(tuple(r.row()["itl_mean_s"] for r in results)) for name, results in rounds.items()}
        crowd = [run_engine(llm, many, concurrency, "Engine, in-process")]
        before = server_metrics(url)
        crowd.append(run_http(url, "lesson-model", many, concurrency, "Engine via HTTP"))
        after = server_metrics(url)

    print("\nA streamed answer on the wire (POST /v1/completions, stream=true), one event per engine step:")
    for line in wire:
        print("   ", line if len(line) <= 110 else line[:107] + "...")

    rows = []
    for r, itl in zip(single, itls.values()):
        d = r.row()
        rows.append([r.mode, r.output_tokens, f"{d['ttft_mean_s'] * 1e3:.0f}", itl.ms(),
                     f"{1 / d['itl_mean_s']:.1f}" if d["itl_mean_s"] else "-"])
    print_table(f"Lesson 19 — one request of {n_out} tokens, three ways (prompt {len(one.prompts[0])} tokens; the "
                f"paths took turns for {repeats} rounds: ITL median (min-max), the other columns the median round)",
                ["path", "tokens", "TTFT ms", "ITL ms", "decode tok/s"], rows)
    print(load_line(load_start))
    api_ms = (itls["Engine via HTTP"].median - itls["Engine, in-process"].median) * 1e3
    check("the API costs something per token on top of the same engine (JSON, SSE, a thread hop)", api_ms > 0,
          f"HTTP {itls['Engine via HTTP'].ms()} ms vs in-process {itls['Engine, in-process'].ms()} ms ITL")
    print(f"the API's price per token: {api_ms:+.1f} ms of ITL (HTTP - in-process, same engine); "
          f"paging + batching vs generate(): "
          f"{(single[1].row()['itl_mean_s'] - single[0].row()['itl_mean_s']) * 1e3:+.1f} ms")

    print(f"\n{many.name}: {n_users} requests, {concurrency} users at once, prompts ~{prompt_len} and "
          f"outputs ~{output_len} tokens (serve_bench's workload; HTTP row = minillm bench serve --url)")
    print(format_table(crowd))

    def finished(m):
        return int(sum(v for k, v in m.items() if k.startswith("minillm_requests_finished_total")))
    server_ttft = histogram_mean(before, after, "minillm_time_to_first_token_seconds")
    server_itl = histogram_mean(before, after, "minillm_inter_token_latency_seconds")
    http = crowd[1].row()
    print_table(f"the HTTP run's {n_users} requests: the server's /metrics next to its clients' clocks",
                ["measure", "server side", "client side", "client - server"],
                [["requests finished", finished(after) - finished(before), len(crowd[1].ttft_s), ""],
                 ["mean TTFT ms", f"{server_ttft * 1e3:.0f}", f"{http['ttft_mean_s'] * 1e3:.0f}",
                  f"{(http['ttft_mean_s'] - server_ttft) * 1e3:+.0f}"],
                 ["mean ITL ms", f"{server_itl * 1e3:.1f}", f"{http['itl_mean_s'] * 1e3:.1f}",
                  f"{(http['itl_mean_s'] - server_itl) * 1e3:+.1f}"],
                 ["largest batch", int(after.get("minillm_batch_size_max", 0)), "-", ""]])
    print("The server starts its clock when a request is queued and stops it when the engine hands out a "
          "token; the client also pays for the connection, the JSON and SSE framing, and the hop between "
          "the engine thread and the event loop. Users feel the client side.")

    def draw(ax):
        labels = [r.mode for r in single]
        ttft = [r.row()["ttft_mean_s"] * 1e3 for r in single]
        itl = [r.row()["itl_mean_s"] * 1e3 for r in single]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, ttft, 0.4, label="TTFT ms")
        ax.bar(x + 0.2, itl, 0.4, label="ITL ms")
        ax.set_xticks(x, labels)
        ax.set_title("Lesson 19: one request in-process vs through HTTP"), ax.legend()
    save_plot("19_serving.png", draw)


if __name__ == "__main__":
    main()
