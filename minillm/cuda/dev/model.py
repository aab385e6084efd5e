"""The GPU model against the CPU model on small random models: logits (every prefill position and
teacher-forced decode), greedy continuations, CUDA-graph replay == eager launches.

`random_cpu_model` rounds its weights to the GPU's dtype first, so both sides multiply the same numbers;
`small_config` names the shapes the tests and the selfcheck use. `cases` is the selfcheck's list.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.cuda.dev.common import SHORT, guarded, narrow, rel_err, say, verdict
from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer


def small_config(kind: str = "gqa", **changes) -> ModelConfig:
    """Small random-model shapes: "gqa", "mha", "mqa", "tied", "mistral" (sliding window 6), "hd64"."""
    base = dict(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=256,
                norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128)
    base |= {"gqa": {}, "mha": dict(n_kv_heads=8), "mqa": dict(n_kv_heads=1),
             "tied": dict(tie_embeddings=True, n_layers=3),
             "mistral": dict(family="mistral", sliding_window=6),
             "hd64": dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512),
             "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32})}[kind]
    return ModelConfig(**(base | changes))


def random_cpu_model(config: ModelConfig, dtype: str = "float16", seed: int = 0, quant: str | None = None,
                     group_size: int = 128) -> Transformer:
    """A CPU Transformer with random weights already rounded to `dtype`, so the CPU and the GPU
    multiply the same numbers (norm gains stay fp32, as the GPU keeps them). quant: the layer
    matrices then quantized by minillm.model.quant (int8 / int4 in groups of `group_size`), as load() does."""
    rng = np.random.default_rng(seed)
    c, hd = config, config.head_dim
    mat = lambda rows, cols: narrow(rng.standard_normal((rows, cols)) / math.sqrt(cols), dtype)
    gain = lambda: (1 + 0.1 * rng.standard_normal(c.dim)).astype(np.float32)
    t = {"model.embed_tokens.weight": narrow(rng.standard_normal((c.vocab_size, c.dim)), dtype),
         "model.norm.weight": gain()}
    if not c.tie_embeddings:
        t["lm_head.weight"] = mat(c.vocab_size, c.dim)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": gain(), p + "post_attention_layernorm.weight": gain(),
              p + "self_attn.q_proj.weight": mat(c.n_heads * hd, c.dim),
              p + "self_attn.k_proj.weight": mat(c.n_kv_heads * hd, c.dim),
              p + "self_attn.v_proj.weight": mat(c.n_kv_heads * hd, c.dim),
              p + "self_attn.o_proj.weight": mat(c.dim, c.n_heads * hd),
              p + "mlp.gate_proj.weight": mat(c.ffn_dim, c.dim),
              p + "mlp.up_proj.weight": mat(c.ffn_dim, c.dim),
              p + "mlp.down_proj.weight": mat(c.dim, c.ffn_dim)}
    if quant is not None:
        config, t = quantize_checkpoint(config, t, quant, group_size)
    return Transformer(config, t)


# Model-level tolerance, relative to the largest |logit|: the GPU narrows activations to 16 bits before
# each prefill GEMM and keeps K/V in 16 bits; the CPU does neither.
MODEL_TOL = {"float16": 5e-3, "bfloat16": 3e-2}     # seen in a CPU emulation: 6e-4 and 4e-3


def _with_kv_cache(cpu: Transformer, kv_cache: str) -> tuple[Transformer, dict]:
    """The CPU model with the cache kind the GPU is given (a copy sharing the weights), and the
    GPUTransformer keyword arguments for it."""
    return cpu.with_options(kv_cache=kv_cache), {"kv_cache": kv_cache}


def gpu_model(cpu, dtype: str, fuse_norm: bool = True, gemv_version: int = 4, settings: dict | None = None, **options):
    """GPUTransformer.from_cpu(cpu, dtype, **options): the shipped model, or the lab's around it (lab.py) for an
    earlier decode step (gemv_version 2, fuse_norm off) or settings that are the lab's."""
    from dataclasses import fields

    from minillm.cuda.dev.lab import LabTransformer
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.cuda.kernels import KernelSettings
    gpu = GPUTransformer.from_cpu(cpu, dtype, **options)
    settings = settings or {}
    if gemv_version >= 4 and fuse_norm and set(settings) <= {f.name for f in fields(KernelSettings)}:
        return gpu.with_settings(**settings)
    return LabTransformer.of(gpu, gemv_version, fuse_norm, **settings)


