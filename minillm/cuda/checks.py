"""Every GPU kernel against its NumPy reference, and the GPU model against the CPU model.

Shared by tests/test_cuda.py (pytest, many shapes) and `python -m minillm.cuda.selfcheck` (a quick
subset before timing). Each `check_*` runs on random inputs (never zeros), poisons outputs with NaN
first (an element a kernel forgets to write shows up as NaN), and returns (error, tolerance): the
largest absolute difference relative to the reference's largest magnitude, and what is accepted.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.model.attention import attend
from minillm.backend import as_f32, to_dtype
from minillm.model.config import ModelConfig
from minillm.model.layers import apply_rope, rmsnorm, rope_inv_freq, rope_tables, silu
from minillm.model.transformer import Transformer
from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.model.quant import quantize
from minillm.cuda.kernels import Kernels
from minillm.cuda.qweights import QuantMatrix

# Relative tolerances: fp16 keeps 11 significant bits, bf16 8; fp32 paths are far tighter.
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
F32_TOL = 1e-5
# Quantized GEMVs (gemv_quant.cu v2) multiply codes and x in fp16 within each 16-byte chunk, then widen:
# ~1e-3 of the largest output at worst, 10-100x below what quantizing the weights moved it already.
QUANT_TOL = 3e-3


def gemv_tol(n_in: int, quant: str | None) -> float:
    """Same weights on both sides: fp32 summation order only, or the quantized kernels' fp16 products."""
    return QUANT_TOL if quant is not None else F32_TOL * math.sqrt(n_in)


def _cp():
    import cupy
    return cupy


