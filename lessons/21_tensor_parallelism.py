"""Lesson 21 — tensor parallelism: one model over several processes, two all-reduces a block.

Read it after lesson 03 (decode reads every weight once per token). When a model outgrows one device,
or one device's bandwidth, split each matrix over N ranks (Megatron-LM):

    q, k, v, gate, up   column-parallel: rank r keeps a block of output rows (its heads, its FFN slice)
    o, down             row-parallel: rank r keeps the matching input columns -> a partial sum
    embedding, LM head  vocab-parallel: a block of rows each; the logits are all-gathered

Attention heads are independent and SwiGLU is elementwise, so nothing moves between q/k/v and o or
between gate/up and down: each rank's o and down give partial sums of the whole output, and one
all-reduce after each adds them up. Each rank reads 1/N of the weights per token — and waits for
two all-reduces a layer. This lesson runs the engine's split (minillm/engine/parallel), checks it
against the unsharded model, measures its cost here over MPI, and models it on GPUs: where does
adding ranks stop paying? (those four modelled tables print with --model-tables). Exercise 21 writes
one rank's shard of a block.

The same numbers from the command line: `minillm bench -m PATH --tp 2` (measured here) and
`minillm plan -m mistral-7b --gpu h200 --tp 8 [--pp 4] [--link nvlink|pcie|mpi]` (modeled).

Run: minillm lesson 21 [--model-tables]      (or python lessons/21_tensor_parallelism.py; --quick: a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 01 (a block)",
        "lesson 03 (bytes and FLOPs)",
    ],
    "objectives": [
        "split a block Megatron-style: heads and MLP columns per rank, two all-reduces a block",
        "check tp=3 logits against the unsharded model",
        "measure tp=2 over MPI on this machine (when mpiexec is there)",
    ],
    "study_time": "50 min, plus 25 min for exercise 21 (one rank's shard)",
    "check_questions": [
        "Why does a block need exactly two all-reduces per token under tensor parallelism?",
        "Which tp sizes divide SmolLM2's 9 heads and 3 KV heads?",
    ],
    "try_this": [
        "python lessons/21_tensor_parallelism.py --model-tables for the modelled 7B/70B tables",
        "minillm plan -m mistral-7b --tp 8 --link pcie",
    ],
}
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # the ranks below are threads sharing the cores
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import lesson_model, print_table, quick
from minillm.course.measure import beside_reference, load_line
from minillm.engine.parallel import cost, sharding
from minillm.engine.parallel.communicator import run_ranks
from minillm.llm import LLM
from minillm.model.config import PRESETS, ModelConfig
from minillm.model.transformer import Transformer
from minillm.resources import install_hint


def shard_llm(llm: LLM, comm) -> Transformer:
    """This rank's Transformer, from the unsharded model's tensors (what minillm.load(tp=) does from disk)."""
    local_cfg, tensors = sharding.shard_checkpoint(llm.config, llm.model.hf_tensors(), comm.rank, comm.size)
    return Transformer(local_cfg, tensors, comm=comm)


# NEW: the split, rank by rank --------------------------------------------------------------------
def part_split(llm: LLM, tp: int) -> None:
    cfg = llm.config
    rows = []
    for r in range(tp):
        s = sharding.plan(cfg, tp, r)
        hd = cfg.head_dim
        rows.append((r, f"{s.heads.start}-{s.heads.stop - 1}", f"{s.kv_heads.start}-{s.kv_heads.stop - 1}",
                     f"[{len(s.heads) * hd}, {cfg.dim}]", f"[{cfg.dim}, {len(s.heads) * hd}]",
                     f"[{len(s.ffn)}, {cfg.dim}]", f"[{cfg.dim}, {len(s.ffn)}]", f"{s.vocab_rows}"))
    print_table(f"Lesson 21 — {llm.name}: one block split {tp} ways (tp can be {sharding.valid_sizes(cfg, 12)})",
                ["rank", "q heads", "KV heads", "wq", "wo", "gate/up", "down", "vocab rows"], rows)


def part_equal(llm: LLM, tp: int, ids: list[int]) -> None:
    """The sharded model's logits against the unsharded one's, and what moved to get them."""
    want = llm.logits(ids)

    def on_rank(comm):
        model = shard_llm(llm, comm)
        logits = model.prefill(ids, model.new_cache(len(ids) + 1), all_logits=True)
        comm.stats.reset()
        model.decode(int(np.argmax(logits[-1])), model.new_cache(len(ids) + 1))   # one step: count the moves
        return logits, sharding.model_bytes(model), dict(comm.stats.calls), dict(comm.stats.bytes)

    results = run_ranks(tp, on_rank)
    whole = sharding.model_bytes(llm.model)
    err = max(float(np.abs(r[0] - want).max()) for r in results)
    calls, moved = results[0][2], results[0][3]
    print_table(f"tp={tp} (ranks as threads) vs the unsharded model, {len(ids)} tokens",
                ["quantity", "value"],
                [("max |logits tp - logits tp=1|", f"{err:.2e}"),
                 ("same top-1 at every position", str(all((r[0].argmax(1) == want.argmax(1)).all() for r in results))),
                 ("weights per rank (MB)", ", ".join(f"{r[1] / 1e6:.1f}" for r in results)),
                 ("unsharded weights (MB)", f"{whole / 1e6:.1f}"),
                 ("all-reduces per decoded token", f"{calls.get('all_reduce', 0)} = 2 × {llm.config.n_layers} layers "
                                                   f"+ 1 (the embedding)"),
                 ("all-gathers per decoded token", f"{calls.get('all_gather', 0)} (the logits)"),
                 ("all-reduce payload per decoded token (bytes)", f"{moved.get('all_reduce', 0):,}")])
    print("Why two a block: o's and down's inputs are split, so their outputs are partial sums; everything "
          "between (attention per head, SwiGLU per element) needs no neighbour.")


# NEW: the cost here, measured over MPI ------------------------------------------------------------
def part_measured(n_layers: int, prompt: int, new: int) -> dict | None:
    from minillm.checkpoints.quantize import write_random_checkpoint
    from minillm.engine.parallel.measure import measure
    if shutil.which("mpiexec") is None:
        print(f"\n(no mpiexec here: {install_hint('tp')} to measure tp = 2)")
        return None
    # SmolLM2's widths with 8 query heads and 2 KV heads (SmolLM2 itself has 9 and 3: tp = 2 cannot split it)
    cfg = ModelConfig(vocab_size=49152, dim=576, n_layers=n_layers, n_heads=8, n_kv_heads=2, ffn_dim=1536,
                      head_dim=72, tie_embeddings=True, max_seq_len=2048)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(cfg, tmp, dtype="float32")
        runs = [("tp=1, 1 thread", measure(tmp, 1, 1, prompt, new))]
        if not quick():                                  # the same cores as 2 ranks, in one process
            runs.append(("tp=1, 2 threads", measure(tmp, 1, 2, prompt, new)))
        runs.append(("tp=2, 1 thread a rank", measure(tmp, 2, 1, prompt, new)))
    rows = [(name, f"{m['prefill_tok_s']:.1f}", f"{m['decode_tok_s']:.2f}", f"{m['weights_bytes_per_rank'] / 1e6:.0f}",
             f"{100 * m['comm_share']:.0f}%", f"{m['all_reduce_us']:.0f}" if m["all_reduce_us"] else "-")
            for name, m in runs]
    print_table(f"measured here: {n_layers} layers of SmolLM2's widths (8 heads / 2 KV heads), prompt {prompt}, "
                f"{new} decoded tokens, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
                ["run", "prefill tok/s", "decode tok/s", "MB/rank", "comm share of decode", "µs per all-reduce in decode"],
                rows)
    sizes = runs[-1][1]["all_reduce_us_by_size"]
    print_table("one fp32 all-reduce between the 2 ranks, alone (median)", ["values", "bytes", "µs"],
                [(n, f"{4 * int(n):,}", f"{us:.1f}") for n, us in sizes.items()])
    for n, us in sizes.items():
        if int(n) == 576:                                # a decode token of SmolLM2: the project's own figure
            print(beside_reference("cpu.tp.all-reduce-576", us))
    print(load_line())
    print("In decode, an all-reduce costs what it costs alone plus the wait for the slower rank: on shared "
          "cores the ranks drift apart, and every wait lands in the all-reduce.")
    return sizes


# NEW: the modeled cost on GPUs --------------------------------------------------------------------
LLAMA_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672)


def part_modeled(sizes: dict | None) -> None:
    h200_bandwidth = 4.8e12
    links = [cost.LINKS["nvlink"], cost.LINKS["pcie"]]
    if sizes:
        (n1, us1), (n2, us2) = [(int(n), us) for n, us in sizes.items()]
        links.append(cost.measured_link(us1, n1, us2, n2))
    for name, cfg in [("Mistral-7B", PRESETS["mistral-7b"].config), ("Llama-3-70B shape", LLAMA_70B)]:
        for batch in (1, 64):
            rows = []
            for link in links:
                tps = cost.tp_rows(cfg, h200_bandwidth, link, tps=(1, 2, 4, 8), batch=batch, context=4096)
                stop = cost.stops_paying(tps)
                rows += [(link.name, r.tp, f"{r.weight_bytes_per_rank / 1e9:.1f}",
                          f"{r.bytes_moved_per_token_per_layer / 1e3:.1f}", f"{1e3 * r.memory_s:.2f}",
                          f"{1e3 * r.comm_s:.2f}", f"{batch * r.tok_s:,.0f}",
                          ("stops paying" if r.tp == stop else "")) for r in tps]
            print_table(f"modeled decode on H200s (4.8 TB/s each): {name}, bf16, batch {batch}, 4k context",
                        ["link", "tp", "GB/rank", "KB sent/token/layer", "memory ms", "all-reduce ms", "tok/s",
                         ""], rows)
    print(f"Pipeline parallelism instead: 4 stages over 16 micro-batches idle {100 * cost.pp_bubble(4, 16):.0f}% "
          f"of the time (the bubble), over 4 micro-batches {100 * cost.pp_bubble(4, 4):.0f}%.")


def main() -> None:
    # The four modelled GPU tables (Mistral-7B and a Llama-3-70B shape, batch 1 and 64) come with a flag:
    # the lesson measures; the model of GPUs is a second read (as `minillm plan --tp N` is).
    model_tables = "--model-tables" in sys.argv[1:]
    llm = lesson_model()
    tp = 3 if llm.config.n_heads % 3 == 0 else 2
    part_split(llm, tp)
    ids = llm.tokenizer.encode("Tensor parallelism splits every matrix")[:4 if quick() else 16]
    part_equal(llm, tp, ids)
    sizes = part_measured(2 if quick() else 30, 16 if quick() else 64, 4 if quick() else 16)
    if model_tables:
        part_modeled(sizes)
    else:
        print("\nModelled on GPUs (Mistral-7B and Llama-3-70B on H200s over NVLink, PCIe and this machine's link: "
              "where adding ranks stops paying): minillm lesson 21 --model-tables, or "
              "minillm plan -m mistral-7b --gpu h200 --tp 8")


if __name__ == "__main__":
    main()
