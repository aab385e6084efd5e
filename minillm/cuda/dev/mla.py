"""MLA's decode fast path (cuda/gpu_mla.py, kernels/mla_decode.cu): NumPy references, checks, a benchmark.

    python -m minillm.cuda.dev.mla [--layers 8] [--quick]

1. Each kernel of mla_decode.cu against its NumPy reference below (`ref_*`), then the whole graph-captured
   step against device_model's path (the engine's Transformer on CuPy) and the CPU engine on small random
   MLA models (q_lora or not, YaRN, interleaved RoPE). Exit 1 on any failure.
2. A DeepSeek-V3-shaped random model (dim 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64,
   v_head 128, a dense SwiGLU of 18432, vocab 129280) with `--layers` layers (default 8: every per-layer
   number scales, the LM head is counted once): decode tok/s, GB/s and % of the copy roofline for the fast
   path, for device_model at the same shape, and for a GQA GPUTransformer of the same weight bytes per layer
   (96 q / 8 kv heads, hd 128, same dim, ffn, vocab), at 128 and 4096 cached tokens; then the µs of each
   kernel of one MLA layer (each launched over every layer in turn inside a CUDA graph).

The references (`reference_step`, composed from `ref_*`) also run on the CPU alone: tests/test_gpu_mla.py
checks that they reproduce the CPU engine's MLA decode, so a kernel matching its reference is the model.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from minillm.backend import as_f32
from minillm.cuda.gpu_mla import MLALayer, host_layer
from minillm.model.config import ModelConfig
from minillm.model.layers import rmsnorm, silu
from minillm.model.mla import LATENT_NORM_EPS, mla_rope, softmax_scale

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8,
        "mscale_all_dim": 0.6, "beta_fast": 32, "beta_slow": 1}


# ---- NumPy references, one per kernel --------------------------------------------------------------
def narrow(a, dtype: str) -> np.ndarray:
    from minillm.backend import to_dtype
    return to_dtype(np.asarray(a, np.float32), dtype)


def ref_rope(x: np.ndarray, pos: int, inv_freq: np.ndarray, gain: float, interleave: bool) -> np.ndarray:
    """x [..., rope] -> rotated [..., rope] in the half-split order (mla.rope_part at one position)."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    angle = np.float32(pos) * inv_freq.astype(np.float32)                  # [rope/2], fp32 as rope_tables
    c, s = np.cos(angle) * np.float32(gain), np.sin(angle) * np.float32(gain)
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def ref_kv_append(kv: np.ndarray, gain, r: int, pos: int, inv_freq, rope_gain: float, interleave: bool,
                  cache: np.ndarray, dtype: str) -> None:
    """mla_kv_append: kv [r + rope] fp32 -> cache [capacity, r + rope] (16-bit storage) row pos, in place."""
    c = kv[:r] if gain is None else rmsnorm(kv[None, :r], gain, LATENT_NORM_EPS)[0]
    cache[pos] = narrow(np.concatenate([c, ref_rope(kv[r:], pos, inv_freq, rope_gain, interleave)]), dtype)


def ref_q_absorb(q: np.ndarray, wkv_b: np.ndarray, H: int, nope: int, v: int, r: int, pos: int, inv_freq,
                 rope_gain: float, interleave: bool) -> np.ndarray:
    """mla_q_absorb: q [H * (nope + rope)], wkv_b [H * (nope + v), r] fp32 -> q_cat [H, r + rope]."""
    q = q.reshape(H, -1)                                                    # [H, nope + rope]
    w_uk = wkv_b.reshape(H, nope + v, r)[:, :nope]                          # [H, nope, r]
    latent = np.einsum("hd,hdc->hc", q[:, :nope], w_uk)                     # [H, r]
    return np.concatenate([latent, ref_rope(q[:, nope:], pos, inv_freq, rope_gain, interleave)], axis=-1)


def ref_attention(q_cat: np.ndarray, keys: np.ndarray, r: int, scale: float) -> np.ndarray:
    """mla_attention + mla_combine: q_cat [H, W], keys [L, W] (the cache's first L rows) -> o_lat [H, r]."""
    scores = (q_cat @ keys.T) * scale                                       # [H, L]
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ keys[:, :r]                # [H, r]: the latent is the value


