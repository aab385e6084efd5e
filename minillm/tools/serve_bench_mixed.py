"""`minillm bench serve --workload mixed`: can one client slow another down? (issue 40)

One client chats: short prompts, each reply streamed to its end, the next turn sent at once, so it
decodes steadily. While a reply streams, a second client sends one long prompt (7,500 tokens by default:
about 40 KB of text for SmolLM2, whose context is 8192). Measured: the chat's longest wait for a token
while the long prompt prefills (what its user feels; a new turn's wait for its first token counts) and
the long prompt's time to first token (what the step budget costs its sender).

Two engines run it, in interleaved rounds (serve_bench.py says why), on the same prompts:

    before   max_batch_tokens=0: 512-token chunks (2048 on a GPU) in arrival order, the scheduler before
             the step budget
    after    the default: decodes first, and a step's prompt chunk beside other requests sized to the
             target step time, measured as it runs (engine/step_budget.py)

The long prompt arrives when the chat's reply has a quarter of its tokens left, so the chat's next turn
is sent while the long prompt prefills: before the budget, such a turn waited for the rest of the prefill.
Prompts are random token ids and replies run to their length (EOS ignored), as in the other workloads.
"""
from __future__ import annotations

import csv
import itertools
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from minillm.engine.engine import Engine
from minillm.engine.step_budget import DEFAULT_TARGET_STEP_MS
from minillm.errors import MiniLLMError
from minillm.threads import policy
from minillm.tools.serve_bench import FIRST_ID, _load, echo_load_at_end, load_average, round_order

DEFAULT_LONG_PROMPT = 7500


@dataclass
class MixedRound:
    mode: str
    chat_max_gap_s: float       # the chat's longest wait for a token while the long prompt prefilled (a new
                                # turn's first token included: its own queueing and prefill)
    chat_max_itl_s: float       # the longest gap between two tokens of one reply (inside a stream) meanwhile
    long_ttft_s: float          # the long prompt's arrival to its first token
    chat_itl_s: float           # the chat's median gap between tokens before the long prompt arrived
    chat_tokens: int            # chat tokens streamed while the long prompt prefilled
    steps: int                  # engine steps from the long prompt's arrival to its first token


def modes(target_step_ms: float | None = None) -> dict[str, dict]:
    """The two engines compared: their names and Engine options."""
    target = target_step_ms or DEFAULT_TARGET_STEP_MS
    return {"before (arrival order)": dict(max_batch_tokens=0),
            f"after (target {target:g} ms)": dict(target_step_ms=target)}


