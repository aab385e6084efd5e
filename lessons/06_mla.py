"""Lesson 06 — multi-head latent attention (MLA): cache one small latent per token, and attend in latent space.

Lesson 05 shrank the cache by sharing K and V between heads, and paid for it in quality. DeepSeek-V2/V3
cache neither K nor V: per token and layer they keep a latent c_KV (kv_lora_rank values) and one
small RoPE key shared by every head; each head's key and value are linear images of the latent.
`minillm.model.mla` computes the same attention two ways: "naive" expands K and V for every head from the
latents at every step, "absorbed" folds W_UK into the query and W_UV after the weighted sum, so all
heads read the one [L, kv_lora_rank + rope] cache. We check the two agree, time them as the context
grows, compare cache sizes, then convert SmolLM2 (GQA) to MLA by SVD (`minillm.checkpoints.mla_convert`) and
measure what each rank costs in perplexity. On a GPU it times the absorbed decode on hand-written kernels in
a CUDA graph (minillm/cuda/gpu_mla.py) against cuBLAS through CuPy and a GQA model of the same size.

Run: python lessons/06_mla.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 05 (KV heads)",
        "linear algebra: matrix products are associative; the SVD",
    ],
    "objectives": [
        "cache one latent vector per token instead of per-head keys and values (DeepSeek's MLA)",
        "absorb W_UK and W_UV into the query and output so decode reads only latents",
        "convert a GQA model to MLA by SVD and measure what each rank costs",
    ],
    "study_time": "60 min, plus 30 min for exercise 06 (absorbed attention)",
    "check_questions": [
        "Why does absorbing W_UK into the query leave the attention scores unchanged?",
        "How many bytes a token does DeepSeek-V3 cache with MLA, against MHA at the same heads?",
    ],
    "try_this": [
        "lower the latent rank in the SVD table and find where top-1 agreement collapses",
        "time the absorbed path at longer contexts (edit `contexts`)",
    ],
}
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.model.config import ModelConfig
from minillm.course import hf_tensors, lesson_model, print_table, quick, run_gpu_parts, save_plot
from minillm.course.measure import Spread, faster, interleaved, load_average, load_line
from minillm.tools.evaluate import eval_text, perplexity
from minillm.llm import LLM, thread_policy
from minillm.threads import install
from minillm.checkpoints.mla_convert import convert_to_mla
from minillm.model.transformer import Transformer


def deepseek_shaped(n_layers: int) -> ModelConfig:
    """DeepSeek-V3's attention at 1/8 of its width (dim 7168 -> 896, 128 heads -> 16, kv_lora_rank
    512 -> 128, the 128 + 64 query/key dims and 128 value dims halved), dense MLP layers only."""
    return ModelConfig(vocab_size=4096, dim=896, n_layers=n_layers, n_heads=16, n_kv_heads=16, ffn_dim=2048,
                       attention="mla", family="deepseek_v3", q_lora_rank=192, kv_lora_rank=128,
                       qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, rope_interleave=True,
                       norm_eps=1e-6, max_seq_len=16384)


def random_mla_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF DeepseekV3-named random weights of `cfg` (values do not matter for speed or for naive-vs-absorbed)."""
    rng = np.random.default_rng(seed)
    H, qk = cfg.n_heads, cfg.head_dim
    shapes = {"self_attn.q_a_proj": (cfg.q_lora_rank, cfg.dim), "self_attn.q_b_proj": (H * qk, cfg.q_lora_rank),
              "self_attn.kv_a_proj_with_mqa": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.dim),
              "self_attn.kv_b_proj": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
              "self_attn.o_proj": (cfg.dim, H * cfg.v_head_dim), "mlp.gate_proj": (cfg.ffn_dim, cfg.dim),
              "mlp.up_proj": (cfg.ffn_dim, cfg.dim), "mlp.down_proj": (cfg.dim, cfg.ffn_dim)}
    norms = {"input_layernorm": cfg.dim, "post_attention_layernorm": cfg.dim,
             "self_attn.q_a_layernorm": cfg.q_lora_rank, "self_attn.kv_a_layernorm": cfg.kv_lora_rank}
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, cfg.dim), dtype=np.float32),
         "model.norm.weight": np.ones(cfg.dim, np.float32),
         "lm_head.weight": rng.standard_normal((cfg.vocab_size, cfg.dim), dtype=np.float32) * 0.02}
    for i in range(cfg.n_layers):
        for name, (rows, cols) in shapes.items():     # 1/√fan-in: activations keep their scale, attention is peaked
            t[f"model.layers.{i}.{name}.weight"] = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        for name, width in norms.items():
            t[f"model.layers.{i}.{name}.weight"] = np.ones(width, np.float32)
    return t