def ref_v_up(o_lat: np.ndarray, wkv_b: np.ndarray, H: int, nope: int, v: int, r: int) -> np.ndarray:
    """mla_v_up: o_lat [H, r] -> o [H * v], o[h, e] = W_UV_h[e] · o_lat[h]."""
    w_uv = wkv_b.reshape(H, nope + v, r)[:, nope:]                          # [H, v, r]
    return np.einsum("hec,hc->he", w_uv, o_lat).reshape(-1)


class HostMLA:
    """A CPU MLA Transformer's weights as the fast path holds them (host_layer: stacked, 16-bit-rounded),
    widened to fp32, with a 16-bit latent cache: what `reference_step` runs."""

    def __init__(self, model, dtype: str = "float16", capacity: int = 64):
        c = self.config = model.config
        self.dtype = dtype
        wide = lambda a: None if a is None else as_f32(a)
        self.layers = [MLALayer(**{k: wide(a) for k, a in vars(host_layer(L, dtype)).items()}) for L in model.layers]
        self.embed, self.lm_head = as_f32(narrow(as_f32(model.embed), dtype)), as_f32(narrow(as_f32(model.lm_head), dtype))
        self.final_norm = as_f32(model.final_norm)
        self.inv_freq, self.rope_gain = mla_rope(c)
        self.scale = softmax_scale(c)
        self.q_in = c.q_lora_rank or c.n_heads * c.head_dim
        self.cache = narrow(np.zeros((c.n_layers, capacity, c.kv_lora_rank + c.qk_rope_head_dim)), dtype)
        self.length = 0


def reference_step(m: HostMLA, token: int) -> np.ndarray:
    """One decode step composed of the kernels' references, in the fast path's order. -> logits [vocab]"""
    c, pos = m.config, m.length
    H, nope, v, r = c.n_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    x = m.embed[token][None].copy()                                         # [1, dim]
    for i, L in enumerate(m.layers):
        first = (rmsnorm(x, L.attn_norm, c.norm_eps) @ L.w_in.T)[0]         # [q_in + r + rope]
        q = first[:m.q_in]
        if L.wq_b is not None:
            q = (rmsnorm(q[None], L.q_norm, LATENT_NORM_EPS) @ L.wq_b.T)[0]  # [H * (nope + rope)]
        ref_kv_append(first[m.q_in:], L.kv_norm, r, pos, m.inv_freq, m.rope_gain, c.rope_interleave, m.cache[i], m.dtype)
        q_cat = ref_q_absorb(q, L.wkv_b, H, nope, v, r, pos, m.inv_freq, m.rope_gain, c.rope_interleave)
        o_lat = ref_attention(q_cat, as_f32(m.cache[i, :pos + 1]), r, m.scale)
        x = x + ref_v_up(o_lat, L.wkv_b, H, nope, v, r)[None] @ L.wo.T
        gu = rmsnorm(x, L.mlp_norm, c.norm_eps) @ L.w_gate_up.T             # [1, 2 ffn]
        x = x + (silu(gu[:, :c.ffn_dim]) * gu[:, c.ffn_dim:]) @ L.w_down.T
    m.length += 1
    return (rmsnorm(x, m.final_norm, c.norm_eps) @ m.lm_head.T)[0]


# ---- small random MLA models (no transformers needed: HF-named tensors made here) --------------------
def small_config(q_lora: bool = True, yarn: bool = False, n_heads: int = 4, r: int = 16, rope: int = 8,
                 nope: int = 16, v: int = 12, interleave: bool = True) -> ModelConfig:
    return ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=n_heads, n_kv_heads=n_heads, ffn_dim=160,
                       attention="mla", q_lora_rank=24 if q_lora else None, kv_lora_rank=r, qk_nope_head_dim=nope,
                       qk_rope_head_dim=rope, v_head_dim=v, rope_interleave=interleave, norm_eps=1e-5,
                       rope_scaling=YARN if yarn else None, max_seq_len=64 if yarn else 256, family="deepseek_v3")


