"""The arithmetic of tensor parallelism at decode (after the scaling book's inference chapter).

Per token and layer, Megatron's split moves two all-reduces of `dim` activations (after o, after down).
A ring all-reduce of B bytes over N ranks sends and receives 2(N-1)/N · B bytes per rank, so

    t_allreduce(N) ≈ α + 2(N-1)/N · B / link_bandwidth          (α: the link's per-collective latency)

while each rank reads only 1/N of the weights (and of the KV cache, when KV heads split):

    t_memory(N) = (weight bytes + KV bytes) / (N · HBM bandwidth)

    decode step(N) = t_memory(N) + 2 · n_layers · t_allreduce(N)

Doubling N halves t_memory but does not shrink the all-reduces (their bytes per rank grow towards 2B,
their latency stays): TP stops paying at the first N where the step no longer gets faster. Link
figures are spec-sheet or measured, and say which. Pipeline parallelism instead moves one activation
per stage boundary and pays in idle time: P stages over M micro-batches leave (P-1)/(M+P-1) of the
schedule as bubble.
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.model.config import ModelConfig


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float        # bytes/s each way per rank
    latency_s: float        # α: the fixed cost of one small all-reduce
    source: str             # "spec sheet" or "measured here"


LINKS = {
    "nvlink": Link("NVLink 4 (H100/H200 SXM)", 450e9, 8e-6, "spec sheet: 900 GB/s both ways; α ~ NCCL small-message"),
    "pcie": Link("PCIe 5.0 x16", 50e9, 15e-6, "spec sheet: 64 GB/s raw, ~50 effective; α assumed"),
}


def measured_link(us_small: float, n_small: int, us_large: float, n_large: int, name: str = "this machine, MPI") -> Link:
    """A Link fitted to two measured fp32 all-reduce times of 2 ranks (n values each): latency and bandwidth."""
    extra_bytes = 4 * (n_large - n_small)                      # at N = 2, 2(N-1)/N = 1: bytes/rank = B
    bandwidth = extra_bytes / max((us_large - us_small) * 1e-6, 1e-12)
    return Link(name, bandwidth, us_small * 1e-6, "measured here (2 ranks, loopback)")


def allreduce_s(n_bytes: float, n: int, link: Link) -> float:
    """One ring all-reduce of n_bytes over n ranks."""
    if n == 1:
        return 0.0
    return link.latency_s + 2 * (n - 1) / n * n_bytes / link.bandwidth


@dataclass(frozen=True)
class TPRow:
    tp: int
    weight_bytes_per_rank: float
    kv_bytes_per_token_per_rank: float
    bytes_moved_per_token_per_layer: float     # what one rank sends (≈ receives) per token and layer
    memory_s: float                            # reading the rank's weights and KV once
    comm_s: float                              # 2 all-reduces a layer
    step_s: float

    @property
    def tok_s(self) -> float:
        return 1.0 / self.step_s


def tp_rows(config: ModelConfig, hbm_bandwidth: float, link: Link, tps=(1, 2, 4, 8), batch: int = 1,
            context: int = 0, weight_bytes: float = 2, act_bytes: float = 2,
            total_weight_bytes: float | None = None, kv_bytes: float | None = None) -> list[TPRow]:
    """Decode step at batch `batch`, `context` cached tokens a sequence, for each tp (shapes that split).
    weight_bytes / act_bytes: per weight and per activation or KV value; total_weight_bytes overrides
    n_params · weight_bytes (int4 scales and all), kv_bytes the bytes of one cached value."""
    rows = []
    kv_value = act_bytes if kv_bytes is None else kv_bytes
    for n in tps:
        weights = (config.n_params * weight_bytes if total_weight_bytes is None else total_weight_bytes) / n
        kv_heads_per_rank = max(config.n_kv_heads / n, 1)       # replicated below one head a rank
        kv_token = 2 * config.n_layers * kv_heads_per_rank * config.head_dim * kv_value
        activation = batch * config.dim * act_bytes               # one all-reduce's payload
        moved = 2 * (2 * (n - 1) / n * activation) if n > 1 else 0.0
        memory = (weights + batch * context * kv_token) / hbm_bandwidth
        comm = 2 * config.n_layers * allreduce_s(activation, n, link)
        rows.append(TPRow(n, weights, kv_token, moved, memory, comm, memory + comm))
    return rows


def stops_paying(rows: list[TPRow]) -> int | None:
    """The first tp that is no faster than the one before it (None: every step in `rows` paid)."""
    for before, after in zip(rows, rows[1:]):
        if after.step_s >= before.step_s:
            return after.tp
    return None


def pp_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe-style schedule: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def plan_text(name: str, config: ModelConfig, gpu_name: str, memory_bytes: float, hbm_bandwidth: float,
              tp: int, pp: int = 1, context: int = 4096, users: int = 1, total_weight_bytes: float | None = None,
              kv_bytes: float = 2, link: Link | None = None) -> str:
    """`minillm plan --tp N [--pp M]`: per-rank memory, bytes moved and the decode step at tp = 1, 2, 4 ... N
    (the sizes this model's heads allow), where TP stops paying, and the pipeline bubble at pp = M."""
    from minillm.engine.parallel.sharding import valid_sizes
    link = link or LINKS["nvlink"]
    sizes = valid_sizes(config, tp)
    rows = tp_rows(config, hbm_bandwidth, link, sizes, batch=users, context=context,
                   total_weight_bytes=total_weight_bytes, kv_bytes=kv_bytes)
    stop = stops_paying(rows)
    lines = [f"tensor parallelism: {name} on {gpu_name}s linked by {link.name} ({link.bandwidth / 1e9:.0f} GB/s, "
             f"α {link.latency_s * 1e6:.0f} µs; {link.source}), {users} user(s) at {context} tokens",
             f"{'tp':>3} {'weights/rank':>13} {'KV/token/rank':>14} {'sent/token/layer':>17} {'memory':>9} "
             f"{'all-reduce':>11} {'tok/s':>9}  fits"]
    for r in rows:
        used = r.weight_bytes_per_rank + users * context * r.kv_bytes_per_token_per_rank
        lines.append(f"{r.tp:>3} {r.weight_bytes_per_rank / 1e9:>10.2f} GB {r.kv_bytes_per_token_per_rank / 1e3:>11.1f} KB "
                     f"{r.bytes_moved_per_token_per_layer / 1e3:>14.1f} KB {1e3 * r.memory_s:>6.2f} ms "
                     f"{1e3 * r.comm_s:>8.2f} ms {users * r.tok_s:>9,.0f}  {'yes' if used <= memory_bytes else 'no'}"
                     + ("   <- stops paying" if r.tp == stop else ""))
    if tp not in sizes:
        lines.append(f"tp={tp} does not split this model; tp can be {', '.join(map(str, valid_sizes(config, tp)))}")
    elif stop is None:
        lines.append(f"every step up to tp={tp} still pays: the all-reduces cost less than the weight reads they save")
    heavy = next((r.tp for r in rows if r.comm_s >= r.memory_s > 0 and r.tp > 1), None)
    if heavy is not None:
        lines.append(f"from tp={heavy} the all-reduces take longer than the weight and KV reads: latency-bound")
    if pp > 1:
        per_stage = config.n_layers / pp
        lines.append(f"pipeline parallelism, {pp} stages ({per_stage:g} layers each): {users} micro-batch(es) leave "
                     f"{100 * pp_bubble(pp, users):.0f}% of the schedule idle (the bubble, (P-1)/(M+P-1)); "
                     f"{users * config.dim * 2 / 1e3:.1f} KB cross each stage boundary per token")
    return "\n".join(lines)
