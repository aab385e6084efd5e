"""Disaggregated prefill and decode: one process prefills a prompt, another decodes it, and the prompt's KV
blocks travel between them.

Prefill is compute-bound and decode memory-bound (lesson 03). On one worker they share every step, so each
new prompt's prefill stalls every running user's next token. Disaggregated serving (DistServe, Splitwise,
Mooncake) gives each phase its own worker: the prefill worker fills the prompt's paged KV blocks and hands
them, with the first token, to a decode worker, which copies them into blocks of its own pool and decodes
as if it had prefilled itself. The price is the handoff: KV bytes per token × prompt tokens, once per request.

Here the two workers are processes on one machine (`multiprocessing`, spawned: each loads its own weights,
as two machines would), and the handoff is a pipe that carries bytes only: a JSON header, then the raw
key and value blocks. Greedy tokens equal a single process's: the decode worker's cache holds the same
numbers at the same positions, only in other blocks.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from minillm.engine.paged_kv import DEFAULT_BLOCK_SIZE, BlockManager, BlockTableCache, PagedKVCache


@dataclass
class Handoff:
    """What the prefill worker gives the decode worker: the first token and the prompt's KV blocks."""
    first_token: int
    length: int              # prompt positions held in the blocks
    k: np.ndarray            # [layers, n_blocks, block_size, n_kv_heads, head_dim], in block-table order
    v: np.ndarray            # the same shape

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def prefill_blocks(model, prompt: list[int], block_size: int = DEFAULT_BLOCK_SIZE) -> Handoff:
    """Prefill `prompt` into a paged cache and take its blocks out: the prefill worker's whole job."""
    n_blocks = math.ceil(len(prompt) / block_size)
    pool = PagedKVCache(model.config, n_blocks, block_size)
    cache = BlockTableCache(pool, BlockManager(n_blocks))
    first = int(np.argmax(model.prefill(prompt, cache)))                     # greedy: the first new token
    table = cache.block_table
    return Handoff(first, cache.length, pool.k[:, table], pool.v[:, table])  # [layers, n_blocks, bs, n_kv, hd]


def decode_pool(config, handoff: Handoff, n_new: int) -> tuple[PagedKVCache, BlockManager]:
    """A decode worker's pool and manager with room for the handed-over prompt and n_new more positions."""
    block_size = handoff.k.shape[2]
    total = math.ceil((handoff.length + n_new) / block_size)
    return PagedKVCache(config, total, block_size), BlockManager(total)


def install_blocks(pool: PagedKVCache, manager: BlockManager, handoff: Handoff) -> BlockTableCache:
    """The decode worker's side: the handed-over contents copied into free blocks of its own pool (whichever
    its manager hands out: other sequences may hold the rest), in sequence order, the cache's length set."""
    if handoff.k.shape[2] != pool.block_size:
        raise ValueError(f"blocks of {handoff.k.shape[2]} positions cannot go into a pool of blocks of "
                         f"{pool.block_size}")
    cache = BlockTableCache(pool, manager)
    cache.block_table = [manager.allocate() for _ in range(handoff.k.shape[1])]
    pool.k[:, cache.block_table] = handoff.k                                 # [layers, n_blocks, bs, n_kv, hd]
    pool.v[:, cache.block_table] = handoff.v
    cache.length = handoff.length
    return cache


def decode_greedy(model, cache, first_token: int, n_new: int) -> list[int]:
    """n_new greedy tokens, `first_token` (the prefill's) included, continuing from `cache`."""
    tokens = [first_token]
    while len(tokens) < n_new:
        tokens.append(int(np.argmax(model.decode(tokens[-1], cache))))
    return tokens


def decode_from_blocks(model, handoff: Handoff, n_new: int, pool: PagedKVCache | None = None,
                       manager: BlockManager | None = None) -> list[int]:
    """Install the handed-over blocks (in `pool`, default a fresh one) and decode greedily: the decode
    worker's whole job."""
    if pool is None:
        pool, manager = decode_pool(model.config, handoff, n_new)
    return decode_greedy(model, install_blocks(pool, manager, handoff), handoff.first_token, n_new)


# ---- the channel: bytes only --------------------------------------------------------------------

def send_handoff(conn, handoff: Handoff) -> None:
    """A JSON header (token, length, shape), then the key blocks and the value blocks as raw fp32 bytes."""
    header = {"first_token": handoff.first_token, "length": handoff.length, "shape": list(handoff.k.shape),
              "dtype": "float32"}
    conn.send_bytes(json.dumps(header).encode())
    conn.send_bytes(np.ascontiguousarray(handoff.k, dtype=np.float32))
    conn.send_bytes(np.ascontiguousarray(handoff.v, dtype=np.float32))