def run_round(llm, mode: str, options: dict, chat_prompts: list[list[int]], chat_output_len: int,
              long_prompt: list[int]) -> MixedRound:
    """One engine, the chat streaming, the long prompt sent near the end of the chat's first reply; runs
    until the long prompt's first token."""
    engine = Engine(llm, **options)
    turns = itertools.cycle(chat_prompts)

    def next_turn() -> int:
        return engine.add_request(next(turns), max_tokens=chat_output_len, ignore_eos=True)
    chat, chat_times, turn = next_turn(), [], 0                         # chat_times: (turn, time) a token
    left, trigger = chat_output_len, max(1, chat_output_len // 4)          # tokens left in the chat's reply
    long = arrival = first = None
    steps = 0
    while first is None:
        events = engine.step()
        now = time.perf_counter()
        if long is not None:
            steps += 1
        for e in events:
            if e.request_id == long and e.token_ids:
                first = now
            elif e.request_id == chat:
                chat_times += [(turn, now)] * len(e.token_ids)
                left -= len(e.token_ids)
                if e.finished:                                   # the next turn, sent at once
                    chat, left, turn = next_turn(), chat_output_len, turn + 1
        if long is None and left <= trigger:
            long, arrival = engine.add_request(long_prompt, max_tokens=1, ignore_eos=True), time.perf_counter()
    engine.abort(chat)
    warm = [t for _, t in chat_times if t <= arrival]
    during = [t for _, t in chat_times if arrival < t <= first]
    marks = [arrival] + during + [first]
    in_stream = [t - max(t0, arrival) for (k0, t0), (k, t) in zip(chat_times, chat_times[1:])
                 if k == k0 and arrival < t <= first]                   # a reply's token after its previous one
    return MixedRound(mode, max(b - a for a, b in zip(marks, marks[1:])), max(in_stream, default=0.0),
                      first - arrival, float(np.median(np.diff(warm))) if len(warm) > 1 else 0.0, len(during),
                      steps)


def run(llm, chat_prompts: list[list[int]], chat_output_len: int, long_prompt: list[int], rounds: int = 3,
        target_step_ms: float | None = None, echo=print) -> dict[str, list[MixedRound]]:
    """Every mode once a round, in an order that rotates; prints the table and the load around it."""
    compared = modes(target_step_ms)
    names = list(compared)
    Engine(llm).generate([chat_prompts[0][:8]], max_tokens=2)          # warm up: first calls are slow
    echo(f"mixed: a chat ({len(chat_prompts[0])}-token prompts, {chat_output_len}-token replies, back to back) "
         f"streams while a {len(long_prompt)}-token prompt arrives; {rounds} interleaved rounds")
    echo(f"threads: {policy() or 'BLAS as NumPy set it up (no policy installed)'}")
    load_start = load_average()
    echo(f"load average (1 min): {_load(load_start)} on {os.cpu_count()} cores at the start")
    per_mode: dict[str, list[MixedRound]] = {m: [] for m in names}
    for r in range(rounds):
        for mode in round_order(names, r):
            per_mode[mode].append(run_round(llm, mode, compared[mode], chat_prompts, chat_output_len, long_prompt))
    echo(format_table(per_mode))
    echo_load_at_end(load_start, echo)
    return per_mode


def format_table(per_mode: dict[str, list[MixedRound]]) -> str:
    """One row per mode (medians over its rounds, and the chat's worst gap of any round), then the ratios. 'chat
    max gap' counts every wait for a chat token, a new turn's first included; 'in a reply' only the gaps inside
    one streamed reply (the inter-token latency a user watching a stream sees)."""
    header = (f"{'':24s} {'chat max gap':>12s} {'worst round':>11s} {'in a reply':>10s} {'long TTFT':>10s} "
              f"{'chat ITL':>9s} {'chat tokens':>11s} {'steps':>6s}")
    lines = [header, "-" * len(header)]
    rows = {mode: summary(rs) for mode, rs in per_mode.items()}
    for mode, d in rows.items():
        lines.append(f"{mode:24s} {d['chat_max_gap_s']:11.2f}s {d['worst_gap_s']:10.2f}s "
                     f"{d['chat_max_itl_s']:9.2f}s {d['long_ttft_s']:9.2f}s "
                     f"{d['chat_itl_s'] * 1e3:7.0f}ms {d['chat_tokens']:11.0f} {d['steps']:6.0f}")
    (before, b), (after, a) = list(rows.items())[:2]
    lines.append(f"after / before (medians): chat max gap {a['chat_max_gap_s'] / b['chat_max_gap_s']:.2f}x, "
                 f"long prompt's TTFT {a['long_ttft_s'] / b['long_ttft_s']:.2f}x "
                 f"({100 * (a['long_ttft_s'] / b['long_ttft_s'] - 1):+.0f}%)")
    return "\n".join(lines)


def summary(rounds: list[MixedRound]) -> dict:
    """A mode's medians over its rounds, its worst chat gap, and how many rounds."""
    fields = ("chat_max_gap_s", "chat_max_itl_s", "long_ttft_s", "chat_itl_s", "chat_tokens", "steps")
    d = {f: float(np.median([getattr(r, f) for r in rounds])) for f in fields}
    return d | {"worst_gap_s": max(r.chat_max_gap_s for r in rounds), "rounds": len(rounds)}


def write_csv(per_mode: dict[str, list[MixedRound]], path: str | Path) -> Path:
    """Every round of every mode, one row each."""
    path = Path(path)
    rows = [asdict(r) | {"round": i} for rs in per_mode.values() for i, r in enumerate(rs)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def run_cli(llm, prompt_len: int = 128, output_len: int = 32, long_prompt_len: int = DEFAULT_LONG_PROMPT,
            rounds: int = 3, target_step_ms: float | None = None, csv_path=None, seed: int = 0,
            echo=print) -> dict[str, list[MixedRound]]:
    """What `minillm bench serve --workload mixed` does: build the prompts, run, print, write the CSV."""
    context = llm.config.max_seq_len
    if long_prompt_len >= context:
        raise MiniLLMError(f"a long prompt of {long_prompt_len} tokens does not fit this model's context of "
                           f"{context}: lower --long-prompt-len")
    if prompt_len + output_len >= context:
        raise MiniLLMError(f"chat turns of {prompt_len} + {output_len} tokens do not fit this model's context of "
                           f"{context}: lower --prompt-len or --output-len")
    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size
    chats = [rng.integers(FIRST_ID, vocab, prompt_len).tolist() for _ in range(8)]
    long_prompt = rng.integers(FIRST_ID, vocab, long_prompt_len).tolist()
    per_mode = run(llm, chats, output_len, long_prompt, rounds, target_step_ms, echo)
    if csv_path:
        echo(f"csv: {write_csv(per_mode, csv_path)}")
    return per_mode
