"""`minillm plan --latency-ms T --ttft-ms F`: on one GPU, which precision and batch meet a latency target,
and when splitting prefill from decode (disaggregation) pays.

The planner's decode roofline (planner.py) gives one batched decode step, t_step(B). Users do not only
decode: each finishes after N_out tokens and a new prompt of P tokens takes its place. A prefill runs
alone on the weights at

    t_prefill = max(weights / bandwidth,  (2 × active params × P + attention) / FLOP/s)    (compute-bound)

Colocated (one GPU does both, continuous batching): in steady state B / N_out prompts arrive per decode
step, and each prefill holds up every running user, so

    time per output token  = t_step(B) + (B / N_out) × t_prefill
    time to first token    = t_step(B) + t_prefill              (finish the running step, then prefill)

Disaggregated (DistServe, Splitwise; lesson 26): decode GPUs only decode, prefill GPUs only prefill, and
the prompt's KV cache crosses a link (KV bytes/token × P) before decoding starts:

    time per output token  = t_step(B)
    time to first token    = t_prefill + P × KV/token / link + t_step(B)
    prefill GPUs per decode GPU = (B / N_out) × t_prefill / t_step(B)

It pays when the decode GPU then serves enough more users, at the target, to outweigh the prefill GPUs'
share: compare output tokens per second per GPU, both counted. Queueing is left out (arrivals are smooth,
a prompt never waits for another prompt), so both TTFTs are lower bounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minillm.model.config import ModelConfig
from minillm.tools.planner import (DEFAULT_GPU, DEFAULT_RESERVE, GPU, Plan, _check, find_gpu, plan, resolve_model,
                                   weights_read_per_step)

DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_OUTPUT_TOKENS = 256
DTYPES = ("bf16", "fp8", "int8", "int4")   # the precisions a serving engine offers for weights
HANDOFF_LINK = 50e9                        # bytes/s between a prefill and a decode GPU: 400 Gb/s InfiniBand/RoCE


def prefill_time_s(c: ModelConfig, gpu: GPU, weight_dtype: str, prompt_tokens: int) -> float:
    """One prompt's prefill alone on the GPU: the weights read once, or 2 FLOPs a parameter a token plus
    the causal attention, whichever takes longer."""
    active = getattr(c, "n_active_params", c.n_params)
    attention = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * prompt_tokens * (prompt_tokens + 1) / 2
    flops = 2 * active * prompt_tokens + attention
    return max(weights_read_per_step(c, weight_dtype, prompt_tokens) / gpu.bandwidth, flops / gpu.bf16_flops)


@dataclass
class Serving:
    """One way of serving B users of a workload on a GPU: its latencies and output throughput per GPU."""
    batch: int
    step_s: float             # one decode step for the batch
    prefill_s: float          # one prompt's prefill
    itl_s: float              # time per output token a user sees
    ttft_s: float
    gpus: float               # GPUs it occupies: 1, or 1 + the prefill GPUs' share when disaggregated
    price_per_hour: float

    @property
    def tok_s_per_gpu(self) -> float:
        return self.batch / self.itl_s / self.gpus

    @property
    def cost_per_million(self) -> float:
        return self.price_per_hour / (self.tok_s_per_gpu * 3600) * 1e6


def colocated(p: Plan, prefill_s: float, output_tokens: int) -> Serving:
    """Prefill and decode on one GPU: every arriving prompt's prefill stalls the running users' step."""
    arrivals = p.users / output_tokens                               # new prompts per decode step
    return Serving(p.users, p.step_time_s, prefill_s, p.step_time_s + arrivals * prefill_s,
                   p.step_time_s + prefill_s, 1.0, p.price_per_hour)


def disaggregated(p: Plan, prefill_s: float, output_tokens: int, prompt_tokens: int,
                  link: float = HANDOFF_LINK) -> Serving:
    """Decode on this GPU, prefill on others: no stalls, but each prompt's KV crosses `link` bytes/s."""
    handoff_s = prompt_tokens * p.kv_bytes_per_token / link
    prefill_share = p.users / output_tokens * prefill_s / p.step_time_s   # prefill GPUs per decode GPU
    return Serving(p.users, p.step_time_s, prefill_s, p.step_time_s, prefill_s + handoff_s + p.step_time_s,
                   1.0 + prefill_share, p.price_per_hour)