def small_model(config: ModelConfig, dtype: str = "float16", seed: int = 0):
    """A CPU Transformer of `config` with random weights (std 0.1, rounded to `dtype` so every path
    multiplies the same numbers), gains near 1."""
    from minillm.model.transformer import Transformer
    c, rng = config, np.random.default_rng(seed)
    mat = lambda *shape: as_f32(narrow(rng.standard_normal(shape) * 0.1, dtype))
    gain = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    H, qk, r, rope = c.n_heads, c.head_dim, c.kv_lora_rank, c.qk_rope_head_dim
    t = {"model.embed_tokens.weight": mat(c.vocab_size, c.dim), "model.norm.weight": gain(c.dim),
         "lm_head.weight": mat(c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t |= {p + "input_layernorm.weight": gain(c.dim), p + "post_attention_layernorm.weight": gain(c.dim),
              p + "mlp.gate_proj.weight": mat(c.ffn_dim, c.dim), p + "mlp.up_proj.weight": mat(c.ffn_dim, c.dim),
              p + "mlp.down_proj.weight": mat(c.dim, c.ffn_dim),
              a + "kv_a_proj_with_mqa.weight": mat(r + rope, c.dim), a + "kv_a_layernorm.weight": gain(r),
              a + "kv_b_proj.weight": mat(H * (c.qk_nope_head_dim + c.v_head_dim), r),
              a + "o_proj.weight": mat(c.dim, H * c.v_head_dim)}
        if c.q_lora_rank:
            t |= {a + "q_a_proj.weight": mat(c.q_lora_rank, c.dim), a + "q_a_layernorm.weight": gain(c.q_lora_rank),
                  a + "q_b_proj.weight": mat(H * qk, c.q_lora_rank)}
        else:
            t[a + "q_proj.weight"] = mat(H * qk, c.dim)
    return Transformer(c, t)


# ---- GPU checks: each kernel vs its reference -------------------------------------------------------
def _gpu_setup(dtype: str):
    import cupy as cp
    from minillm.cuda.gpu_mla import MLAKernels
    return cp, MLAKernels(dtype)


def check_kv_append(dtype: str, r: int, rope: int, pos: int, interleave: bool, norm: bool, seed: int = 0):
    cp, m = _gpu_setup(dtype)
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal(r + rope).astype(np.float32)
    gain = (1 + 0.1 * rng.standard_normal(r)).astype(np.float32) if norm else None
    inv_freq = (1.0 / 10000 ** (np.arange(0, rope, 2) / rope)).astype(np.float32)
    cache = narrow(rng.standard_normal((pos + 3, r + rope)), dtype)
    want = cache.copy()
    ref_kv_append(kv, gain, r, pos, inv_freq, 1.3, interleave, want, dtype)
    got = cp.asarray(cache)
    m.mla_kv_append(cp.asarray(kv), None if gain is None else cp.asarray(gain), LATENT_NORM_EPS, r, rope,
                    cp.asarray(np.array([pos], np.int32)), cp.asarray(inv_freq), 1.3, interleave, got)
    got = as_f32(cp.asnumpy(got))
    err = float(np.abs(got - as_f32(want)).max() / np.abs(as_f32(want)).max())
    return err, 4e-3 if dtype == "float16" else 1.6e-2      # one 16-bit rounding apart at most


def check_q_absorb(dtype: str, H: int, nope: int, rope: int, v: int, r: int, pos: int, seed: int = 0):
    cp, m = _gpu_setup(dtype)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(H * (nope + rope)).astype(np.float32)
    w = narrow(rng.standard_normal((H * (nope + v), r)) / np.sqrt(nope), dtype)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rope, 2) / rope)).astype(np.float32)
    want = ref_q_absorb(q, as_f32(w), H, nope, v, r, pos, inv_freq, 0.9, True)
    got = cp.full((H, r + rope), np.nan, cp.float32)
    m.mla_q_absorb(cp.asarray(q), cp.asarray(w), H, nope, rope, v, r, cp.asarray(np.array([pos], np.int32)),
                   cp.asarray(inv_freq), 0.9, True, got)
    return _rel(cp.asnumpy(got), want), 1e-5 * np.sqrt(nope) + 1e-6


