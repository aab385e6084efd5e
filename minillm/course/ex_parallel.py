"""Exercise 21, tensor parallelism: shard a block's weights for rank r of N and compute that rank's
partial outputs; the grader checks each rank's partial and that the N partials sum to the unsharded
block (what the all-reduce after o and after down computes)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, _expect_tuple, case_rng, expect_close, expect_unchanged

WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_HF = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
       "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def tp_partials_reference(h, weights: dict, n_heads: int, n_kv_heads: int, rank: int, n_ranks: int):
    """The engine's split (engine/parallel/sharding.py) and its attention and SwiGLU on one rank's slices.

    h: [T, dim] a block's normalized input; weights: HF-layout wq, wk, wv, wo, w_gate, w_up, w_down.
    -> (attention partial [T, dim], MLP partial [T, dim]): causal attention without RoPE over the rank's
    heads through its slice of o, and SwiGLU over its slice of the FFN width through its slice of down."""
    from minillm.engine.parallel import sharding
    from minillm.model.attention import grouped_attention
    from minillm.model.config import ModelConfig
    from minillm.model.layers import linear, swiglu

    T, dim = h.shape
    cfg = ModelConfig(vocab_size=n_ranks, dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      ffn_dim=len(weights["w_gate"]), head_dim=len(weights["wq"]) // n_heads)
    shard = sharding.plan(cfg, n_ranks, rank)
    full = {f"model.layers.0.{_HF[k]}.weight": weights[k] for k in WEIGHTS}
    mine = {k: sharding.shard_tensors(cfg, full, shard)[f"model.layers.0.{_HF[k]}.weight"] for k in WEIGHTS}
    hd = cfg.head_dim
    q = linear(h, mine["wq"]).reshape(T, len(shard.heads), hd)                  # [T, heads_r, hd]
    k = linear(h, mine["wk"]).reshape(T, len(shard.kv_heads), hd).transpose(1, 0, 2)   # [kv_r, T, hd]
    v = linear(h, mine["wv"]).reshape(T, len(shard.kv_heads), hd).transpose(1, 0, 2)
    attn = linear(grouped_attention(q, k, v), mine["wo"])                       # [T, dim], a partial sum
    return attn, swiglu(h, mine["w_gate"], mine["w_up"], mine["w_down"])       # [T, dim], a partial sum


def _tp_cases() -> list[Case]:
    def case(name, T, dim, n_heads, n_kv, hd, ffn, n_ranks):
        return Case(name, dict(T=T, dim=dim, n_heads=n_heads, n_kv=n_kv, hd=hd, ffn=ffn, n_ranks=n_ranks))
    return [case("MHA: 4 heads, 4 KV heads, 2 ranks", 5, 32, 4, 4, 8, 64, 2),
            case("GQA: 8 heads, 2 KV heads, 2 ranks (one KV head each)", 6, 32, 8, 2, 4, 48, 2),
            case("MQA: 4 heads, 1 KV head, 2 ranks (the KV head replicated)", 4, 32, 4, 1, 8, 32, 2),
            case("GQA: 8 heads, 2 KV heads, 4 ranks (each KV head replicated on 2 ranks)", 5, 32, 8, 2, 4, 64, 4),
            case("SmolLM2's split: 9 heads, 3 KV heads, 3 ranks", 4, 36, 9, 3, 4, 48, 3),
            case("one token (decode)", 1, 32, 8, 4, 4, 32, 2)]


def _check_tp(fn, case: Case) -> str:
    c = case.inputs
    rng = case_rng(c["T"] * 100 + c["n_heads"] * 10 + c["n_ranks"])
    H, kv, hd, dim, ffn = c["n_heads"], c["n_kv"], c["hd"], c["dim"], c["ffn"]
    shapes = dict(wq=(H * hd, dim), wk=(kv * hd, dim), wv=(kv * hd, dim), wo=(dim, H * hd),
                  w_gate=(ffn, dim), w_up=(ffn, dim), w_down=(dim, ffn))
    weights = {k: (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for k, s in shapes.items()}
    h = rng.standard_normal((c["T"], dim)).astype(np.float32)
    whole = tp_partials_reference(h, weights, H, kv, 0, 1)                      # the unsharded block
    sums = [np.zeros_like(whole[0]), np.zeros_like(whole[1])]
    for rank in range(c["n_ranks"]):
        given = {k: w.copy() for k, w in weights.items()}
        got = _expect_tuple(fn(h.copy(), given, H, kv, rank, c["n_ranks"]), 2, "attention partial, MLP partial")
        for k in WEIGHTS:
            expect_unchanged(k, weights[k], given[k])
        want = tp_partials_reference(h, weights, H, kv, rank, c["n_ranks"])
        for i, part in enumerate(("attention", "MLP")):
            expect_close(f"rank {rank}'s {part} partial", got[i], want[i])
            sums[i] += got[i]
    return "; ".join(expect_close(f"sum over ranks = unsharded {part}", s, w)
                     for part, s, w in zip(("attention", "MLP"), sums, whole))
