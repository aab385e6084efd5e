"""The small pieces of a Llama block: RMSNorm, rotary position embedding, SwiGLU, linear.

Every function takes and returns fp32 arrays, NumPy or CuPy (backend.array_module); weights may be
stored narrower and are widened here, a block of rows at a time on the host (see
backend.matmul_widening), or quantized (see quant.py, host only).
"""
from __future__ import annotations

import math

import numpy as np

from minillm.backend import array_module, as_f32, matmul_widening
from minillm.model.quant import QuantizedWeight


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x²) + eps) * weight, over the last axis.    x: [T, dim]"""
    mean_square = np.square(x).sum(axis=-1, keepdims=True) * (1.0 / x.shape[-1])   # [T, 1]
    inv_rms = 1.0 / np.sqrt(mean_square + eps)                             # [T, 1]
    out = x * inv_rms                                                      # [T, dim]
    out *= as_f32(weight)                                                  # in place: one [T, dim] array, not two
    return out


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ Wᵀ (+ b) with W in HF's [out, in] layout.    x: [T, in] -> [T, out]; bias: [out] or None

    At decode (T = 1) this is a matrix-vector product that reads every byte of W once: almost all
    decode time is spent here, bound by memory bandwidth, not arithmetic. A quantized W (int8,
    int4: quant.py) is widened to fp32 a block of rows at a time inside its own matmul.
    """
    y = _matmul(x, weight)                                         # [T, out], a new array
    if bias is not None:                                           # Qwen2's q/k/v, Llama's attention_bias / mlp_bias
        y += as_f32(bias)                                          # [T, out] + [out]
    return y


def _matmul(x: np.ndarray, weight) -> np.ndarray:
    if isinstance(weight, QuantizedWeight):
        return weight.matmul(x)
    if weight.dtype != np.float32:
        if array_module(x) is not np:                              # the device: cuBLAS on the widened copy
            return x @ as_f32(weight).T
        return matmul_widening(x, weight)                          # bf16/fp16 storage: a block at a time
    if 1 < x.shape[0] <= SMALL_M and array_module(x) is np:
        return small_m_matmul(x, weight)                           # a verify pass, a small batch: not sgemm
    return x @ weight.T


# Rows up to which `small_m_matmul` beats `x @ W.T` on the CPU (OpenBLAS, one thread, measured below).
SMALL_M = 16
SMALL_M_BLOCK_BYTES = 256 << 10       # fp32 bytes of W per block: stays in L2 (1 MB a core here) for all T rows