def check_attention(dtype: str, H: int, r: int, rope: int, L: int, capacity: int, seed: int = 0):
    from minillm.cuda.gpu_mla import n_splits_for
    cp, m = _gpu_setup(dtype)
    rng = np.random.default_rng(seed)
    W = r + rope
    cache = narrow(rng.standard_normal((capacity, W)), dtype)
    q_cat = rng.standard_normal((H, W)).astype(np.float32)
    scale = 1.0 / np.sqrt(W)
    want = ref_attention(q_cat, as_f32(cache[:L]), r, scale)
    S = n_splits_for(H, capacity)
    parts = (cp.zeros((H, S), cp.float32), cp.zeros((H, S), cp.float32), cp.zeros((H, S, r), cp.float32))
    got = cp.full((H, r), np.nan, cp.float32)
    m.mla_attention(cp.asarray(q_cat), cp.asarray(cache), H, r, cp.asarray(np.array([L - 1], np.int32)), scale, parts, got)
    return _rel(cp.asnumpy(got), want), 2e-4


def check_v_up(dtype: str, H: int, nope: int, v: int, r: int, seed: int = 0):
    cp, m = _gpu_setup(dtype)
    rng = np.random.default_rng(seed)
    o_lat = rng.standard_normal((H, r)).astype(np.float32)
    w = narrow(rng.standard_normal((H * (nope + v), r)) / np.sqrt(r), dtype)
    want = ref_v_up(o_lat, as_f32(w), H, nope, v, r)
    got = cp.full(H * v, np.nan, cp.float32)
    m.mla_v_up(cp.asarray(o_lat), cp.asarray(w), H, nope, v, r, got)
    return _rel(cp.asnumpy(got), want), 1e-5 * np.sqrt(r)


def _rel(got, want) -> float:
    from minillm.cuda.dev.common import rel_err
    return rel_err(got, want)


def model_errors(cpu, dtype: str = "float16", n_prompt: int = 12, n_decode: int = 8, seed: int = 1) -> dict:
    """Largest relative logit error of the fast path against the CPU engine and device_model's path: every
    prompt position, then n_decode decode steps. The fast path runs twice: its GEMM prefill (device_model's
    path over its arrays) then the graph, and the graph alone from the first token (prefill by_step).
    -> {"cpu": err, "device_model": err}"""
    from minillm.cuda.device_model import to_device
    from minillm.cuda.dev.common import rel_err
    from minillm.cuda.gpu_mla import GPUMLATransformer
    ids = np.random.default_rng(seed).integers(0, cpu.config.vocab_size, n_prompt + n_decode)
    fast = GPUMLATransformer.from_cpu(cpu, dtype)
    models = {"fast": fast, "steps": fast, "cpu": cpu, "device_model": to_device(cpu, dtype)}
    logits = {}
    for name, model in models.items():
        cache = model.new_cache(32)
        by_step = {"by_step": True} if name == "steps" else {}
        rows = [model.prefill(ids[:n_prompt], cache, all_logits=True, **by_step)]
        rows += [model.decode(int(t), cache)[None] for t in ids[n_prompt:]]
        logits[name] = np.concatenate(rows)
    return {f"{a} vs {b}": rel_err(logits[a], logits[b]) for a in ("fast", "steps") for b in ("cpu", "device_model")}