# NEW: what each form holds per layer at decode, and the time of one decode step -------------------
def working_set_bytes(cfg: ModelConfig, context: int, mode: str) -> int:
    """Bytes of keys and values one layer's attention reads at one decode step (fp32).

    naive:    K_nope [H, L, nope] and V [H, L, v_head], rebuilt from the latents every step,
              plus the shared k_rope [L, rope]
    absorbed: c_KV [L, kv_lora_rank] and k_rope [L, rope], nothing per head
    """
    if mode == "naive":
        return 4 * context * (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) + cfg.qk_rope_head_dim)
    return 4 * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def decode_times(model: Transformer, context: int, rounds: int) -> dict[str, Spread]:
    """Seconds of one decode step in each mode with `context` positions in the latent cache (random
    latents: speed does not depend on their values, and this skips a long prefill). The two modes
    take turns (course/measure.py), so a burst of other work on the machine hits both alike."""
    cache = model.new_cache(context + 1)
    rng = np.random.default_rng(context)
    cache.c_kv[:] = rng.standard_normal(cache.c_kv.shape, dtype=np.float32)
    cache.k_rope[:] = rng.standard_normal(cache.k_rope.shape, dtype=np.float32)
    runs = {mode: model.with_options(mla_mode=mode) for mode in ("naive", "absorbed")}     # same weights

    def step(mode):
        cache.length = context
        runs[mode].decode(1, cache)
    return interleaved({mode: lambda mode=mode: step(mode) for mode in runs}, rounds, warmup=False)   # warm already


def truncate_latent(mla_config: ModelConfig, tensors: dict[str, np.ndarray], rank: int):
    """The rank-`rank` model from a full-rank conversion: the SVD orders directions by singular value,
    so keeping the first `rank` rows of W_DKV and columns of W_UV is `convert_to_mla(..., rank)`."""
    r_full, out = mla_config.kv_lora_rank, dict(tensors)
    for i in range(mla_config.n_layers):
        p = f"model.layers.{i}.self_attn."
        w_a = tensors[p + "kv_a_proj_with_mqa.weight"]                       # [r_full + rope, dim]
        out[p + "kv_a_proj_with_mqa.weight"] = np.concatenate([w_a[:rank], w_a[r_full:]])   # [rank + rope, dim]
        out[p + "kv_b_proj.weight"] = tensors[p + "kv_b_proj.weight"][:, :rank]             # [H * hd, rank]
    return mla_config.replace(kv_lora_rank=rank), out
# ---------------------------------------------------------------------------------------------------


def first_layers(config: ModelConfig, tensors: dict, n: int):
    """The model cut to its first n layers (a quick smoke run converts only those)."""
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    return config.replace(n_layers=n), keep