@dataclass
class TargetRow:
    """One precision's answer: the largest batch that meets the targets, colocated and disaggregated."""
    weight_dtype: str
    kv_dtype: str
    max_users: int            # memory's limit at the context
    colocated: Serving | None
    disaggregated: Serving | None
    reasons: dict[str, str] = field(default_factory=dict)   # "colocated"/"disaggregated": why it meets neither

    @property
    def disaggregation_pays(self) -> bool:
        if self.disaggregated is None:
            return False
        return self.colocated is None or self.disaggregated.tok_s_per_gpu > self.colocated.tok_s_per_gpu


def meet_targets(model: str | Path | ModelConfig, gpu: str | GPU = DEFAULT_GPU, latency_ms: float = 30.0,
                 ttft_ms: float | None = None, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                 output_tokens: int = DEFAULT_OUTPUT_TOKENS, context: int | None = None,
                 dtypes: tuple[str, ...] = DTYPES, kv_dtype: str | None = None, reserve: float = DEFAULT_RESERVE,
                 price_per_hour: float | None = None, link: float = HANDOFF_LINK) -> list[TargetRow]:
    """For each weight precision, the largest batch whose time per output token is <= latency_ms and whose
    TTFT is <= ttft_ms (None: no TTFT target), served colocated and disaggregated. context: the tokens a user
    holds in the KV cache at the end (default prompt + output)."""
    _check(latency_ms > 0, f"the latency target must be positive, got {latency_ms} ms")
    _check(ttft_ms is None or ttft_ms > 0, f"the TTFT target must be positive, got {ttft_ms} ms")
    _check(prompt_tokens >= 1 and output_tokens >= 1, "prompt and output tokens must be >= 1")
    context = context or prompt_tokens + output_tokens
    _check(context >= prompt_tokens + output_tokens,
           f"context {context:,} cannot hold a prompt of {prompt_tokens:,} and {output_tokens:,} output tokens")
    _, c = resolve_model(model)
    gpu = gpu if isinstance(gpu, GPU) else find_gpu(gpu)
    rows = []
    for dtype in dtypes:
        first = plan(c, gpu, dtype, kv_dtype, context, reserve=reserve, price_per_hour=price_per_hour)
        kv = first.kv_dtype
        if not first.fits:
            rows.append(TargetRow(dtype, kv, 0, None, None, dict.fromkeys(("colocated", "disaggregated"),
                                                                          first.notes[-1])))
            continue
        prefill_s = prefill_time_s(c, gpu, dtype, prompt_tokens)
        at = lambda users: plan(c, gpu, dtype, kv, context, users, reserve, price_per_hour)

        def meets(serving: Serving) -> bool:
            return serving.itl_s * 1e3 <= latency_ms and (ttft_ms is None or serving.ttft_s * 1e3 <= ttft_ms)

        best, reasons = {}, {}
        for name, serve in (("colocated", lambda p: colocated(p, prefill_s, output_tokens)),
                            ("disaggregated", lambda p: disaggregated(p, prefill_s, output_tokens, prompt_tokens, link))):
            # Both latencies grow with the batch: bisect for the largest batch that still meets them.
            low, high = 1, first.max_users
            if not meets(serve(at(1))):
                best[name], reasons[name] = None, _why_not(serve(at(1)), latency_ms, ttft_ms)
                continue
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if meets(serve(at(mid))) else (low, mid - 1)
            best[name] = serve(at(low))
        rows.append(TargetRow(dtype, kv, first.max_users, best["colocated"], best["disaggregated"], reasons))
    return rows


