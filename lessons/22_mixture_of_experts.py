"""Lesson 22 — Mixture of experts: a router sends each token to k of E expert MLPs.

Read it after lesson 03 (prefill vs decode). A dense Llama layer runs every token through one
SwiGLU MLP. A sparse mixture-of-experts (MoE) layer holds E of them and a router, a [E, dim] matrix
that scores the token against each expert; the token goes through its k best only, and their outputs
are summed with the router's (renormalized) weights. Mixtral 8x7B stores 47 B parameters and runs 13 B
a token; DeepSeek-V3 stores 671 B and runs 37 B. The model's memory is its total parameters, its
speed its active ones, if the experts are computed sparsely: gather each expert's tokens, run the
expert on them alone, scatter the results back (minillm.model.moe.moe_block).

No real MoE weights reach these machines, so this lesson builds a random Mixtral-shaped MoE layer
(8 experts, top-2) in NumPy. Routing decisions of random weights mean nothing; what is measured here
does not depend on them: that sparse equals dense, how load spreads over experts and how a bias
rebalances it, that prefill time follows k (the active experts), and the bytes per token.
Exercise 22 writes the router.

Run: python lessons/22_mixture_of_experts.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 01 (SwiGLU)",
        "lesson 04 (softmax)",
    ],
    "objectives": [
        "route each token to k of E experts and combine their outputs",
        "see routing imbalance and DeepSeek-V3's bias update fix it",
        "measure prefill at top-1..8 against the dense computation",
    ],
    "study_time": "45 min, plus 20 min for exercise 22 (top-k routing)",
    "check_questions": [
        "Why does a MoE model hold all experts in memory but compute with few?",
        "What does an unbalanced router cost on a batch?",
    ],
    "try_this": [
        "minillm plan -m gpt-oss-120b --gpu h200 --dtype mxfp4",
        "change k in the top-k table and compare time / dense time with k/E",
    ],
}
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course import print_table, quick, save_plot
from minillm.course.measure import check, interleaved, load_average, load_line
from minillm.model.config import ModelConfig
from minillm.model.moe import Expert, MoEWeights, expert_load, moe_block, route

QUICK = quick()
DIM, FFN, N_EXPERTS, TOP_K = (64, 96, 8, 2) if QUICK else (512, 1024, 8, 2)
TOKENS = 64 if QUICK else 512


def random_moe(rng, cfg: ModelConfig) -> MoEWeights:
    """A random MoE block of cfg's shape (weights N(0, 1/dim): activations stay O(1))."""
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    experts = [Expert(w(cfg.moe_ffn_dim, cfg.dim), w(cfg.moe_ffn_dim, cfg.dim), w(cfg.dim, cfg.moe_ffn_dim))
               for _ in range(cfg.n_experts)]
    return MoEWeights(router=w(cfg.n_experts, cfg.dim), experts=experts)


def moe_config(k: int = TOP_K, router: str = "softmax") -> ModelConfig:
    return ModelConfig(vocab_size=1, dim=DIM, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=FFN, n_experts=N_EXPERTS,
                       n_experts_per_token=k, moe_ffn_dim=FFN, router=router)


# NEW: the dense way to compute the same thing: every expert on every token, weighted -------------------
def every_expert(h, moe: MoEWeights, cfg: ModelConfig):
    """Σ_e w_e(x)·expert_e(x) with w_e = 0 for the experts not chosen: E/k times the work of moe_block."""
    ids, weights = route(h, moe, cfg)                                     # [T, k] each
    dense = np.zeros((h.shape[0], cfg.n_experts), np.float32)             # [T, E] the routing weights
    np.put_along_axis(dense, ids, weights, axis=-1)
    return sum(dense[:, e:e + 1] * expert(h) for e, expert in enumerate(moe.experts))   # [T, dim]


def sparse_equals_dense(rng, cfg, moe):
    h = rng.standard_normal((TOKENS, DIM)).astype(np.float32)
    diff = np.abs(moe_block(h, moe, cfg) - every_expert(h, moe, cfg)).max()
    print_table(f"Lesson 22 — a random MoE layer (dim {DIM}, {N_EXPERTS} experts of width {FFN}, top-{TOP_K}), "
                f"{TOKENS} tokens", ["computed as", "experts run per token", "max |sparse - dense|"],
                [["moe_block: gather -> expert -> scatter", TOP_K, f"{diff:.1e}"],
                 ["every expert on every token, weighted", N_EXPERTS, "(reference)"]])