def run_checks(quick: bool = False) -> None:
    from minillm.cuda.dev.common import say, verdict, guarded
    from minillm.cuda.dev.model import MODEL_TOL
    say("mla_decode.cu kernels vs NumPy references")
    cases = []
    for dtype in ("float16", "bfloat16"):
        s = "fp16" if dtype == "float16" else "bf16"
        cases += [(f"{s} kv_append r16+8 pos 5 interleave", lambda d=dtype: check_kv_append(d, 16, 8, 5, True, True)),
                  (f"{s} kv_append r512+64 pos 300 half-split", lambda d=dtype: check_kv_append(d, 512, 64, 300, False, True)),
                  (f"{s} kv_append r64+8 no norm", lambda d=dtype: check_kv_append(d, 64, 8, 7, True, False)),
                  (f"{s} q_absorb H4 nope16 r16", lambda d=dtype: check_q_absorb(d, 4, 16, 8, 12, 16, 3)),
                  (f"{s} q_absorb H128 nope128 r512", lambda d=dtype: check_q_absorb(d, 128, 128, 64, 128, 512, 77)),
                  (f"{s} q_absorb nope0 r24", lambda d=dtype: check_q_absorb(d, 3, 0, 8, 8, 24, 1)),
                  (f"{s} attention H4 r16 L1", lambda d=dtype: check_attention(d, 4, 16, 8, 1, 32)),
                  (f"{s} attention H20 r64 L45", lambda d=dtype: check_attention(d, 20, 64, 8, 45, 64)),
                  (f"{s} attention H128 r512 L129", lambda d=dtype: check_attention(d, 128, 512, 64, 129, 256)),
                  (f"{s} attention H128 r512 L4000", lambda d=dtype: check_attention(d, 128, 512, 64, 4000, 4096)),
                  (f"{s} v_up H4 v12 r16", lambda d=dtype: check_v_up(d, 4, 16, 12, 16)),
                  (f"{s} v_up H128 v128 r512", lambda d=dtype: check_v_up(d, 128, 128, 128, 512))]
    for name, run in cases[::2] if quick else cases:
        def one(run=run, name=name):
            err, tol = run()
            verdict(name, err <= tol, f"err {err:.2e}  tol {tol:.1e}")
        guarded(name, one)
    say("\nthe graph-captured step vs the CPU engine and device_model (logits, prompt + decode)")
    configs = {"q-lora": small_config(), "no-q-lora": small_config(q_lora=False), "yarn": small_config(yarn=True),
               "half-split H20 r64": small_config(n_heads=20, r=64, interleave=False)}
    for name, cfg in configs.items():
        for dtype in ("float16", "bfloat16"):
            label = f"{'fp16' if dtype == 'float16' else 'bf16'} model {name}"

            def one(cfg=cfg, dtype=dtype, label=label):
                errs = model_errors(small_model(cfg, dtype), dtype)
                tol = MODEL_TOL[dtype]
                verdict(label, max(errs.values()) <= tol,
                        "  ".join(f"{k} {e:.1e}" for k, e in errs.items()) + f"  tol {tol:.0e}")
            guarded(label, one)


# ---- the benchmark ---------------------------------------------------------------------------------
def deepseek_v3(n_layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=129280, dim=7168, n_layers=n_layers, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                       attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                       v_head_dim=128, rope_interleave=True, norm_eps=1e-6, max_seq_len=8192, family="deepseek_v3")


def gqa_twin(c: ModelConfig) -> ModelConfig:
    """A GQA config of the same weight bytes per token: same dim, ffn, vocab and layers, and attention
    matrices of the same size. MLA's at DeepSeek-V3's shape are 374 MB a layer (q_a|kv_a 30, q_b 75, kv_b 34,
    o 235); q|k|v|o of 96 q / 8 kv heads of 128 over 7168 are (2·96 + 2·8)·128·7168·2 B = 381 MB."""
    return ModelConfig(vocab_size=c.vocab_size, dim=c.dim, n_layers=c.n_layers, n_heads=96, n_kv_heads=8,
                       head_dim=128, ffn_dim=c.ffn_dim, norm_eps=c.norm_eps, max_seq_len=c.max_seq_len)


