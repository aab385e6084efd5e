"""Exercises 25-26, deploying a model: the largest batch that meets a latency target when arriving prompts
stall the batch (lesson 25, minillm/tools/latency_plan.py), and the decode worker's side of a KV handoff
(lesson 26, minillm/engine/disaggregated.py)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, _expect_tuple, case_rng, expect_unchanged


def batch_for_target_reference(step_ms, prefill_ms, output_tokens, latency_ms, ttft_ms) -> int:
    """The largest batch B whose time per output token, step_ms[B-1] + (B / output_tokens) * prefill_ms,
    is <= latency_ms and whose first token, step_ms[B-1] + prefill_ms, is <= ttft_ms; 0 when none is.
    step_ms: [max_batch] a decode step's ms at batch 1, 2, ... (measured: not always increasing)."""
    step_ms = np.asarray(step_ms, dtype=np.float64)                       # [max_batch]
    batch = np.arange(1, len(step_ms) + 1)                                # [max_batch]
    per_token = step_ms + batch / output_tokens * prefill_ms              # B / N_out prefills stall each step
    first = step_ms + prefill_ms
    ok = (per_token <= latency_ms) & (first <= ttft_ms)
    return int(batch[ok].max()) if ok.any() else 0


def _target_cases() -> list[Case]:
    rng = case_rng(25)
    roofline = 20.0 + 0.5 * np.arange(64)                                 # weights, then + KV per user
    bumpy = np.sort(rng.uniform(8, 30, 48))
    bumpy[20] -= 6.0                                                      # a measured dip: batch 21 ran fast
    case = lambda name, step, prefill, out, lat, ttft: Case(name, dict(step_ms=step, prefill_ms=prefill,
                                                                      output_tokens=out, latency_ms=lat, ttft_ms=ttft))
    return [case("a roofline table, the per-token target binds", roofline, 40.0, 256, 30.0, 1000.0),
            case("prefill stalls dominate: short outputs (8 tokens)", roofline, 40.0, 8, 30.0, 1000.0),
            case("the TTFT target binds before the per-token one", roofline, 200.0, 256, 60.0, 230.0),
            case("nothing meets it: one user already takes 20 ms a token", roofline, 40.0, 256, 19.0, 1000.0),
            case("every batch meets it: the answer is the whole table", roofline, 1.0, 1000, 100.0, 1000.0),
            case("a measured table that dips: scan every batch, not to the first miss", bumpy, 30.0, 64, 23.0, 80.0)]


def _check_target(fn, case: Case) -> str:
    i = case.inputs
    given = np.array(i["step_ms"], copy=True)
    got = fn(given, i["prefill_ms"], i["output_tokens"], i["latency_ms"], i["ttft_ms"])
    expect_unchanged("step_ms", i["step_ms"], given)
    if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
        raise CaseFailed(f"expected an int batch size, got {type(got).__name__} {got!r}")
    want = batch_for_target_reference(**i)
    if got != want:
        b = int(got)
        at = ""
        if 1 <= b <= len(given):
            per_token = given[b - 1] + b / i["output_tokens"] * i["prefill_ms"]
            at = (f" (at batch {b}: {per_token:.1f} ms a token, first token "
                  f"{given[b - 1] + i['prefill_ms']:.1f} ms)")
        raise CaseFailed(f"expected batch {want}, got {got}{at}")
    return f"batch {want}"


def install_handoff_reference(pool_k, pool_v, free_blocks, k_blocks, v_blocks):
    """Copy handed-over KV blocks into free blocks of this worker's pool.
    pool_k, pool_v: [layers, n_blocks, block_size, n_kv, hd]; free_blocks: [n_free] ids; k_blocks, v_blocks:
    [layers, n, block_size, n_kv, hd] in sequence order.  -> (pool_k, pool_v, block_table [n])"""
    n = k_blocks.shape[1]
    table = np.asarray(free_blocks[:n], dtype=np.int64)                   # [n] any n free blocks will do
    pool_k, pool_v = pool_k.copy(), pool_v.copy()
    pool_k[:, table] = k_blocks                                           # block j of the sequence -> table[j]
    pool_v[:, table] = v_blocks
    return pool_k, pool_v, table


def _handoff_cases() -> list[Case]:
    rng = case_rng(26)

    def case(name, layers, n_pool, n_handed, free, bs=4, n_kv=2, hd=8):
        shape = (layers, n_pool, bs, n_kv, hd)
        pool_k = rng.standard_normal(shape).astype(np.float32)            # other sequences' blocks: keep them
        pool_v = rng.standard_normal(shape).astype(np.float32)
        handed = (layers, n_handed, bs, n_kv, hd)
        return Case(name, dict(pool_k=pool_k, pool_v=pool_v, free_blocks=np.asarray(free, dtype=np.int64),
                               k_blocks=rng.standard_normal(handed).astype(np.float32),
                               v_blocks=rng.standard_normal(handed).astype(np.float32)))
    return [case("3 blocks into an empty pool of 8, 2 layers", 2, 8, 3, list(range(8))),
            case("free blocks out of order, the used ones hold other sequences", 3, 10, 4, [7, 2, 9, 5, 0]),
            case("one block", 1, 4, 1, [3]),
            case("exactly as many free blocks as handed over", 2, 6, 3, [5, 1, 3])]


def _check_handoff(fn, case: Case) -> str:
    i = case.inputs
    given = {k: np.array(v, copy=True) for k, v in i.items()}
    got = _expect_tuple(fn(**given), 3, "pool_k, pool_v, block_table")
    for name in i:
        expect_unchanged(name, i[name], given[name])
    pool_k, pool_v, table = (np.asarray(a) for a in got)
    n, free = i["k_blocks"].shape[1], [int(b) for b in i["free_blocks"]]
    if pool_k.shape != i["pool_k"].shape or pool_v.shape != i["pool_v"].shape:
        raise CaseFailed(f"the pools must keep their shape {i['pool_k'].shape}, got {pool_k.shape} and {pool_v.shape}")
    if table.shape != (n,) or not np.issubdtype(table.dtype, np.integer):
        raise CaseFailed(f"block_table: expected {n} integer block ids, got shape {table.shape} ({table.dtype})")
    ids = [int(b) for b in table]
    if len(set(ids)) != n or not set(ids) <= set(free):
        raise CaseFailed(f"block_table {ids}: each entry must be a different block from free_blocks {free}")
    for name, pool, handed in (("k", pool_k, i["k_blocks"]), ("v", pool_v, i["v_blocks"])):
        for j, block in enumerate(ids):
            if not np.array_equal(pool[:, block], handed[:, j]):
                raise CaseFailed(f"pool_{name}[:, {block}] (table entry {j}) does not hold handed-over block {j} "
                                 f"in every layer")
        others = [b for b in range(pool.shape[1]) if b not in ids]
        if not np.array_equal(pool[:, others], i[f"pool_{name}"][:, others]):
            changed = next(b for b in others if not np.array_equal(pool[:, b], i[f"pool_{name}"][:, b]))
            raise CaseFailed(f"pool_{name}[:, {changed}] changed, but block {changed} is not in your table: "
                             f"another sequence's keys and values live there")
    return f"{n} block{'s' * (n != 1)} installed at {ids}"
