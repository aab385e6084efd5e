"""The serving engine's decode step on the GPU: eager launches vs the bucket's CUDA graph, at a model shape.

For B decode rows (B in 1, 8, 32, 64), each with ~160 positions already in the paged pool (random K/V):

    step ms      GPUBatchedRunner.forward of a decode-only batch: eager (every launch from Python) and graph
                 (the batch padded to its bucket, one replay), by CUDA events and by the wall clock (the
                 wall adds packing, the metadata upload and the logits download)
    greedy wall  the graph step by forward_greedy: each row's argmax picked on the device, B int32 copied
                 back instead of the logits [B, vocab] fp32 (what the Engine does when every request is greedy)
    check        the graph's logits == the eager logits (fp tolerance), its greedy ids == their argmax (exactly);
                 any mismatch exits non-zero
    attention    one layer's paged attention, µs: "head" (a block per query head) vs "group" (a block per
                 GQA group, each K/V row read once), and their outputs compared
    GB/s         (weights + the rows' K/V) / graph step time, against the device-to-device copy roofline

    python -m minillm.cuda.dev.serve_step [--preset mistral-7b] [--context 160] [--batches 1,8,32,64]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

from minillm.cuda.dev.common import finish, plain_table, rel_err, require_gpu, say, verdict

BLOCK = 16
LOGITS_TOL = 2e-3           # relative to the largest |logit|: fp16 GEMMs, cuBLAS may pick other kernels per M


def random_pool(cp, config, num_blocks: int):
    """A 16-bit pool whose every slot holds random K/V (~N(0, 1)), one layer at a time (bounded scratch)."""
    from minillm.cuda.gpu_batched import DevicePagedKV
    pool = DevicePagedKV(config, num_blocks, BLOCK, "float16")
    for a in (pool.k, pool.v):
        for i in range(config.n_layers):
            a[i] = cp.random.standard_normal(a[i].shape, dtype=cp.float32).astype(cp.float16)
    cp.cuda.Device().synchronize()
    return pool


def decode_chunks(B: int, context: int, rng):
    """B decode chunks at position `context`, each sequence in its own scattered blocks."""
    from minillm.engine.batched import SeqChunk
    per_seq = math.ceil((context + 1) / BLOCK)
    blocks = rng.permutation(B * per_seq).reshape(B, per_seq).tolist()
    return [SeqChunk([int(rng.integers(3, 30000))], context, blocks[b]) for b in range(B)]


def wall_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def attention_us(cp, gpu, pool, chunks, reps: int = 20) -> tuple[float, float, float]:
    """One layer's paged attention for these decode rows: (µs head, µs group, group vs head rel. error)."""
    from minillm.cuda.timing import time_gpu
    from minillm.cuda.dev.paged_attention import lab_ops
    from minillm.cuda.gpu_batched import batch_meta
    meta = batch_meta(chunks, BLOCK, cp.asarray)
    qkv = cp.random.standard_normal((len(chunks), gpu.qkv_width), dtype=cp.float32)
    k, v, _ = pool.layer(0)
    outs, us = [], []
    cp.cuda.Device().synchronize()
    with gpu.stream:
        for kind in ("head", "group"):
            ops = lab_ops(gpu, pool, attention=kind)
            out = cp.full((len(chunks), gpu.q_width), cp.nan, cp.float32)
            us.append(time_gpu(lambda: ops.attend(qkv, k, v, meta, out=out), reps) * 1e3)
            outs.append(cp.asnumpy(out))
    return us[0], us[1], rel_err(outs[1], outs[0])


def one_batch(cp, gpu, pool, B: int, context: int, bw: float, reps: int) -> list:
    """Eager vs graph for B rows: times, the logits check, attention, GB/s. -> a table row."""
    from minillm.cuda.timing import time_gpu
    from minillm.cuda.gpu_batched import GPUBatchedRunner, bucket_for
    chunks = decode_chunks(B, context, np.random.default_rng(B))
    eager = GPUBatchedRunner(gpu, pool, use_graph=False)
    graph = GPUBatchedRunner(gpu, pool, use_graph=True)
    want = eager.forward(chunks)                       # both write the same K/V into the same slots
    got = graph.forward(chunks)                        # captures the bucket's graph
    if graph.graph_error is not None:
        verdict(f"B={B} capture", False, graph.graph_error)
        return [B, bucket_for(B), "-", "-", "-", "-", "-", "-", "-", "-"]
    err = rel_err(got, want)
    verdict(f"B={B} graph logits == eager logits", err <= LOGITS_TOL and np.isfinite(got).all(),
            f"err {err:.2e}  tol {LOGITS_TOL:.0e}")
    ids = graph.forward_greedy(chunks)                 # the same step again: the same K/V, the same logits
    same = int((ids == got.argmax(axis=1)).sum())
    verdict(f"B={B} graph greedy ids == argmax of its logits", same == B, f"{same} of {B} rows")
    with gpu.stream:
        ev_eager = time_gpu(lambda: eager.forward(chunks), reps)
        ev_graph = time_gpu(lambda: graph.forward(chunks), reps)
    wall_eager, wall_graph = wall_ms(lambda: eager.forward(chunks), reps), wall_ms(lambda: graph.forward(chunks), reps)
    wall_greedy = wall_ms(lambda: graph.forward_greedy(chunks), reps)
    head_us, group_us, attn_err = attention_us(cp, gpu, pool, chunks)
    verdict(f"B={B} group attention == head attention", attn_err <= 1e-4, f"err {attn_err:.2e}")
    kv_bytes = B * (context + 1) * gpu.config.kv_bytes_per_token(2)         # every row reads its keys + values
    gbs = (gpu.weight_bytes + kv_bytes) / (ev_graph / 1e3) / 1e9
    return [B, bucket_for(B), f"{ev_eager:.2f}", f"{ev_graph:.2f}", f"{wall_eager:.2f}", f"{wall_graph:.2f}",
            f"{wall_greedy:.2f}", f"{head_us:.1f}", f"{group_us:.1f}", f"{gbs:.0f} ({100 * gbs / (bw / 1e9):.0f}%)"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.serve_step")
    parser.add_argument("--preset", default="mistral-7b")
    parser.add_argument("--context", type=int, default=160, help="positions already cached per row")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if not require_gpu("serve_step"):
        return 2
    import cupy as cp
    from minillm.cuda.timing import copy_bandwidth
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.model.config import PRESETS
    if args.preset not in PRESETS:
        print(f"serve_step: unknown preset {args.preset!r}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    config = PRESETS[args.preset].config
    t0 = time.perf_counter()
    gpu = GPUTransformer.random(config, "float16", seed=0)
    pool = random_pool(cp, config, max(batches) * math.ceil((args.context + 1) / BLOCK))
    bw = copy_bandwidth(1 << 30)
    say(f"{args.preset}: {gpu.weight_bytes / 1e9:.1f} GB of fp16 weights, {args.context} cached positions a row, "
        f"copy roofline {bw / 1e9:.0f} GB/s (setup {time.perf_counter() - t0:.0f} s)")
    rows = [one_batch(cp, gpu, pool, B, args.context, bw, args.reps) for B in batches]
    plain_table(f"decode step, {args.preset} shape (ms per step; attention µs for one layer)",
                ["B", "bucket", "eager ev", "graph ev", "eager wall", "graph wall", "greedy wall", "attn head µs",
                 "attn group µs", "graph GB/s (of roofline)"], rows)
    say(f"total {time.perf_counter() - t0:.0f} s")
    return finish("serve_step")


if __name__ == "__main__":
    sys.exit(main())