def small_m_matmul(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x @ Wᵀ for a few rows x (2..SMALL_M), as (W_block @ xᵀ)ᵀ over blocks of W's rows.   x: [T, in] -> [T, out]

    OpenBLAS's sgemm is far slower for a small M than its GEMV (on SmolLM2's matrices, ten times one
    row's time for two rows). Swapping the operands (W @ xᵀ) and doing it a block of ~256 KB of W at a
    time, so the block is still in cache for every row, makes verifying k drafted tokens cost about
    one decode step (lessons/BENCHMARKS.md, "Speculative decoding")."""
    rows = max(16, SMALL_M_BLOCK_BYTES // (4 * weight.shape[1]))
    xt = np.ascontiguousarray(x.T)                                  # [in, T]
    y = np.empty((weight.shape[0], x.shape[0]), dtype=np.float32)   # [out, T]
    for start in range(0, weight.shape[0], rows):
        np.matmul(weight[start:start + rows], xt, out=y[start:start + rows])
    return y.T                                                      # [T, out] (a transposed view)


def silu(x: np.ndarray) -> np.ndarray:
    """x · sigmoid(x) = x / (1 + exp(-x)), elementwise.

    At prefill x is [T, ffn_dim] (SmolLM2, 512 tokens: 0.8 M values a layer): written into one
    buffer instead of four temporaries, 20% faster; the same numbers."""
    xp = array_module(x)
    x = xp.asarray(x)
    out = xp.negative(x, out=xp.empty(x.shape, dtype=np.result_type(x.dtype, 1.0)))   # x's float type, as x / 1.0
    xp.exp(out, out=out)
    out += 1.0
    return xp.divide(x, out, out=out)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), elementwise: Gemma's
    GeGLU gate (HF's gelu_pytorch_tanh)."""
    xp = array_module(x)
    inner = x * x
    inner *= 0.044715 * x
    inner += x
    inner *= math.sqrt(2.0 / math.pi)
    xp.tanh(inner, out=inner)
    inner += 1.0
    inner *= 0.5 * x
    return inner


# The gated MLP's activation by ModelConfig.activation: SwiGLU (Llama) or GeGLU (Gemma).
ACTIVATION_FUNCTIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def swiglu(x: np.ndarray, w_gate, w_up, w_down) -> np.ndarray:
    """The Llama MLP: down(silu(gate(x)) * up(x)).    x: [T, dim] -> [T, dim]"""
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


# ---- rotary position embedding -------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """The rotation speed of each dimension pair: theta^(-2i/d), adjusted by rope scaling.  [hd/2]"""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1+: slow (long-wavelength) pairs are stretched by `factor`, fast ones kept, and the
    band between is blended smoothly, so the model sees longer contexts without retraining."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention gain for a context stretched `factor` times: 0.1 · mscale · ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: dict, max_seq_len: int) -> tuple[np.ndarray, float]:
    """YaRN: interpolate slow pairs by `factor`, keep fast ones, ramp linearly between."""
    factor = s.get("factor") or max_seq_len / s["original_max_position_embeddings"]
    gain = s.get("attention_factor")
    if gain is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        gain = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                else yarn_mscale(factor))
    old_context = s["original_max_position_embeddings"]

    def pair_rotating(n_rotations):   # the dim whose pair turns n_rotations times over old_context
        return dim * math.log(old_context / (n_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_rotating(s.get("beta_fast") or 32), pair_rotating(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)   # [dim/2]
    keep = (1 - ramp).astype(np.float32)          # 1: fast pair, extrapolate (unchanged frequency)
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)                  # [dim/2]
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq.astype(np.float32), float(gain)


def rope_frequencies(config, long: bool = False) -> tuple[np.ndarray, float]:
    """(inv_freq [rotary_dim/2], the gain on cos and sin) of a GQA model: YaRN (GPT-OSS) and LongRoPE
    (Phi-3) scale cos and sin too. LongRoPE has two sets of factors: `long` picks the one for sequences
    past the pretraining context (Transformer.rope chooses)."""
    s = config.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "yarn":
        return yarn_inv_freq(config.rotary_dim, config.rope_theta, s, config.max_seq_len)
    if kind == "longrope":
        factors = np.asarray(s["long_factor" if long else "short_factor"], dtype=np.float32)   # [rotary_dim/2]
        return (rope_inv_freq(config.rotary_dim, config.rope_theta) / factors).astype(np.float32), s["attention_factor"]
    return rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling), 1.0


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's angles, computed in fp32 as HF does.   -> 2 × [T, hd/2]"""
    xp = array_module(positions, inv_freq)
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]     # [T, hd/2]
    return xp.cos(angles), xp.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each (x[i], x[i + r/2]) pair by its angle (HF's half-split layout), over the first r = 2 ·
    cos.shape[-1] dims of each head: all of them, or Phi's partial rotary share (the rest pass unturned).

    x: [T, n_heads, hd]; cos, sin: [T, r/2]
    """
    xp = array_module(x)
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:                                             # partial: rotate [..., :r], keep the rest
        return xp.concatenate([apply_rope(x[..., :2 * half], cos, sin), x[..., 2 * half:]], axis=-1)
    x1, x2 = x[..., :half], x[..., half:]                                  # [T, H, hd/2] each
    c, s = cos[:, None, :], sin[:, None, :]                                # [T, 1, hd/2]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)     # [T, H, hd]