def check_model_logits(kind: str, dtype: str, n_prompt: int = 12, n_decode: int = 20, seed: int = 0,
                       fuse_norm: bool = True, gemv_version: int = 4, prefill_attention: str = "tiled",
                       quant: str | None = None, group_size: int = 128, cpu=None, kv_cache: str = "auto",
                       settings: dict | None = None):
    """Prefill logits (all positions) and teacher-forced decode logits, GPU vs CPU.
    prefill_attention: "tiled" (prefill_attention.cu) or "decode" (the decode kernel, one query a token).
    quant: int8/int4 layer matrices, the same on both sides. cpu: a CPU model to use instead of a
    random one of `kind`'s shape. kv_cache "int8": both sides quantize keys and values (Int8KVCache).
    settings: KernelSettings or LabSettings changes for the GPU side (e.g. the TMA-streamed GEMVs);
    gemv_version 2 or fuse_norm off: the lab's earlier decode steps."""
    cpu = cpu or random_cpu_model(small_config(kind), dtype, seed, quant, group_size)
    cfg = cpu.config
    cpu, kv = _with_kv_cache(cpu, kv_cache)
    gpu = gpu_model(cpu, dtype, fuse_norm, gemv_version, settings, prefill_attention=prefill_attention, **kv)
    ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, n_prompt + n_decode)
    err = rel_err(gpu.prefill(ids[:n_prompt], gpu.new_cache(64), all_logits=True),
                  cpu.prefill(ids[:n_prompt], cpu.new_cache(64), all_logits=True))
    cc, gc = cpu.new_cache(64), gpu.new_cache(64)
    err = max(err, rel_err(gpu.prefill(ids[:n_prompt], gc), cpu.prefill(ids[:n_prompt], cc)))
    for t in ids[n_prompt:]:
        err = max(err, rel_err(gpu.decode(int(t), gc), cpu.decode(int(t), cc)))
    return err, MODEL_TOL[dtype]


def greedy(model, prompt, n: int, cache) -> tuple[list[int], list[np.ndarray]]:
    logits = model.prefill(prompt, cache)
    tokens, all_logits = [], []
    for _ in range(n):
        all_logits.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = model.decode(tokens[-1], cache)
    return tokens, all_logits


def check_greedy(kind: str, dtype: str, n: int = 16, seed: int = 0, fuse_norm: bool = True, gemv_version: int = 4,
                 quant: str | None = None, group_size: int = 128, cpu=None, prompt=None, kv_cache: str = "auto"):
    """Greedy continuations, GPU vs CPU. Returns (tokens equal, detail). A divergence is accepted only
    at a near-tie: where the CPU's top two logits are closer than the logits' measured error.
    cpu, prompt: a given CPU model and prompt instead of random ones of `kind`'s shape."""
    cpu = cpu or random_cpu_model(small_config(kind), dtype, seed, quant, group_size)
    cfg = cpu.config
    cpu, kv = _with_kv_cache(cpu, kv_cache)
    gpu = gpu_model(cpu, dtype, fuse_norm, gemv_version, **kv)
    if prompt is None:
        prompt = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, 8)
    want, cpu_logits = greedy(cpu, prompt, n, cpu.new_cache(64))
    got, gpu_logits = greedy(gpu, prompt, n, gpu.new_cache(64))
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            top2 = np.sort(cpu_logits[i])[-2:]
            margin, err = float(top2[1] - top2[0]), float(np.abs(cpu_logits[i] - gpu_logits[i]).max())
            return margin < 2 * err, f"diverged at token {i}: cpu {a} gpu {b}, top-2 margin {margin:.2e}, " \
                                     f"logit error {err:.2e}"
    return True, f"{n} tokens equal"


