"""Lesson 16 — paged KV and fragmentation: blocks on demand instead of one max-length region per user.

Lesson 02's cache is contiguous: `new_cache(n)` reserves n positions up front. A server does not know
how long an answer will be, so it must reserve the model's whole context for every user, and most of
that memory is never written. Paging (vLLM's PagedAttention) cuts the pool into blocks of 16 positions
and hands them out as a sequence grows; a block table maps position p to block table[p // 16], slot
p % 16. Only the last block of a sequence is partly empty. `minillm.engine.paged_kv` is that cache: here we
check it gives the same logits through scattered blocks, count what each scheme reserves for a
realistic mix of lengths, and measure what reading through a table costs on the CPU. Last, a sliding
window (Mistral): the blocks a sequence has slid past go back to the pool.

Run: python lessons/16_paged_kv.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 02 (the KV cache)",
        "lesson 07 (the sliding window)",
    ],
    "objectives": [
        "store each sequence's cache in fixed-size blocks through a block table",
        "measure the memory a contiguous cache wastes on long-tailed lengths against pages",
        "give back the blocks a sliding window has passed",
    ],
    "study_time": "45 min, plus 20 min for exercise 16 (the block-table gather)",
    "check_questions": [
        "How much memory can a paged cache waste per sequence at most?",
        "What does a block table cost on the CPU that a GPU kernel avoids?",
    ],
    "try_this": [
        "change the block size (`block`) and watch waste against table length",
        "raise the number of users and compare users in 4 GiB",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.tools.bench import random_model
from minillm.model.config import ModelConfig
from minillm.course.measure import Spread, faster, interleaved, load_average, load_line
from minillm.course import lesson_model, print_table, quick, save_plot
from minillm.engine.engine import Engine
from minillm.llm import LLM
from minillm.engine.paged_kv import FREED, BlockManager, BlockTableCache, PagedKVCache, compare_allocation


# NEW: the address translation, and reading a sequence back through its table ----------------------
def slot_of(block_table: list[int], p: int, block_size: int) -> tuple[int, int]:
    """Where position p lives: (block, offset). Logical position -> physical block, like a page table."""
    return block_table[p // block_size], p % block_size


def gather(pool_k: np.ndarray, block_table: list[int], length: int) -> np.ndarray:
    """pool_k [n_blocks, block_size, n_kv, hd] -> this sequence's keys [n_kv, length, hd].
    One fancy-index gather: NumPy copies the blocks (a GPU kernel would read them in place)."""
    n_blocks = -(-length // pool_k.shape[1])
    keys = pool_k[block_table[:n_blocks]]                       # [nb, bs, n_kv, hd]
    return keys.reshape(-1, *keys.shape[2:])[:length].transpose(1, 0, 2)
# ---------------------------------------------------------------------------------------------------


def interleaved_decode(model, pool, manager, a: list[int], b: list[int]):
    """Prefill two prompts, then decode them turn about, so their blocks interleave in the pool."""
    ca, cb = BlockTableCache(pool, manager), BlockTableCache(pool, manager)
    logits = [model.prefill(a[:4], ca, all_logits=True)]
    model.prefill(b[:4], cb)
    for ta, tb in zip(a[4:], b[4:]):
        logits.append(model.decode(ta, ca)[None])
        model.decode(tb, cb)
    return np.concatenate(logits), ca, cb


def decode_times(model, caches: dict, prompt, rounds: int) -> dict[str, Spread]:
    """Seconds of one decode step after a prefill of `prompt`, for each cache; the caches take turns
    (course/measure.py), so other work on the machine slows both alike."""
    for cache in caches.values():
        model.prefill(prompt, cache)
    return interleaved({name: lambda c=c: model.decode(prompt[0], c) for name, c in caches.items()}, rounds)


def window_run(llm, prompts, n_new: int, give_back: bool) -> tuple[list[list[int]], int]:
    """Greedy outputs of the engine, and the most blocks one request held after any step. give_back=False
    keeps every block until the request ends (the window then works as a mask alone)."""
    engine = Engine(llm, block_size=8)
    if not give_back:
        engine.scheduler.window = None                         # NEW is the default: blocks behind it are freed
    ids = [engine.add_request(p, max_tokens=n_new) for p in prompts]
    out, most = {i: [] for i in ids}, 0
    while engine.has_unfinished():
        for event in engine.step():
            out[event.request_id] += event.token_ids
        most = max([most] + [sum(b != FREED for b in s.block_table) for s in engine.scheduler.running])
    return [out[i] for i in ids], most


def main():
    small = quick()
    llm = lesson_model()
    model, cfg = llm.model, llm.config
    rng = np.random.default_rng(0)
    block = 4 if small else 16

    # 1. Same numbers through scattered blocks: two sequences decoded turn about.
    n = 10 if small else 40
    a, b = (rng.integers(100, cfg.vocab_size, n).tolist() for _ in range(2))
    pool = PagedKVCache(cfg, num_blocks=2 * (n // block + 1), block_size=block)
    manager = BlockManager(pool.num_blocks)
    paged, ca, cb = interleaved_decode(model, pool, manager, a, b)
    flat = model.new_cache(n)                                   # the same steps through lesson 02's cache
    contiguous = np.concatenate([model.prefill(a[:4], flat, all_logits=True)] +
                                [model.decode(t, flat)[None] for t in a[4:]])
    p = n - 1
    blk, off = slot_of(ca.block_table, p, block)
    k_gathered = gather(pool.k[0], ca.block_table, n)           # [n_kv, n, hd]
    k_engine, _ = pool.read(0, ca.block_table, n)
    print(f"sequence a's block table: {ca.block_table}   sequence b's: {cb.block_table}")
    print(f"position {p} of a lives in block {blk}, slot {off}")
    check_rows = [["logits: paged (interleaved with b) vs contiguous", f"{np.abs(paged - contiguous).max():.2e}"],
                  ["keys: this lesson's gather vs PagedKVCache.read", f"{np.abs(k_gathered - k_engine).max():.2e}"]]

    # 2. Fragmentation: what 64 users with a realistic spread of lengths reserve.
    users, context = 64, min(cfg.max_seq_len, 4096)
    lengths = np.minimum(rng.lognormal(np.log(300), 0.9, users).astype(int) + 1, context)
    per_token = cfg.kv_bytes_per_token(2)                       # fp16, as a GPU server would store it
    budget = 4 << 30                                            # a 4 GiB KV budget
    frag_rows = []
    for bs in (1, 8, 16, 32, 128, 512):
        r = compare_allocation(lengths, context, bs, per_token)
        frag_rows.append([f"paged, blocks of {bs}", f"{r.paged_bytes / 2**20:,.0f}", f"{r.paged_waste:.1%}",
                          int(budget // (r.paged_bytes / users))])
    r = compare_allocation(lengths, context, 16, per_token)
    frag_rows.insert(0, [f"contiguous, {context} positions each", f"{r.contiguous_bytes / 2**20:,.0f}",
                         f"{r.contiguous_waste:.1%}", int(budget // (context * per_token))])
    frag_rows.insert(0, ["written (the tokens themselves)", f"{r.used_bytes / 2**20:,.0f}", "0.0%",
                         int(budget // (r.used_bytes / users))])

    # 3. The CPU price of paging: decode through a block table vs a contiguous cache.
    cost_rows, load_start = [], load_average()
    steps = 2 if small else 8
    for ctx in ((16, 48) if small else (64, 512)):
        prompt = rng.integers(100, cfg.vocab_size, ctx).tolist()
        pool = PagedKVCache(cfg, num_blocks=(ctx + steps + 1) // 16 + 1)
        times = decode_times(model, {"contiguous": model.new_cache(ctx + steps + 1),
                                     "paged": BlockTableCache(pool, BlockManager(pool.num_blocks))}, prompt, steps)
        flat, paged = times["contiguous"], times["paged"]
        cost_rows.append([ctx, flat.ms(), paged.ms(), f"{paged.median / flat.median - 1:+.0%}"])

    # 4. A sliding window: a random Mistral-like model (window 32), four requests of ~100-200 positions.
    window = 32
    wcfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                       family="mistral", sliding_window=window, max_seq_len=1024)
    wllm = LLM(wcfg, random_model(wcfg))
    wprompts = [rng.integers(0, 256, n).tolist() for n in ((40, 20) if small else (120, 60, 150, 90))]
    n_new = 24 if small else 64
    kept, most_kept = window_run(wllm, wprompts, n_new, give_back=False)
    freed, most_freed = window_run(wllm, wprompts, n_new, give_back=True)
    longest = max(len(p) for p in wprompts) + n_new
    window_rows = [["every block kept to the end (the window as a mask)", most_kept],
                   ["blocks behind the window given back (minillm's engine)", most_freed],
                   ["bound: blocks spanning window - 1 keys, + 1", -(-(window - 1) // 8) + 1]]

    print_table("Lesson 16 — the paged cache computes the same thing (max abs difference)",
                ["check", "max |Δ|"], check_rows)
    print_table(f"fragmentation: {users} users, lengths {lengths.min()}..{lengths.max()} (median "
                f"{int(np.median(lengths))}), {cfg.n_layers} layers × {cfg.n_kv_heads} KV heads × "
                f"{cfg.head_dim} fp16 = {per_token:,} B/token",
                ["allocation", "KV MiB reserved", "wasted", "users in 4 GiB"], frag_rows)
    print("A contiguous cache must reserve the whole context per user: most of it is never written. Pages\n"
          "waste less than one block per user; tiny blocks waste nothing but make tables long and reads\n"
          "scattered, so engines use 16 (vLLM) or so.")
    print_table("the CPU price of reading through a block table (decode ms/token, blocks of 16)",
                ["context", "contiguous", "paged", "extra"], cost_rows)
    print(f"ms: median (min-max) of {steps} interleaved steps; {load_line(load_start)}")
    faster(times, "contiguous", "paged", "on the CPU, reading through a block table costs a gather per step")
    print("NumPy's gather copies the blocks every step; a GPU paged-attention kernel reads them where they lie.")
    print_table(f"a sliding window of {window}: the most blocks (of 8) one request held after a step, "
                f"requests of up to {longest} positions; outputs {'identical' if kept == freed else 'DIFFERENT'}",
                ["scheduler", "blocks held at most"], window_rows)
    print("No query looks further back than the window, so its blocks can go back to the pool as it slides:\n"
          "a request's KV memory stops growing at the window, however long it runs (prefill chunks aside).")

    def draw(ax):
        sizes = [1, 8, 16, 32, 128, 512]
        waste = [compare_allocation(lengths, context, bs, per_token).paged_waste * 100 for bs in sizes]
        ax.plot(sizes, waste, marker="o", label="paged")
        ax.axhline(compare_allocation(lengths, context, 16, per_token).contiguous_waste * 100, color="red",
                   ls="--", label=f"contiguous ({context} each)")
        ax.set_xscale("log", base=2), ax.set_xlabel("block size (positions)"), ax.set_ylabel("% reserved, unused")
        ax.set_title("Lesson 16: KV memory wasted by fragmentation"), ax.legend()
    save_plot("16_paged_kv.png", draw)


if __name__ == "__main__":
    main()