def device_model_random(c: ModelConfig):
    """device_model's path (the engine's Transformer on CuPy) at config c, its weights made on the device
    (fp16, uniform, variance 1/fan_in): no host copy of a DeepSeek-sized model."""
    import cupy as cp
    from minillm.cuda.kernels import Kernels
    from minillm.model.transformer import Transformer
    kern, n = Kernels("float16"), [0]

    def dense(rows, cols):
        w = cp.empty((rows, cols), cp.float16)
        n[0] += 1
        kern.fill_uniform(w, 5000 + n[0], (3.0 / cols) ** 0.5)
        return w

    ones = lambda k: cp.ones(k, cp.float32)
    H, qk, r, rope = c.n_heads, c.head_dim, c.kv_lora_rank, c.qk_rope_head_dim
    t = {"model.embed_tokens.weight": dense(c.vocab_size, c.dim), "model.norm.weight": ones(c.dim),
         "lm_head.weight": dense(c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t |= {p + "input_layernorm.weight": ones(c.dim), p + "post_attention_layernorm.weight": ones(c.dim),
              p + "mlp.gate_proj.weight": dense(c.ffn_dim, c.dim), p + "mlp.up_proj.weight": dense(c.ffn_dim, c.dim),
              p + "mlp.down_proj.weight": dense(c.dim, c.ffn_dim),
              a + "q_a_proj.weight": dense(c.q_lora_rank, c.dim), a + "q_a_layernorm.weight": ones(c.q_lora_rank),
              a + "q_b_proj.weight": dense(H * qk, c.q_lora_rank),
              a + "kv_a_proj_with_mqa.weight": dense(r + rope, c.dim), a + "kv_a_layernorm.weight": ones(r),
              a + "kv_b_proj.weight": dense(H * (c.qk_nope_head_dim + c.v_head_dim), r),
              a + "o_proj.weight": dense(c.dim, H * c.v_head_dim)}
    model = Transformer(c, t, mla_mode="naive-prefill")     # CuPy arrays: no fusion (separate gate and up)
    model.inv_freq = cp.asarray(model.inv_freq)
    model.cache_dtype, model.dtype = cp.float16, "float16"
    cp.cuda.Device().synchronize()
    return model


def _decode_ms(model, ctx: int, fast: bool) -> float:
    """ms per decode token at `ctx` cached positions (the cache's contents do not matter for speed)."""
    from minillm.cuda.timing import time_gpu
    cache = model.new_cache(ctx + 8)
    cache.length = ctx
    if fast:                                         # graph replays on the model's stream
        with model.stream:
            model.step.set(np.array([1, ctx], dtype=np.int32))
            graph = model._graph_for(cache)
            return time_gpu(lambda: graph.launch(model.stream), reps=10)
    import time
    model.decode(1, cache)                            # device_model: host-driven, time the whole call
    cache.length = ctx
    t0 = time.perf_counter()
    for _ in range(3):
        model.decode(1, cache)
        cache.length = ctx
    return (time.perf_counter() - t0) / 3 * 1e3


def benchmark(n_layers: int) -> None:
    import cupy as cp
    from minillm.cuda.dev.common import plain_table, say
    from minillm.cuda.timing import copy_bandwidth
    from minillm.cuda.device_model import weight_bytes as dm_weight_bytes
    from minillm.cuda.gpu_mla import GPUMLATransformer
    from minillm.cuda.gpu_model import GPUTransformer
    bw = copy_bandwidth(1 << 30)
    cfg = deepseek_v3(n_layers)
    say(f"\nDeepSeek-V3 shape, {n_layers} layers (dense MLP), fp16; copy roofline {bw / 1e9:.0f} GB/s")
    rows = []
    W = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    ctxs = (128, 4096)

    def add(name, model, nbytes, kv_bytes_per_pos, fast):
        for ctx in ctxs:
            ms = _decode_ms(model, ctx, fast)
            moved = nbytes + kv_bytes_per_pos * ctx
            rows.append((name, ctx, f"{nbytes / 1e9:.2f}", f"{1e3 / ms:.1f}", f"{ms:.2f}",
                         f"{moved / ms / 1e6:.0f}", f"{100 * moved / (ms * 1e-3) / bw:.0f}%"))

    fast = GPUMLATransformer.random(cfg)
    add("MLA fast path (graph)", fast, fast.weight_bytes, n_layers * W * 2, True)
    per_kernel(fast, bw)
    del fast
    cp.get_default_memory_pool().free_all_blocks()
    dm_layers = min(n_layers, 4)                     # device_model: fp32 temporaries per matmul; per layer scales
    dm = device_model_random(deepseek_v3(dm_layers))
    nb = dm_weight_bytes(dm)
    for ctx in ctxs:
        ms = _decode_ms(dm, ctx, False)
        moved = nb + dm_layers * W * 2 * ctx
        rows.append((f"device_model ({dm_layers} layers)", ctx, f"{nb / 1e9:.2f}", f"{1e3 / ms:.1f}", f"{ms:.2f}",
                     f"{moved / ms / 1e6:.0f}", f"{100 * moved / (ms * 1e-3) / bw:.0f}%"))
    del dm
    cp.get_default_memory_pool().free_all_blocks()
    g = gqa_twin(cfg)
    gqa = GPUTransformer.random(g)
    add("GQA 96q/8kv GPUTransformer", gqa, gqa.weight_bytes, n_layers * 2 * g.n_kv_heads * g.head_dim * 2, True)
    plain_table("decode (tok/s of this layer count; GB/s = weights + cache read per token / step time)",
                ["path", "ctx", "weights GB", "tok/s", "ms/token", "GB/s", "% copy"], rows)


def per_kernel(fast, bw: float) -> None:
    """µs of each launch of one MLA layer, each kind over every layer in turn inside a graph (ctx 128)."""
    import cupy as cp
    from minillm.cuda.dev.common import plain_table
    from minillm.cuda.timing import graph_us
    c, k, m = fast.config, fast.k, fast.k
    H, nope, rope, v, r = c.n_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    ctx = 128
    cache = fast.new_cache(ctx + 8)
    fast.step.set(np.array([1, ctx], dtype=np.int32))
    parts = fast._decode_parts(cache)
    cp.cuda.Device().synchronize()
    Ls, x, pos = fast.layers, fast.x[0], fast.step_pos
    runs = {
        "q_a|kv_a GEMV+norm": (lambda i: k.gemv_rmsnorm(Ls[i].w_in, x, Ls[i].attn_norm, 1e-6, fast.first),
                               lambda L: L.w_in.nbytes),
        "q_b GEMV+norm": (lambda i: k.gemv_rmsnorm(Ls[i].wq_b, fast.first[:fast.q_in], Ls[i].q_norm, 1e-6, fast.q),
                          lambda L: L.wq_b.nbytes),
        "kv_append": (lambda i: m.mla_kv_append(fast.kv, Ls[i].kv_norm, 1e-6, r, rope, pos, fast.inv_freq, 1.0, True,
                                            cache.latent[i]), lambda L: 0),
        "q_absorb (W_UK)": (lambda i: m.mla_q_absorb(fast.q, Ls[i].wkv_b, H, nope, rope, v, r, pos, fast.inv_freq, 1.0,
                                                 True, fast.q_cat), lambda L: L.wkv_b.nbytes * nope // (nope + v)),
        "attention+combine": (lambda i: m.mla_attention(fast.q_cat, cache.latent[i], H, r, pos, fast.scale, parts,
                                                    fast.o_lat), lambda L: (ctx + 1) * (r + rope) * 2),
        "v_up (W_UV)": (lambda i: m.mla_v_up(fast.o_lat, Ls[i].wkv_b, H, nope, v, r, fast.o),
                        lambda L: L.wkv_b.nbytes * v // (nope + v)),
        "o GEMV+residual": (lambda i: k.gemv(Ls[i].wo, fast.o, x, True), lambda L: L.wo.nbytes),
        "gate_up GEMV+swiglu": (lambda i: k.gemv_swiglu(Ls[i].w_gate_up, x, Ls[i].mlp_norm, 1e-6, fast.act),
                                lambda L: L.w_gate_up.nbytes),
        "down GEMV+residual": (lambda i: k.gemv(Ls[i].w_down, fast.act, x, True), lambda L: L.w_down.nbytes),
    }
    rows, total = [], 0.0
    for name, (run, nbytes) in runs.items():
        us = graph_us(run, len(Ls))
        total += us
        b = nbytes(Ls[0])
        rows.append((name, f"{b / 1e6:.1f}", f"{us:.1f}", f"{100 * b / (us * 1e-6) / bw:.0f}%" if b else ""))
    rows.append(("one layer", f"{sum(L.nbytes for L in Ls[0].matrices()) / 1e6:.1f}", f"{total:.1f}", ""))
    plain_table(f"one MLA layer's kernels at {ctx} cached tokens (µs a launch, gaps included, in a graph)",
                ["kernel", "MB read", "µs", "% copy"], rows)


def main(argv=None) -> int:
    from minillm.cuda.dev.common import finish, require_gpu
    p = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.mla", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="layers of the DeepSeek-V3-shaped model (default 8)")
    p.add_argument("--quick", action="store_true", help="every other kernel check")
    p.add_argument("--no-bench", action="store_true", help="checks only")
    args = p.parse_args(argv)
    if args.layers < 1:
        print("python -m minillm.cuda.dev.mla: --layers must be >= 1", file=sys.stderr)
        return 2
    if not require_gpu("python -m minillm.cuda.dev.mla"):
        return 1
    run_checks(args.quick)
    if not args.no_bench:
        benchmark(args.layers)
    return finish("python -m minillm.cuda.dev.mla")


if __name__ == "__main__":
    sys.exit(main())
