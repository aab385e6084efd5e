"""`minillm bench --speculative`: plain vs speculative decode on copy-heavy prompts, in one run."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = Path(__file__).parent / "data" / "copy_heavy_prompts.json"


def copy_heavy_prompts() -> list[dict]:
    """The shipped prompts whose answers mostly repeat or edit their input: each {"kind", "messages" or "text"}."""
    return json.loads(PROMPTS_FILE.read_text())["prompts"]


@dataclass
class SpecRow:
    """One prompt, decoded plainly and speculatively (greedy, the same max_tokens)."""
    kind: str
    tokens: int
    plain_tok_s: float
    spec_tok_s: float
    acceptance_rate: float
    tokens_per_pass: float
    draft_s: float
    verify_s: float
    same: bool                      # identical greedy output
    drafted: int = 0
    accepted: int = 0
    passes: int = 0                 # target forward passes after the prefill


def bench_speculative(llm, speculative, draft_tokens: int | None = None, max_tokens: int = 64,
                      prompts: list[dict] | None = None) -> list[SpecRow]:
    """Decode each copy-heavy prompt plainly, then with `speculative`; the drafter is built (and, for
    int4, quantized) before the clock starts. -> one SpecRow per prompt."""
    llm.drafter(speculative)                                  # built once, outside the timings
    prompts = prompts or copy_heavy_prompts()
    first = prompts[0].get("messages") or prompts[0]["text"]   # warm-up: GPU graphs captured, kernels loaded
    llm.generate(first, max_tokens=3)
    llm.generate(first, max_tokens=3, speculative=speculative, draft_tokens=draft_tokens)
    rows = []
    for p in prompts:
        prompt = p.get("messages") or p["text"]
        plain = llm.generate(prompt, max_tokens=max_tokens)
        spec = llm.generate(prompt, max_tokens=max_tokens, speculative=speculative, draft_tokens=draft_tokens)
        s = spec.speculative
        rows.append(SpecRow(p["kind"], len(spec.token_ids), plain.decode_tok_s, spec.decode_tok_s,
                            s.acceptance_rate, s.mean_accepted_length, s.draft_s, s.verify_s,
                            plain.token_ids == spec.token_ids, s.draft_tokens, s.accepted_tokens, s.target_forwards))
    return rows


def totals(rows: list[SpecRow]) -> dict:
    """All prompts together: tok/s as total tokens over total time, acceptance and tokens/pass from the
    summed counts (not means of per-prompt rates)."""
    plain_s = sum((r.tokens - 1) / r.plain_tok_s for r in rows if r.plain_tok_s)
    spec_s = sum((r.tokens - 1) / r.spec_tok_s for r in rows if r.spec_tok_s)
    n = sum(r.tokens - 1 for r in rows)
    plain, spec = n / plain_s if plain_s else 0.0, n / spec_s if spec_s else 0.0
    draft, verify = sum(r.draft_s for r in rows), sum(r.verify_s for r in rows)
    return dict(plain_tok_s=plain, spec_tok_s=spec, speedup=spec / plain if plain else 0.0,
                acceptance_rate=sum(r.accepted for r in rows) / max(1, sum(r.drafted for r in rows)),
                tokens_per_pass=sum(r.accepted + r.passes for r in rows) / max(1, sum(r.passes for r in rows)),
                draft_share=draft / (draft + verify) if draft + verify else 0.0, same=all(r.same for r in rows))


def format_table(rows: list[SpecRow], speculative: str) -> str:
    lines = [f"speculative decoding ({speculative}) vs plain greedy decode, copy-heavy prompts "
             f"(BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS', 'default')})",
             f"{'prompt':14} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accepted':>8} "
             f"{'tok/pass':>8} {'draft s':>7} {'verify s':>8} {'same':>5}"]
    for r in rows:
        lines.append(f"{r.kind:14} {r.tokens:6d} {r.plain_tok_s:11.1f} {r.spec_tok_s:10.1f} "
                     f"{r.spec_tok_s / r.plain_tok_s if r.plain_tok_s else 0:6.2f}x {r.acceptance_rate:8.0%} "
                     f"{r.tokens_per_pass:8.2f} {r.draft_s:7.2f} {r.verify_s:8.2f} {'yes' if r.same else 'NO':>5}")
    t = totals(rows)
    lines.append(f"{'all':14} {sum(r.tokens for r in rows):6d} {t['plain_tok_s']:11.1f} {t['spec_tok_s']:10.1f} "
                 f"{t['speedup']:6.2f}x {t['acceptance_rate']:8.0%} {t['tokens_per_pass']:8.2f}   "
                 f"time: {t['draft_share']:.0%} drafting, {1 - t['draft_share']:.0%} verifying")
    return "\n".join(lines)


def run_cli(model: str, speculative: str, draft_tokens: int | None, new_tokens: int, device: str, echo) -> int:
    """`minillm bench --speculative ...`: the table above for MODEL; exit status 0."""
    from minillm.llm import load
    llm = load(model, device=device)
    echo(format_table(bench_speculative(llm, speculative, draft_tokens, max(new_tokens, 2)), speculative))
    return 0