def _why_not(one_user: Serving, latency_ms: float, ttft_ms: float | None) -> str:
    """Why no batch meets the targets: even one user's tokens, or its first token, come too late."""
    if one_user.itl_s * 1e3 > latency_ms:
        return f"{one_user.itl_s * 1e3:.1f} ms a token for one user (> {latency_ms:g})"
    return f"TTFT {one_user.ttft_s * 1e3:.0f} ms for one user (> {ttft_ms:g})"


def format_targets(rows: list[TargetRow], model: str, gpu: GPU, latency_ms: float, ttft_ms: float | None,
                   prompt_tokens: int, output_tokens: int) -> str:
    """The table of `meet_targets`, one line per precision, colocated then disaggregated, and a verdict."""
    target = f"<= {latency_ms:g} ms a token" + (f", TTFT <= {ttft_ms:g} ms" if ttft_ms else "")
    head = ["weights", "KV", "max users", "serving", "batch", "ms/token", "TTFT ms", "GPUs", "tok/s/GPU", "$/1M out"]
    table = []
    for r in rows:
        for name, s in (("colocated", r.colocated), ("disaggregated", r.disaggregated)):
            cells = [r.weight_dtype, r.kv_dtype, f"{r.max_users:,}", name]
            if s is None:
                cells += ["-"] * 5 + [f"no: {r.reasons[name]}"]
            else:
                cells += [f"{s.batch:,}", f"{s.itl_s * 1e3:.1f}", f"{s.ttft_s * 1e3:.0f}", f"{s.gpus:.2f}",
                          f"{s.tok_s_per_gpu:,.0f}", f"{s.cost_per_million:.3f}"]
            table.append(cells)
    widths = [max([len(h)] + [len(row[i]) for row in table if not row[i].startswith("no:")]) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [f"{model} on {gpu.name}: {target}; prompts of {prompt_tokens:,} tokens, {output_tokens:,} out",
           line(head)] + [line(cells) for cells in table]
    met = [r for r in rows if r.colocated or r.disaggregated]
    if not met:
        out.append("no precision meets the target on this GPU: loosen it, or try `--latency-ms` alone to rank GPUs")
    else:
        best = max(met, key=lambda r: max(s.tok_s_per_gpu for s in (r.colocated, r.disaggregated) if s))
        how = "disaggregated" if best.disaggregation_pays else "colocated"
        s = best.disaggregated if best.disaggregation_pays else best.colocated
        out.append(f"most tokens per GPU at the target: {best.weight_dtype} weights, {how}, batch {s.batch:,} "
                   f"({s.tok_s_per_gpu:,.0f} tok/s a GPU)")
    out.append(f"model: colocated, each arriving prompt's prefill stalls the batch ((batch / {output_tokens}) "
               f"prefills a step); disaggregated, decode GPUs never stall and the prompt's KV crosses "
               f"{HANDOFF_LINK / 1e9:.0f} GB/s (minillm/tools/latency_plan.py)")
    return "\n".join(out)


def targets_cli(model: str, gpu: str = DEFAULT_GPU, latency_ms: float = 30.0, ttft_ms: float | None = None,
                prompt_tokens: int = DEFAULT_PROMPT_TOKENS, output_tokens: int = DEFAULT_OUTPUT_TOKENS,
                context: int | None = None, kv_dtype: str | None = None, reserve: float = DEFAULT_RESERVE,
                price: float | None = None) -> str:
    """`minillm plan --latency-ms T --ttft-ms F --gpu G`: the table to print (PlanError on bad input)."""
    name, _ = resolve_model(model)
    g = find_gpu(gpu)
    rows = meet_targets(model, g, latency_ms, ttft_ms, prompt_tokens, output_tokens, context, DTYPES, kv_dtype,
                        reserve, price)
    return format_targets(rows, name, g, latency_ms, ttft_ms, prompt_tokens, output_tokens)