def main():
    small = quick()

    # 1. A DeepSeek-V3-shaped model with random weights: naive and absorbed give the same numbers.
    cfg = deepseek_shaped(n_layers=2 if small else 4)
    model = Transformer(cfg, random_mla_tensors(cfg))
    install(thread_policy(model))      # BLAS threads measured for this model, as minillm.load does: two threads
                                       # beside a busy neighbour can make a decode step many times slower
    print(f"model: random weights, DeepSeek-V3 attention at 1/8 width: {cfg.n_layers} layers, dim {cfg.dim}, "
          f"{cfg.n_heads} heads, kv_lora_rank {cfg.kv_lora_rank}, rope {cfg.qk_rope_head_dim}, "
          f"q/k {cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim}, v {cfg.v_head_dim}")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 16 if small else 48).tolist()
    logits, stepped = {}, {}
    for mode in ("naive", "absorbed"):
        run = model.with_options(mla_mode=mode)                                         # NEW: same weights
        logits[mode] = run.prefill(ids, run.new_cache(len(ids)), all_logits=True)       # [T, vocab]
        cache = run.new_cache(len(ids))
        run.prefill(ids[:4], cache)
        stepped[mode] = np.stack([run.decode(t, cache) for t in ids[4:]])              # [T - 4, vocab]
    prefill_diff = float(np.abs(logits["naive"] - logits["absorbed"]).max())
    decode_diff = float(np.abs(stepped["naive"] - stepped["absorbed"]).max())
    scale = float(np.abs(logits["naive"]).max())

    contexts = [64] if small else [256, 1024, 4096]
    timing, rounds, load_start = [], 1 if small else 3, load_average()
    for context in contexts:
        spreads = decode_times(model, context, rounds)
        naive, absorbed = spreads["naive"], spreads["absorbed"]
        timing.append([f"{context:,}", f"{working_set_bytes(cfg, context, 'naive') / 1e6:.2f}",
                       f"{working_set_bytes(cfg, context, 'absorbed') / 1e6:.2f}", naive.ms(),
                       absorbed.ms(), f"{naive.median / absorbed.median:.1f}x"])

    # 2. Cache bytes per token against the same heads with K and V cached per head (fp16).
    def per_head_bytes(c: ModelConfig, kv_heads: int) -> int:
        return 2 * c.n_layers * kv_heads * (c.head_dim + c.v_head_dim)     # K (nope + rope) and V per head

    v3 = ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                     attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128)
    sizes = []
    for name, c in (("this model", cfg), ("DeepSeek-V3 (61 layers)", v3)):
        heads = f"K {c.head_dim} + V {c.v_head_dim} per head"
        for label, n_kv in (("MHA", c.n_heads), ("GQA, 8 KV heads", 8)):
            b = per_head_bytes(c, n_kv)
            sizes.append([f"{name}: {label}", c.n_layers, f"{b // c.n_layers:,}", f"{b:,}", f"{n_kv} x ({heads})"])
        mla = c.kv_bytes_per_token(2)
        sizes.append([f"{name}: MLA", c.n_layers, f"{mla // c.n_layers:,}", f"{mla:,}",
                      f"c_KV {c.kv_lora_rank} + k_rope {c.qk_rope_head_dim}: "
                      f"{per_head_bytes(c, c.n_heads) / mla:.0f}x less than MHA"])
    measured = model.new_cache(1000).nbytes / 1000
    sizes.append(["this model's MLACache, measured (fp32)", cfg.n_layers, f"{measured / cfg.n_layers:,.0f}",
                  f"{measured:,.0f}", "= 2 x the fp16 MLA row"])

    # 3. SmolLM2 (GQA) -> MLA by SVD of the weights: the quality each rank keeps.
    llm = lesson_model()
    config, tensors = llm.config, hf_tensors(llm.model)
    if small:       # the smoke run converts two layers: the numbers mean nothing, the code path runs
        config, tensors = first_layers(config, tensors, 2)
        llm = LLM(config, Transformer(config, tensors), llm.tokenizer, name=llm.name)
    text = eval_text(600 if small else 2500)
    context, n_tokens = (32, 64) if small else (128, 256)
    base = perplexity(llm, text, context=context, max_tokens=n_tokens)
    ref_logits = llm.logits(llm.prompt_ids(text, chat=False)[:context])                 # [context, vocab]
    full_rank = min(config.n_kv_heads * config.head_dim, config.dim)
    ranks = ([full_rank, full_rank // 4] if small else
             [full_rank, 7 * full_rank // 8, full_rank // 2, full_rank // 4])
    key_ranks = [config.n_kv_heads] if small else [config.n_kv_heads, 1]  # 1: one RoPE key head, shared
    curve = [["GQA, as trained", "-", "-", f"{config.kv_bytes_per_token(2):,}", "100%", f"{base.ppl:.2f}",
              "0", "100%"]]
    points = []
    for key_rank in key_ranks:
        mla_config, mla_tensors = convert_to_mla(config, tensors, full_rank, key_rank)    # the SVDs, once
        for rank in ranks if key_rank == config.n_kv_heads else ranks[::2]:
            c, t = truncate_latent(mla_config, mla_tensors, rank)
            mla = LLM(c, Transformer(c, t), llm.tokenizer, name=f"mla-{rank}")
            result = perplexity(mla, text, context=context, max_tokens=n_tokens)
            got = mla.logits(llm.prompt_ids(text, chat=False)[:context])
            points.append((key_rank, c.kv_bytes_per_token(2) / config.kv_bytes_per_token(2), result.ppl))
            curve.append(["MLA by SVD", rank, key_rank, f"{c.kv_bytes_per_token(2):,}",
                          f"{points[-1][1]:.0%}", f"{result.ppl:.2f}", f"{np.abs(got - ref_logits).max():.2g}",
                          f"{np.mean(got.argmax(-1) == ref_logits.argmax(-1)):.0%}"])
    # The shortcut above, checked on two layers: slicing the full-rank SVD = converting at that rank.
    c2, t2 = first_layers(config, tensors, 2)
    sliced = Transformer(*truncate_latent(*convert_to_mla(c2, t2, full_rank), ranks[-1]))
    direct = Transformer(*convert_to_mla(c2, t2, ranks[-1]))
    probe = ids[:8]
    slice_diff = float(np.abs(sliced.prefill(probe, sliced.new_cache(8)) - direct.prefill(probe, direct.new_cache(8))).max())

    print_table("Lesson 06 — naive vs absorbed MLA on the same weights",
                ["check", "value"],
                [["max |naive - absorbed|, prefill logits", f"{prefill_diff:.1e} (logits up to {scale:.1f})"],
                 ["max |naive - absorbed|, decode through the latent cache", f"{decode_diff:.1e}"],
                 [f"max |sliced rank-{ranks[-1]} SVD - convert_to_mla(rank {ranks[-1]})|, 2 layers",
                  f"{slice_diff:.1e}"]])
    print_table("one decode step: naive rebuilds every head's K and V, absorbed reads the latents (per layer)",
                ["context", "naive working set MB", "absorbed MB", "naive ms", "absorbed ms", "speedup"], timing)
    print(f"ms: median (min-max) of {rounds} interleaved rounds; {load_line(load_start)}")
    faster(spreads, "absorbed", "naive", f"at {contexts[-1]:,} positions absorbed MLA decodes faster than naive "
                                         f"(it reads the latents instead of rebuilding every head's K and V)")
    print_table("KV cache per token, fp16", ["attention", "layers", "bytes/token/layer", "bytes/token", "what is cached"],
                sizes)
    print_table(f"SmolLM2 GQA -> MLA by SVD of the weights (no data, no fine-tuning): perplexity on "
                f"{base.n_tokens} tokens of eval_text, windows of {context}",
                ["model", "latent rank r", "key heads r_k", "bytes/token", "vs GQA", "perplexity",
                 f"max |Δ logit| ({context} tok)", "top-1 agree"], curve)
    print("full rank reproduces the model; below it, quality collapses fast: these weight-only SVDs ignore which "
          "directions real activations use (a data-aware factorization, or fine-tuning as DeepSeek trains MLA "
          "from the start, would lose far less).")

    # 4. On a GPU: the absorbed decode on hand-written kernels in one CUDA graph (minillm/cuda/gpu_mla.py) vs the
    #    engine's Transformer on CuPy (cuBLAS, no graph), next to a GQA model of the same weight bytes.
    failed = run_gpu_parts([("MLA decode on the GPU: kernels + CUDA graph vs cuBLAS through CuPy vs a GQA twin, "
                             "DeepSeek-V3 shape", lambda: gpu_mla_decode(2 if small else 8))])

    def draw(ax):
        for key_rank in sorted({k for k, _, _ in points}, reverse=True):
            xs, ys = zip(*[(f, p) for k, f, p in points if k == key_rank])
            ax.plot(np.array(xs) * 100, ys, "o-", label=f"{key_rank} RoPE key head(s) per frequency")
        ax.axhline(base.ppl, color="k", linestyle="--", label="GQA, as trained")
        ax.set_yscale("log"), ax.set_xlabel("KV cache vs GQA (%)"), ax.set_ylabel("perplexity")
        ax.set_title("Lesson 06: GQA -> MLA by weight SVD, quality vs cache size"), ax.legend(), ax.grid(alpha=0.3)
    save_plot("06_mla_svd_curve.png", draw)
    return 1 if failed else 0


def gpu_mla_decode(n_layers: int) -> None:
    """minillm.cuda.dev.mla's benchmark: tok/s, GB/s and % of the copy roofline of the three paths at 128 and
    4096 cached tokens, then one MLA layer's kernels (on the H200, 8 layers: 294 vs 46 (4 layers) vs 329 tok/s)."""
    from minillm.cuda.dev.mla import benchmark
    benchmark(n_layers)
    print("The absorbed attention reads one [c_KV | k_rope] row per position for all 128 heads, so the cache is\n"
          "small; the weights (1.17 GB a layer) set the time, as for GQA. Where MLA still trails its GQA twin is\n"
          "the attention's arithmetic at long contexts: 128 heads x (512 + 576) multiply-adds per key, on fp32\n"
          "FMAs here (lessons/BENCHMARKS.md: what tensor cores would change).")


if __name__ == "__main__":
    sys.exit(main())