def narrow(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> host 16-bit storage (float16, or bf16 bits as uint16), as the GPU holds it."""
    return to_dtype(np.asarray(a, np.float32), dtype)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    if np.isnan(got).any():
        return math.inf                        # a poisoned element was never written
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def poisoned(shape, dtype):
    """A device array filled with NaN (fp16/fp32) or the bf16 NaN pattern 0x7FC0 (uint16)."""
    cp = _cp()
    if np.dtype(dtype) == np.uint16:
        return cp.full(shape, 0x7FC0, dtype=cp.uint16)
    return cp.full(shape, np.nan, dtype=dtype)


def _host(a) -> np.ndarray:
    """Device array -> host fp32 (16-bit storage widened)."""
    return as_f32(_cp().asnumpy(a))


def _sync():
    _cp().cuda.Device().synchronize()


def weights(k: Kernels, rows: int, n_in: int, rng, quant: str | None = None, group_size: int = 128):
    """Random W [rows, in] (variance 1/in) as the GPU holds it, and the fp32 reference it stands for:
    16-bit (the weight dtype), or int8/int4 quantized by minillm.model.quant and uploaded as is.
    -> (reference fp32 [rows, in] on the host, device matrix)"""
    w = rng.standard_normal((rows, n_in)) / math.sqrt(n_in)
    if quant is None:
        w = narrow(w, k.dtype)
        return as_f32(w), _cp().asarray(w)
    q = quantize(w.astype(np.float32), quant, group_size)
    return q.dequantize(), QuantMatrix.upload([q])


# ---- kernels ----------------------------------------------------------------------------------------
def check_rmsnorm(k: Kernels, T: int, dim: int, to_narrow: bool, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    x = rng.standard_normal((T, dim)).astype(np.float32) * 3
    g = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    out = poisoned((T, dim), _narrow_dt(k.dtype) if to_narrow else np.float32)
    k.rmsnorm(cp.asarray(x), cp.asarray(g), out, 1e-5)
    _sync()
    want = rmsnorm(x, g, 1e-5)
    return rel_err(_host(out), want), (TOL[k.dtype] if to_narrow else F32_TOL)


def check_gemv(k: Kernels, rows: int, n_in: int, version: int, accumulate: bool = False, seed: int = 0,
               quant: str | None = None, group_size: int = 128):
    cp, rng = _cp(), np.random.default_rng(seed)
    w, dw = weights(k, rows, n_in, rng, quant, group_size)
    x = rng.standard_normal(n_in).astype(np.float32)
    y0 = rng.standard_normal(rows).astype(np.float32)
    y = cp.asarray(y0) if accumulate else poisoned(rows, np.float32)
    k.gemv(dw, cp.asarray(x), y, accumulate=accumulate, version=version)
    _sync()
    want = w.astype(np.float64) @ x.astype(np.float64) + (y0 if accumulate else 0)
    return rel_err(_host(y), want), gemv_tol(n_in, quant)


def check_gemv_rmsnorm(k: Kernels, rows: int, n_in: int, seed: int = 0, version: int = 3,
                       quant: str | None = None, group_size: int = 128):
    cp, rng = _cp(), np.random.default_rng(seed)
    w, dw = weights(k, rows, n_in, rng, quant, group_size)
    x = (rng.standard_normal(n_in) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    y = poisoned(rows, np.float32)
    k.gemv_rmsnorm(dw, cp.asarray(x), cp.asarray(g), 1e-5, y, version=version)
    _sync()
    want = w.astype(np.float64) @ rmsnorm(x[None], g, 1e-5)[0].astype(np.float64)
    return rel_err(_host(y), want), gemv_tol(n_in, quant)


def check_gemv_swiglu(k: Kernels, ffn: int, n_in: int, norm: bool, seed: int = 0,
                      quant: str | None = None, group_size: int = 128):
    """v4 gate/up GEMV with SwiGLU in the epilogue (and the RMSNorm in the prologue when `norm`)."""
    cp, rng = _cp(), np.random.default_rng(seed)
    w, dw = weights(k, 2 * ffn, n_in, rng, quant, group_size)
    x = (rng.standard_normal(n_in) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    out = poisoned(ffn, np.float32)
    k.gemv_swiglu(dw, cp.asarray(x), cp.asarray(g) if norm else None, 1e-5, out)
    _sync()
    h = rmsnorm(x[None], g, 1e-5)[0] if norm else x
    gu = w.astype(np.float64) @ h.astype(np.float64)
    want = silu(gu[:ffn]) * gu[ffn:]
    if quant is not None:   # errors of gate and up reach the product scaled by the other's size, not by it
        return float(np.abs(_host(out) - want).max() / (np.abs(gu[:ffn]).max() * np.abs(gu[ffn:]).max())), QUANT_TOL
    return rel_err(_host(out), want), gemv_tol(n_in, quant)


def check_gemv_qkv(k: Kernels, n_heads: int, n_kv: int, hd: int, n_in: int, pos0: int, capacity: int,
                   norm: bool, seed: int = 0, quant: str | None = None, group_size: int = 128):
    """v4 q|k|v GEMV with RoPE and the KV-cache append in the epilogue (and the RMSNorm when `norm`):
    the rotated row against NumPy, and the cache (every other slot untouched) against the narrowed k, v."""
    cp, rng = _cp(), np.random.default_rng(seed)
    width = (n_heads + 2 * n_kv) * hd
    w, dw = weights(k, width, n_in, rng, quant, group_size)
    x = (rng.standard_normal(n_in) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n_in)).astype(np.float32)
    inv_freq = rope_inv_freq(hd, 10000.0)
    old = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    kc, vc = cp.asarray(old), cp.asarray(old)
    y = poisoned(width, np.float32)
    k.gemv_qkv(dw, cp.asarray(x), cp.asarray(g) if norm else None, 1e-5, y,
               cp.asarray(np.array([pos0], np.int32)), cp.asarray(inv_freq), kc, vc, n_heads, n_kv, hd)
    _sync()
    h = rmsnorm(x[None], g, 1e-5)[0] if norm else x
    qkv = (w.astype(np.float64) @ h.astype(np.float64)).astype(np.float32)
    cos, sin = rope_tables(np.arange(pos0, pos0 + 1), inv_freq)
    n_rot = n_heads + n_kv
    rotated = apply_rope(qkv[None, :n_rot * hd].reshape(1, n_rot, hd), cos, sin).reshape(-1)
    want = np.concatenate([rotated, qkv[n_rot * hd:]])
    err = rel_err(_host(y), want)
    tol = gemv_tol(n_in, quant) + 1e-5 * max(1, pos0) ** 0.5
    want_k, want_v = as_f32(old).copy(), as_f32(old).copy()
    if pos0 < capacity:
        new = want.reshape(n_heads + 2 * n_kv, hd)
        want_k[:, pos0] = as_f32(narrow(new[n_heads:n_rot], k.dtype))
        want_v[:, pos0] = as_f32(narrow(new[n_rot:], k.dtype))
    # the cache holds 16-bit roundings of values equal to ~1e-6: one rounding step may differ
    cache_err = max(rel_err(_host(kc), want_k), rel_err(_host(vc), want_v))
    return max(err, cache_err * tol / TOL[k.dtype]), tol


def check_rope(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, pos0: int, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((T, width)).astype(np.float32)
    inv_freq = rope_inv_freq(hd, 10000.0)
    d_qkv, pos = cp.asarray(qkv), cp.asarray(np.array([pos0], np.int32))
    k.rope(d_qkv, T, n_heads + n_kv, hd, pos, cp.asarray(inv_freq))
    _sync()
    cos, sin = rope_tables(np.arange(pos0, pos0 + T), inv_freq)
    rotated = apply_rope(qkv[:, :(n_heads + n_kv) * hd].reshape(T, n_heads + n_kv, hd), cos, sin)
    want = np.concatenate([rotated.reshape(T, -1), qkv[:, (n_heads + n_kv) * hd:]], axis=1)
    return rel_err(_host(d_qkv), want), 1e-5 * max(1, pos0) ** 0.5


def check_kv_append(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, capacity: int, pos0: int, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((T, width)).astype(np.float32)
    old = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    kc, vc = cp.asarray(old), cp.asarray(old)
    k.kv_append(cp.asarray(qkv), T, n_heads, n_kv, hd, kc, vc, cp.asarray(np.array([pos0], np.int32)))
    _sync()
    want_k, want_v = as_f32(old).copy(), as_f32(old).copy()
    new = qkv.reshape(T, n_heads + 2 * n_kv, hd)
    want_k[:, pos0:pos0 + T] = as_f32(narrow(new[:, n_heads:n_heads + n_kv].transpose(1, 0, 2), k.dtype))
    want_v[:, pos0:pos0 + T] = as_f32(narrow(new[:, n_heads + n_kv:].transpose(1, 0, 2), k.dtype))
    err = max(rel_err(_host(kc), want_k), rel_err(_host(vc), want_v))
    return err, 0.0                                                 # a copy: exact


def check_kv_append_int8(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, capacity: int, pos0: int,
                         seed: int = 0):
    """kv_int8.cu's quantizer against Int8KVCache.append on the same fp32 k and v (one vector all zeros):
    the same codes and scales, and nothing written outside positions pos0..pos0+T-1."""
    from minillm.model.kv_cache import Int8KVCache
    cp, rng = _cp(), np.random.default_rng(seed)
    qkv = (rng.standard_normal((T, (n_heads + 2 * n_kv) * hd)) * 3).astype(np.float32)
    qkv[0, n_heads * hd:(n_heads + 1) * hd] = 0.0                       # an all-zero key: scale 0, codes 0
    ref = Int8KVCache(ModelConfig(vocab_size=8, dim=n_heads * hd, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv,
                                  ffn_dim=8), capacity)
    ref.length = pos0
    new = qkv.reshape(T, n_heads + 2 * n_kv, hd).transpose(1, 0, 2)    # [heads, T, hd]
    ref.append(0, new[n_heads:n_heads + n_kv], new[n_heads + n_kv:])
    kc, vc = cp.full((n_kv, capacity, hd), 99, cp.int8), cp.full((n_kv, capacity, hd), 99, cp.int8)
    ks, vs = cp.full((n_kv, capacity), np.nan, cp.float32), cp.full((n_kv, capacity), np.nan, cp.float32)
    want_k, want_v = np.full((n_kv, capacity, hd), 99, np.int8), np.full((n_kv, capacity, hd), 99, np.int8)
    want_ks, want_vs = np.full((n_kv, capacity), np.nan, np.float32), np.full((n_kv, capacity), np.nan, np.float32)
    span = slice(pos0, pos0 + T)
    want_k[:, span], want_v[:, span] = ref.k[0, :, span], ref.v[0, :, span]
    want_ks[:, span], want_vs[:, span] = ref.k_scale[0, :, span], ref.v_scale[0, :, span]
    k.kv_append_int8(cp.asarray(qkv), T, n_heads, n_kv, hd, kc, vc, ks, vs, cp.asarray(np.array([pos0], np.int32)))
    _sync()
    codes_off = max(int(np.abs(_host(a).astype(np.int32) - w).max()) for a, w in ((kc, want_k), (vc, want_v)))
    scales_same = all(np.array_equal(_host(a), w, equal_nan=True) for a, w in ((ks, want_ks), (vs, want_vs)))
    return (float(codes_off) if scales_same else math.inf), 0.0      # exact: the same division and rounding


def check_attention_int8(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, length: int, n_splits: int,
                         window: int | None = None, seed: int = 0):
    """Attention over an int8 cache (attention_gqa*_int8) against NumPy attention over the dequantized
    keys and values (what Int8KVCache.append returns); twice on the same counters. Scales past `length`
    are NaN: a kernel that reads a key it should not returns NaN."""
    cp, rng = _cp(), np.random.default_rng(seed)
    capacity = length + 3
    qkv = rng.standard_normal((T, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    kc, vc = (rng.integers(-127, 128, (n_kv, capacity, hd)).astype(np.int8) for _ in range(2))
    ks, vs = ((0.01 + rng.random((n_kv, capacity))).astype(np.float32) / 10 for _ in range(2))
    ks[:, length:] = vs[:, length:] = np.nan
    q = qkv[:, :n_heads * hd].reshape(T, n_heads, hd)
    keys, values = kc[:, :length] * ks[:, :length, None], vc[:, :length] * vs[:, :length, None]
    want = attend(q, keys, values, window)
    parts = (poisoned((T, n_heads, n_splits), np.float32), poisoned((T, n_heads, n_splits), np.float32),
             poisoned((T, n_heads, n_splits, hd), np.float32), cp.zeros((T, n_heads), cp.uint32))
    d = [cp.asarray(a) for a in (qkv, kc, vc, ks, vs)]
    pos = cp.asarray(np.array([length - T], np.int32))
    err = 0.0
    for _ in range(2):
        out = poisoned((T, n_heads * hd), np.float32)
        k.attention(d[0], T, n_heads, n_kv, hd, d[1], d[2], pos, window, parts, out, scales=(d[3], d[4]))
        _sync()
        err = max(err, rel_err(_host(out), want))
        if int(cp.asnumpy(parts[3]).max()) != 0:
            return math.inf, 1e-4                                   # a counter was left non-zero
    return err, 1e-4                                                # the same values: fp32 math only


def check_kv_dequantize(k: Kernels, n_kv: int, hd: int, capacity: int, n: int, seed: int = 0):
    """kv_dequant: positions [0, n) widened to the weight dtype, code · scale, and nothing else written."""
    cp, rng = _cp(), np.random.default_rng(seed)
    kc, vc = (rng.integers(-127, 128, (n_kv, capacity, hd)).astype(np.int8) for _ in range(2))
    ks, vs = (rng.random((n_kv, capacity)).astype(np.float32) for _ in range(2))
    k_out, v_out = (poisoned((n_kv, capacity, hd), _narrow_dt(k.dtype)) for _ in range(2))
    k.kv_dequantize(*(cp.asarray(a) for a in (kc, vc, ks, vs)), n, k_out, v_out)
    _sync()
    err = 0.0
    for codes, scales, got in ((kc, ks, k_out), (vc, vs, v_out)):
        want = as_f32(narrow(codes[:, :n] * scales[:, :n, None], k.dtype))
        got = _host(got)
        if n < capacity and not np.isnan(got[:, n:]).all():
            return math.inf, 0.0                                    # wrote past the positions asked for
        err = max(err, rel_err(got[:, :n], want))
    return err, 0.0                                                 # one rounding, the same on both sides


def check_attention(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, length: int, n_splits: int,
                    window: int | None = None, capacity: int | None = None, seed: int = 0, fused: bool = False):
    """T queries that are the last T of `length` cached positions; n_splits flash-decoding splits.
    fused: the one-launch kernel (combine in the last split block); it runs twice on the same counters,
    which must be back at zero after each run (a replayed graph relies on that)."""
    cp, rng = _cp(), np.random.default_rng(seed)
    capacity = capacity or length + 3
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((T, width)).astype(np.float32)
    kc = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    vc = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    parts = (poisoned((T, n_heads, n_splits), np.float32), poisoned((T, n_heads, n_splits), np.float32),
             poisoned((T, n_heads, n_splits, hd), np.float32))
    if fused:
        parts += (cp.zeros((T, n_heads), cp.uint32),)
    pos = cp.asarray(np.array([length - T], np.int32))
    q = qkv[:, :n_heads * hd].reshape(T, n_heads, hd)
    want = attend(q, as_f32(kc)[:, :length], as_f32(vc)[:, :length], window)
    d_qkv, d_kc, d_vc = cp.asarray(qkv), cp.asarray(kc), cp.asarray(vc)
    err = 0.0
    for _ in range(2 if fused else 1):
        out = poisoned((T, n_heads * hd), np.float32)
        k.attention(d_qkv, T, n_heads, n_kv, hd, d_kc, d_vc, pos, window, parts, out)
        _sync()
        err = max(err, rel_err(_host(out), want))
        if fused and int(cp.asnumpy(parts[3]).max()) != 0:
            return math.inf, 1e-4                                   # a counter was left non-zero
    return err, 1e-4                                                # same K/V values: fp32 math only


def check_prefill_attention(k: Kernels, T: int, n_heads: int, n_kv: int, hd: int, length: int,
                            window: int | None = None, capacity: int | None = None, seed: int = 0):
    """The tiled prefill kernel (prefill_attention.cu): T queries that are the last T of `length` cached
    positions (cache offset length - T). Besides the NaN-poisoned output, the cache slots no query may
    see are NaN too (past `length`, and before the first query's window): a kernel that reads one of
    them, or lets a masked key through, returns NaN."""
    cp, rng = _cp(), np.random.default_rng(seed)
    capacity = capacity or length + 5
    width = (n_heads + 2 * n_kv) * hd
    qkv = rng.standard_normal((T, width)).astype(np.float32)
    kc = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    vc = narrow(rng.standard_normal((n_kv, capacity, hd)), k.dtype)
    q = qkv[:, :n_heads * hd].reshape(T, n_heads, hd)
    want = attend(q, as_f32(kc)[:, :length], as_f32(vc)[:, :length], window)
    nan = narrow(np.full(1, np.nan, np.float32), k.dtype)[0]
    first_visible = max(0, length - T - window + 1) if window else 0
    for c in (kc, vc):
        c[:, length:] = nan
        c[:, :first_visible] = nan
    pos = cp.asarray(np.array([length - T], np.int32))
    out = poisoned((T, n_heads * hd), np.float32)
    k.prefill_attention(cp.asarray(qkv), T, n_heads, n_kv, hd, cp.asarray(kc), cp.asarray(vc), pos, window, out)
    _sync()
    return rel_err(_host(out), want), 1e-4                          # same K/V values: fp32 math only


def check_swiglu(k: Kernels, T: int, ffn: int, to_narrow: bool, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    gu = (rng.standard_normal((T, 2 * ffn)) * 3).astype(np.float32)
    out = poisoned((T, ffn), _narrow_dt(k.dtype) if to_narrow else np.float32)
    k.swiglu(cp.asarray(gu), out)
    _sync()
    want = silu(gu[:, :ffn]) * gu[:, ffn:]
    return rel_err(_host(out), want), (TOL[k.dtype] if to_narrow else F32_TOL)


def check_embed_cast(k: Kernels, vocab: int, dim: int, seed: int = 0):
    cp, rng = _cp(), np.random.default_rng(seed)
    table = narrow(rng.standard_normal((vocab, dim)), k.dtype)
    tokens = rng.integers(0, vocab, 7).astype(np.int32)
    out = poisoned((7, dim), np.float32)
    k.embed(cp.asarray(tokens), cp.asarray(table), out)
    x = rng.standard_normal((5, dim)).astype(np.float32)
    narrowed = poisoned((5, dim), _narrow_dt(k.dtype))
    k.cast(cp.asarray(x), narrowed)
    _sync()
    err_embed = rel_err(_host(out), as_f32(table[tokens]))
    err_cast = rel_err(cp.asnumpy(narrowed).view(np.uint16), narrow(x, k.dtype).view(np.uint16))
    return max(err_embed, err_cast), 0.0                            # both exact (cast: bit for bit)


def check_dequantize(k: Kernels, method: str, rows: int, n_in: int, group_size: int = 128, seed: int = 0):
    """The prefill widening (gemv_quant.cu dequant_*) against minillm.model.quant's fp32 dequantization: every
    element within one rounding to the weight dtype (q·s + m may be one fused multiply-add on the GPU)."""
    rng = np.random.default_rng(seed)
    w, dw = weights(k, rows, n_in, rng, method, group_size)
    out = poisoned((rows, n_in), _narrow_dt(k.dtype))
    k.dequantize(dw, out)
    _sync()
    return rel_err(_host(out), w), TOL[k.dtype]


def _narrow_dt(dtype: str):
    return np.float16 if dtype == "float16" else np.uint16


# ---- the model --------------------------------------------------------------------------------------
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


def check_model_logits(kind: str, dtype: str, n_prompt: int = 12, n_decode: int = 20, seed: int = 0,
                       fuse_norm: bool = False, gemv_version: int = 4, prefill_attention: str = "tiled",
                       quant: str | None = None, group_size: int = 128, cpu=None, kv_cache: str = "auto"):
    """Prefill logits (all positions) and teacher-forced decode logits, GPU vs CPU.
    prefill_attention: "tiled" (prefill_attention.cu) or "decode" (the decode kernel, one query a token).
    quant: int8/int4 layer matrices, the same on both sides. cpu: a CPU model to use instead of a
    random one of `kind`'s shape. kv_cache "int8": both sides quantize keys and values (Int8KVCache)."""
    from minillm.cuda.gpu_model import GPUTransformer
    cpu = cpu or random_cpu_model(small_config(kind), dtype, seed, quant, group_size)
    cfg = cpu.config
    cpu, kv = _with_kv_cache(cpu, kv_cache)
    gpu = GPUTransformer.from_cpu(cpu, dtype, fuse_norm=fuse_norm, gemv_version=gemv_version,
                                  prefill_attention=prefill_attention, **kv)
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
    from minillm.cuda.gpu_model import GPUTransformer
    cpu = cpu or random_cpu_model(small_config(kind), dtype, seed, quant, group_size)
    cfg = cpu.config
    cpu, kv = _with_kv_cache(cpu, kv_cache)
    gpu = GPUTransformer.from_cpu(cpu, dtype, fuse_norm=fuse_norm, gemv_version=gemv_version, **kv)
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


def check_graph_equals_eager(kind: str, dtype: str, n: int = 24, seed: int = 0, fuse_norm: bool = False,
                             gemv_version: int = 4, quant: str | None = None, group_size: int = 128,
                             kv_cache: str = "auto"):
    """The same prompt and tokens through eager launches and through the replayed CUDA graph:
    the same kernels in the same order, so the logits must be bit-identical."""
    from minillm.cuda.gpu_model import GPUTransformer
    cfg = small_config(kind)
    gpu = GPUTransformer.from_cpu(random_cpu_model(cfg, dtype, seed, quant, group_size), dtype, fuse_norm=fuse_norm,
                                  gemv_version=gemv_version, kv_cache=kv_cache)
    ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, 8 + n)
    runs = []
    for use_graph in (False, True):
        gpu.use_graph = use_graph
        cache = gpu.new_cache(64)
        out = [gpu.prefill(ids[:8], cache)] + [gpu.decode(int(t), cache) for t in ids[8:]]
        runs.append(np.stack(out))
    same = bool(np.array_equal(runs[0], runs[1]))
    return same, "bit-identical" if same else f"max diff {np.abs(runs[0] - runs[1]).max():.3e}"