def receive_handoff(conn, config) -> Handoff:
    """Read what send_handoff wrote, checking it fits `config` (ValueError, never a silently wrong cache)."""
    header = json.loads(conn.recv_bytes())
    shape = tuple(header["shape"])
    want = (config.n_layers, config.n_kv_heads, config.head_dim)
    if header.get("dtype") != "float32" or len(shape) != 5 or (shape[0], *shape[3:]) != want:
        raise ValueError(f"a handoff of shape {shape} ({header.get('dtype')}) does not fit this model's "
                         f"cache (layers, KV heads, head_dim = {want}, float32)")
    if not 0 < header["length"] <= shape[1] * shape[2]:
        raise ValueError(f"a handoff of {header['length']} positions does not fit in {shape[1]} blocks of {shape[2]}")
    k, v = (np.frombuffer(conn.recv_bytes(), dtype=np.float32).reshape(shape) for _ in range(2))
    return Handoff(int(header["first_token"]), int(header["length"]), k, v)


# ---- two processes ------------------------------------------------------------------------------

@dataclass
class DisaggregatedRun:
    """What one request through the two workers did and took (seconds on one machine's monotonic clock)."""
    tokens: list[int]
    handoff_bytes: int
    prefill_s: float         # the prefill worker's forward pass over the prompt
    handoff_s: float         # from the first byte sent to the blocks installed in the decode worker's pool
    decode_s: float          # the decode worker's steps after the handoff
    prompt_tokens: int
    block_size: int


def run_disaggregated(load_model: Callable, prompt: list[int], n_new: int,
                      block_size: int = DEFAULT_BLOCK_SIZE, timeout_s: float = 300.0) -> DisaggregatedRun:
    """Greedy-decode `prompt` for n_new tokens with prefill and decode in two spawned processes.
    load_model: a picklable callable (a module-level function, or functools.partial of one) that returns
    the model in each worker, as each machine would load its own weights."""
    if not prompt or n_new < 1:
        raise ValueError("a disaggregated run needs a prompt and at least one new token")
    ctx = multiprocessing.get_context("spawn")
    prefill_end, decode_end = ctx.Pipe()               # the handoff channel (and the decode worker's "ready")
    report_in, report_out = ctx.Pipe(duplex=False)     # each worker's numbers, back to this process
    workers = [ctx.Process(target=_prefill_worker, args=(load_model, prompt, block_size, prefill_end, report_out),
                           name="prefill"),
               ctx.Process(target=_decode_worker, args=(load_model, n_new, decode_end, report_out), name="decode")]
    for w in workers:
        w.start()
    for end in (prefill_end, decode_end, report_out):  # this process keeps only the reports' reading end
        end.close()
    reports = {}
    try:
        while len(reports) < 2:
            if not report_in.poll(timeout_s):
                missing = " and ".join(w.name for w in workers if w.name not in reports)
                raise TimeoutError(f"the {missing} worker did not report within {timeout_s:g} s")
            report = report_in.recv()
            if "error" in report:
                raise RuntimeError(f"the {report['worker']} worker failed: {report['error']}")
            reports[report["worker"]] = report
    except EOFError:
        raise RuntimeError("a worker exited without reporting (its output is above)") from None
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.terminate()
    p, d = reports["prefill"], reports["decode"]
    return DisaggregatedRun(d["tokens"], p["handoff_bytes"], p["prefill_s"], d["installed_at"] - p["sent_at"],
                            d["decode_s"], len(prompt), block_size)


def _prefill_worker(load_model, prompt, block_size, conn, report) -> None:
    try:
        model = load_model()
        start = time.perf_counter()
        handoff = prefill_blocks(model, prompt, block_size)
        prefill_s = time.perf_counter() - start
        conn.recv_bytes()                              # the decode worker is ready: the send measures the handoff
        sent_at = time.monotonic()                     # one clock for both processes (CLOCK_MONOTONIC)
        send_handoff(conn, handoff)
        report.send({"worker": "prefill", "prefill_s": prefill_s, "sent_at": sent_at, "handoff_bytes": handoff.nbytes})
    except Exception as e:                             # the parent raises it, in one line
        report.send({"worker": "prefill", "error": f"{type(e).__name__}: {e}"})


def _decode_worker(load_model, n_new, conn, report) -> None:
    try:
        model = load_model()
        conn.send_bytes(b"ready")
        handoff = receive_handoff(conn, model.config)
        cache = install_blocks(*decode_pool(model.config, handoff, n_new), handoff)
        installed_at = time.monotonic()
        start = time.perf_counter()
        tokens = decode_greedy(model, cache, handoff.first_token, n_new)
        report.send({"worker": "decode", "tokens": tokens, "installed_at": installed_at,
                     "decode_s": time.perf_counter() - start})
    except Exception as e:
        report.send({"worker": "decode", "error": f"{type(e).__name__}: {e}"})