# NEW: load balance: what fraction of the routed slots each expert gets ------------------------------
def balance(rng):
    """A router that favours a few experts (skewed rows), then DeepSeek-V3's auxiliary-loss-free fix: after
    each batch, lower the correction bias of over-loaded experts and raise it for under-loaded ones.
    The bias moves the choice only, not the weights the outputs are summed with."""
    cfg = moe_config(router="sigmoid")
    moe = random_moe(rng, cfg)
    moe.router *= np.linspace(0.5, 2.0, N_EXPERTS, dtype=np.float32)[:, None]   # experts with longer rows win more
    moe.router += 0.05 * rng.standard_normal(DIM).astype(np.float32)            # and a shared direction
    moe.bias = np.zeros(N_EXPERTS, np.float32)
    h = rng.standard_normal((TOKENS * 4, DIM)).astype(np.float32) + 0.5
    rows, history, step_size = [], [], 0.02
    for step in range((20 if QUICK else 100) + 1):
        ids, _ = route(h, moe, cfg)
        load = expert_load(ids, N_EXPERTS)                                       # [E] fractions of the slots
        history.append(load.max() * N_EXPERTS)
        if step in (0, 1, 5, 20, 100):
            rows.append([step, " ".join(f"{x:.2f}" for x in load), f"{load.max() * N_EXPERTS:.2f}x"])
        moe.bias -= step_size * np.sign(load - 1 / N_EXPERTS)                   # the bias update (no gradient)
    print_table(f"load per expert ({TOKENS * 4} tokens, top-{TOP_K} of {N_EXPERTS}, sigmoid router with a skew), "
                "as the correction bias is updated (step size 0.02)",
                ["update", "fraction of routed slots per expert (1/8 = 0.125 each when balanced)",
                 "busiest / balanced"], rows)
    print("  a fixed step leaves the bias oscillating around its target (DeepSeek-V3 trains with a step of 0.001);")
    print("  an expert that gets 3x its share holds up every expert-parallel step (its GPU is the slowest),")
    print("  and a popular expert's tokens may be dropped where capacity is fixed: balance is a speed issue.")
    save_plot("22_load_balance.png", lambda ax: (ax.plot(history), ax.set_xlabel("bias updates"),
                                                 ax.set_ylabel("busiest expert's load / balanced load")))


# NEW: prefill time follows the active parameters -----------------------------------------------------
def prefill_cost(rng):
    h = rng.standard_normal((TOKENS, DIM)).astype(np.float32)
    moe = random_moe(rng, moe_config())
    repeats = 2 if QUICK else 5
    total = 3 * DIM * FFN * N_EXPERTS
    # top-1..8 and the dense computation take turns (course/measure.py): other work slows them alike
    contestants = {k: lambda cfg=moe_config(k): moe_block(h, moe, cfg) for k in (1, 2, 4, 8)}
    contestants["dense"] = lambda: every_expert(h, moe, moe_config(2))
    load_start = load_average()
    times = interleaved(contestants, repeats)
    dense = times["dense"]
    rows = []
    for k in (1, 2, 4, 8):
        active = 3 * DIM * FFN * k
        rows.append([f"moe_block, top-{k}", f"{active / 1e6:.2f} M", f"{active / total:.3f}", times[k].ms(),
                     f"{times[k].median / dense.median:.3f}"])
    rows.append(["every expert, weighted (dense)", f"{total / 1e6:.2f} M", "1.000", dense.ms(), "1.000"])
    print_table(f"prefill of {TOKENS} tokens through one MoE layer ({N_EXPERTS} experts), ms (median (min-max) of "
                f"{repeats} interleaved rounds, 1 BLAS thread)", ["computed as", "expert params a token",
                                                                 "active / total", "ms", "time / dense time"], rows)
    print(f"  {load_line(load_start)}")
    check(f"top-2 of {N_EXPERTS} experts costs well under the dense computation (time follows the active share)",
          times[2].median < 0.6 * dense.median, f"top-2 {times[2].median / dense.median:.2f} of dense")
    print(f"  time follows the active share, not the {N_EXPERTS} experts held; a little above it at small k, where")
    print(f"  each expert's GEMM has fewer rows ({TOKENS}·k/{N_EXPERTS} tokens) and a fixed cost per call weighs more")


# NEW: total vs active, memory vs bytes read per token --------------------------------------------------
MIXTRAL_8X7B = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           n_experts=8, n_experts_per_token=2, moe_ffn_dim=14336, family="mixtral")
DEEPSEEK_V3 = ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                          attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, family="deepseek_v3", n_experts=256,
                          n_experts_per_token=8, moe_ffn_dim=2048, n_shared_experts=1, first_dense_layers=3,
                          router="sigmoid", n_expert_groups=8, n_groups_per_token=4, routed_scaling_factor=2.5)


def active_vs_total():
    rows = []
    for name, c in [("Mixtral 8x7B", MIXTRAL_8X7B), ("DeepSeek-V3", DEEPSEEK_V3)]:
        total, active = c.n_params, c.n_active_params
        rows.append([name, f"{total / 1e9:.1f} B", f"{active / 1e9:.1f} B", f"{2 * total / 1e9:.0f} GB",
                     f"{2 * active / 1e9:.1f} GB", f"{batch_experts(c, 16):.0f} of {c.n_experts}"])
    print_table("total vs active parameters (bf16, batch 1: a decode step reads the active experts only)",
                ["model", "total params", "active params", "memory (bf16)", "bytes read / token",
                 "experts read per layer at batch 16"], rows)
    print("  a batch of B tokens reads E·(1 - (1 - k/E)^B) experts per layer: Mixtral's 8 are all read at batch 16,")
    print("  so its bytes per step are the dense model's; DeepSeek-V3's many small experts keep a sparse share longer")


def batch_experts(c: ModelConfig, batch: int) -> float:
    """Expected distinct experts a layer reads for `batch` tokens routed independently and uniformly."""
    return c.n_experts * (1 - (1 - c.n_experts_per_token / c.n_experts) ** batch)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    cfg = moe_config()
    sparse_equals_dense(rng, cfg, random_moe(rng, cfg))
    balance(rng)
    prefill_cost(rng)
    active_vs_total()