def check_graph_equals_eager(kind: str, dtype: str, n: int = 24, seed: int = 0, fuse_norm: bool = True,
                             gemv_version: int = 4, quant: str | None = None, group_size: int = 128,
                             kv_cache: str = "auto", settings: dict | None = None):
    """The same prompt and tokens through eager launches and through the replayed CUDA graph:
    the same kernels in the same order, so the logits must be bit-identical."""
    cfg = small_config(kind)
    gpu = gpu_model(random_cpu_model(cfg, dtype, seed, quant, group_size), dtype, fuse_norm, gemv_version, settings,
                    kv_cache=kv_cache)
    ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, 8 + n)
    runs = []
    for use_graph in (False, True):
        run = gpu.with_options(use_graph=use_graph)
        cache = run.new_cache(64)
        out = [run.prefill(ids[:8], cache)] + [run.decode(int(t), cache) for t in ids[8:]]
        runs.append(np.stack(out))
    same = bool(np.array_equal(runs[0], runs[1]))
    return same, "bit-identical" if same else f"max diff {np.abs(runs[0] - runs[1]).max():.3e}"


def model_checks(quick: bool) -> None:
    say("small random models, GPU vs CPU (same 16-bit weights on both)")
    kinds = ["gqa", "mistral"] if quick else ["gqa", "mha", "mqa", "tied", "mistral", "hd64", "llama3"]
    variants = [(4, True, ""), (4, False, " v4 unfused-norm"), (2, False, " v2"), (2, True, " v2+v3 fused-norm")]
    for dtype in ("float16", "bfloat16"):
        for kind in kinds:
            for version, fuse, tag in variants:
                if version == 2 and kind not in ("gqa", "mistral", "tied"):
                    continue                       # the old path: a few kinds are enough
                label = f"{SHORT[dtype]} logits {kind}{tag}"

                def one(kind=kind, dtype=dtype, label=label, fuse=fuse, version=version):
                    err, tol = check_model_logits(kind, dtype, fuse_norm=fuse, gemv_version=version)
                    verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
                guarded(label, one)
        for kind in ("gqa", "mistral"):
            for quant in ("int8", "int4"):
                label = f"{SHORT[dtype]} logits {kind} {quant} weights"

                def q(kind=kind, dtype=dtype, label=label, quant=quant):
                    err, tol = check_model_logits(kind, dtype, fuse_norm=True, quant=quant)
                    verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
                guarded(label, q)
        for kind in ("gqa", "mistral"):
            label = f"{SHORT[dtype]} logits {kind} old prefill attention"

            def old_pf(kind=kind, dtype=dtype, label=label):
                err, tol = check_model_logits(kind, dtype, prefill_attention="decode")
                verdict(label, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
            guarded(label, old_pf)
    for kind in ["gqa", "mistral"]:
        for version, fuse, tag in [(4, True, ""), (2, False, " v2")]:
            label = f"fp16 greedy 16 tokens {kind}{tag}"

            def one(kind=kind, label=label, fuse=fuse, version=version):
                same, detail = check_greedy(kind, "float16", fuse_norm=fuse, gemv_version=version)
                verdict(label, same, detail)
            guarded(label, one)
        for version, fuse, tag in variants:
            label = f"fp16 graph replay == eager {kind}{tag}"

            def two(kind=kind, label=label, fuse=fuse, version=version):
                same, detail = check_graph_equals_eager(kind, "float16", fuse_norm=fuse, gemv_version=version)
                verdict(label, same, detail)
            guarded(label, two)
