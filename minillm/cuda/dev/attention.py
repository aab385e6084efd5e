"""Attention and the KV cache's kernels: kernels/decode_attention.cu (split + combine, the fused
v2, the GQA-group v3 and its int8 variants), prefill_attention.cu (tiled, fp32: prefill v1),
prefill_attention_mma.cu (tiled, tensor cores: prefill v2), kv_append.cu, kv_int8.cu.

Checks against minillm.model.attention.attend on the same 16-bit (or int8-dequantized) keys and values;
the sweep times decode attention alone at a few context lengths, v2 against v3, in a CUDA graph
(`attention_us`). `python -m minillm.cuda.dev.attention` runs both (the sweep on a Mistral-7B shape);
`--prefill` runs the prefill kernels' checks, times prefill v1 against v2 (`prefill_us`) and the TTFT of a
random Mistral-7B with each (`prefill_ttft`) instead.
(paged_attention.cu, the batching engine's, is paged_attention.py.)
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import numpy as np

from minillm.backend import as_f32
from minillm.cuda.dev.common import (TOL, _cp, _host, _narrow_dt, _sync, finish, narrow, plain_table, poisoned,
                                     rel_err, require_gpu, run_cases, say)
from minillm.cuda.dev import prefill_mma
from minillm.cuda.dev.lab import as_lab, as_lab_model
from minillm.cuda.timing import graph_us
from minillm.cuda.kernels import MM_HDS, Kernels
from minillm.model.attention import attend
from minillm.model.config import ModelConfig


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
                            window: int | None = None, capacity: int | None = None, seed: int = 0, version: int = 1,
                            against_model: bool = False):
    """The tiled prefill kernel (version 1: prefill_attention.cu, 2: prefill_attention_mma.cu where it has
    this head_dim, else 1): T queries that are the last T of `length` cached positions (cache offset
    length - T). Besides the NaN-poisoned output, the cache slots no query may see are NaN too (past
    `length`, and before the first query's window): a kernel that reads one of them, or lets a masked key
    through, returns NaN. against_model: compare with the NumPy lane-by-lane model of the mma kernel
    (dev/prefill_mma.py, slow: small shapes) instead of attend, which it should match to fp32 rounding."""
    cp, rng = _cp(), np.random.default_rng(seed)
    k = as_lab(k).with_settings(prefill_attention_version=version)
    mma = k.prefill_attention_kernel(hd).startswith("prefill_attention_mma")
    if mma != (version == 2 and hd in MM_HDS):
        return math.inf, 0.0                                        # not the kernel this check is about
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
    if against_model:
        want = prefill_mma.attention(qkv, as_f32(kc), as_f32(vc), T, n_heads, n_kv, length - T, window, k.dtype)
    pos = cp.asarray(np.array([length - T], np.int32))
    out = poisoned((T, n_heads * hd), np.float32)
    k.prefill_attention(cp.asarray(qkv), T, n_heads, n_kv, hd, cp.asarray(kc), cp.asarray(vc), pos, window, out)
    _sync()
    if against_model:
        # the same roundings, up to ex2.approx's last bit and the sum order: such a difference can flip
        # one 16-bit rounding of P, a step of 2^-11 (fp16) or 2^-8 (bf16) of that weight (H200: bf16 1.9e-4)
        return rel_err(_host(out), want), (1e-4 if k.dtype == "float16" else 5e-4)
    # v1: same K/V values, fp32 math only; v2: Q and P rounded to 16 bits for the tensor cores
    return rel_err(_host(out), want), (TOL[k.dtype] if mma else 1e-4)


def prefill_cases(k: Kernels) -> list[tuple[str, Callable]]:
    """prefill_attention_mma.cu (prefill v2) against attend: T 1 .. 1000, chunks after cached keys, windows,
    hd 64 and 128, GQA / MHA / MQA; one against the kernel's NumPy model; one fallback to v1 (hd 96)."""
    def v2(T, n_heads, n_kv, hd, length, window=None, **kw):
        return lambda: check_prefill_attention(k, T, n_heads, n_kv, hd, length, window, version=2, **kw)
    return [
            ("prefill v2 T=1", v2(1, 32, 8, 128, 1)),
            ("prefill v2 T=1 after 300 window 100 hd 64", v2(1, 8, 2, 64, 301, 100)),
            ("prefill v2 T=7 group 3 hd 64", v2(7, 9, 3, 64, 7)),
            ("prefill v2 T=7 after 50 Mistral heads", v2(7, 32, 8, 128, 57)),
            ("prefill v2 T=64 MHA hd 64", v2(64, 8, 8, 64, 64)),
            ("prefill v2 T=64 after 100 window 40", v2(64, 8, 2, 128, 164, 40)),
            ("prefill v2 T=33 MQA after 17", v2(33, 8, 1, 128, 50)),
            ("prefill v2 T=512 Mistral heads", v2(512, 32, 8, 128, 512, 4096)),
            ("prefill v2 T=512 after 512 window 300", v2(512, 32, 8, 128, 1024, 300)),
            ("prefill v2 T=1000 hd 64", v2(1000, 8, 2, 64, 1000)),
            ("prefill v2 T=1000 after 24 window 256", v2(1000, 8, 2, 128, 1024, 256)),
            ("prefill v2 = its NumPy model, T=40 after 60 w 50", v2(40, 8, 2, 128, 100, 50, against_model=True)),
            ("prefill v2 setting, hd 96: v1", lambda: check_prefill_attention(k, 20, 4, 2, 96, 30, version=2)),
    ]


def cases(k: Kernels) -> list[tuple[str, Callable]]:
    """decode, fused, GQA-group and tiled prefill attention, and the KV append:
    (label, check) pairs for the selfcheck; each check -> (error, tolerance)."""
    return [
            ("kv_append T=5", lambda: check_kv_append(k, 5, 4, 1, 128, 40, 7)),
            ("attention decode L=37 splits=4", lambda: check_attention(k, 1, 8, 2, 64, 37, 4)),
            ("attention decode L=37 splits=64 (empty)", lambda: check_attention(k, 1, 8, 2, 64, 37, 64)),
            ("attention decode L=3000 GQA hd 128", lambda: check_attention(k, 1, 32, 8, 128, 3000, 16)),
            ("attention decode MQA hd 256", lambda: check_attention(k, 1, 8, 1, 256, 50, 3)),
            ("attention decode window 6", lambda: check_attention(k, 1, 8, 2, 16, 100, 5, 6)),
            ("attention prefill T=9 after 31", lambda: check_attention(k, 9, 9, 3, 64, 40, 2)),
            ("attention prefill T=9 window 6", lambda: check_attention(k, 9, 8, 2, 16, 40, 2, 6)),
            ("attention fused L=37 splits=4", lambda: check_attention(k, 1, 8, 2, 64, 37, 4, fused=True)),
            ("attention fused L=37 splits=64 (empty)", lambda: check_attention(k, 1, 8, 2, 64, 37, 64, fused=True)),
            ("attention fused L=1 splits=17", lambda: check_attention(k, 1, 32, 8, 128, 1, 17, fused=True)),
            ("attention fused L=3000 GQA hd 128", lambda: check_attention(k, 1, 32, 8, 128, 3000, 17, fused=True)),
            ("attention fused MQA hd 256", lambda: check_attention(k, 1, 8, 1, 256, 50, 3, fused=True)),
            ("attention fused window 6", lambda: check_attention(k, 1, 8, 2, 16, 100, 5, 6, fused=True)),
            ("attention fused prefill T=9 after 31", lambda: check_attention(k, 9, 9, 3, 64, 40, 2, fused=True)),
            ("attention fused prefill T=64 s=1", lambda: check_attention(k, 64, 8, 2, 64, 64, 1, fused=True)),
            ("prefill attn tiled T=37 (ragged tile)", lambda: check_prefill_attention(k, 37, 8, 2, 64, 37)),
            ("prefill attn tiled T=9 after 31, group 3", lambda: check_prefill_attention(k, 9, 9, 3, 64, 40)),
            ("prefill attn tiled T=70 32/8 heads hd 128", lambda: check_prefill_attention(k, 70, 32, 8, 128, 70)),
            ("prefill attn tiled T=100 after 200 window 40", lambda: check_prefill_attention(k, 100, 4, 2, 64, 300, 40)),
            ("prefill attn tiled MQA hd 128 after 17", lambda: check_prefill_attention(k, 33, 8, 1, 128, 50)),
            ("prefill attn tiled hd 16 window 6", lambda: check_prefill_attention(k, 9, 8, 2, 16, 40, 6)),
            ("prefill attn tiled T=40 after 100 window 64", lambda: check_prefill_attention(k, 40, 8, 2, 128, 140, 64)),
            ("prefill attn tiled T=512 Mistral heads", lambda: check_prefill_attention(k, 512, 32, 8, 128, 512, 4096)),
            ("prefill attn mma T=70 32/8 heads hd 128", lambda: check_prefill_attention(k, 70, 32, 8, 128, 70, version=2)),
            ("prefill attn mma T=100 after 200 window 40", lambda: check_prefill_attention(k, 100, 4, 2, 64, 300, 40,
                                                                                           version=2)),
    ]


# ---- the sweep ------------------------------------------------------------------------------------
def attention_us(gpu, lengths=(144, 640, 2048), versions=(2, 3)) -> dict:
    """Decode attention alone, µs a launch inside a CUDA graph (32 layers in turn, each its own K/V), at a few
    context lengths, for each kernel version (LabSettings.attention_version). -> {(length, version): µs}"""
    import cupy as cp
    c, k = gpu.config, as_lab(gpu.k)
    cache = gpu.new_cache(max(lengths) + 8)
    rng = cp.random.default_rng(3)
    for a in (cache.k, cache.v):
        a[...] = rng.standard_normal(a.shape, dtype=cp.float32).astype(a.dtype)
    gpu.qkv[...] = rng.standard_normal(gpu.qkv.shape, dtype=cp.float32)
    parts = gpu._decode_parts(cache)
    cp.cuda.Device().synchronize()
    out = {}
    for length in lengths:
        gpu.step_pos.set(np.array([length - 1], np.int32))
        cp.cuda.Device().synchronize()
        for v in versions:
            kv = k.with_settings(attention_version=v)
            out[length, v] = graph_us(lambda i: kv.attention(gpu.qkv, 1, c.n_heads, c.n_kv_heads, c.head_dim,
                                                             cache.k[i], cache.v[i], gpu.step_pos, c.sliding_window,
                                                             parts, gpu.attn), len(gpu.layers))
    return out


def sweep() -> dict:
    """attention_us on a random Mistral-7B-shaped model, printed."""
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.model.config import PRESETS
    att = attention_us(GPUTransformer.random(PRESETS["mistral-7b"].config, "float16", seed=0))
    say("decode attention alone, µs a layer in a graph: " + ", ".join(
        f"{L} keys v2 {att[L, 2]:.1f} / v3 {att[L, 3]:.1f}" for L in sorted({L for L, _ in att})))
    return att


def prefill_us(k: Kernels, lengths=(512, 2048), versions=(1, 2), n_layers: int = 32) -> dict:
    """Prefill attention alone on Mistral-7B's shape (32 query heads, 8 KV heads, hd 128, window 4096): µs a
    launch inside a CUDA graph of n_layers launches, each layer its own K/V (as a prefill of T tokens from
    position 0 sees them), for each version (LabSettings.prefill_attention_version). -> {(T, version): µs}"""
    import cupy as cp
    from minillm.model.config import PRESETS
    c = PRESETS["mistral-7b"].config
    rng = cp.random.default_rng(4)
    out = {}
    for T in lengths:
        kc, vc = (rng.standard_normal((n_layers, c.n_kv_heads, T, c.head_dim), dtype=cp.float32).astype(cp.float16)
                  for _ in range(2))
        qkv = rng.standard_normal((T, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim), dtype=cp.float32)
        attn = cp.empty((T, c.n_heads * c.head_dim), cp.float32)
        pos = cp.zeros(1, cp.int32)
        for v in versions:
            kv = as_lab(k).with_settings(prefill_attention_version=v)
            out[T, v] = graph_us(lambda i: kv.prefill_attention(qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, kc[i],
                                                                vc[i], pos, c.sliding_window, attn), n_layers)
    return out


def prefill_sweep() -> dict:
    """prefill_us in fp16, printed as a table (with the 32 layers' total, what it adds to TTFT)."""
    us = prefill_us(Kernels("float16"))
    plain_table("prefill attention alone, Mistral-7B shape (32/8 heads, hd 128), fp16, µs a layer in a graph",
                ["T", "v1 fp32 FMA", "v2 mma", "v1/v2", "32 layers v1 -> v2"],
                [[T, f"{us[T, 1]:.1f}", f"{us[T, 2]:.1f}", f"{us[T, 1] / us[T, 2]:.1f}x",
                  f"{32 * us[T, 1] / 1e3:.2f} -> {32 * us[T, 2] / 1e3:.2f} ms"] for T in sorted({T for T, _ in us})])
    return us


def prefill_ttft(n_tokens: int = 512) -> dict:
    """TTFT of a random Mistral-7B-shaped fp16 model, prefill v1 vs v2 (timing.prefill_ttft: median of 3), and
    how far v2's last logits are from v1's (informational: 32 random layers, not a bound). -> {version: ms}"""
    from minillm.cuda.timing import prefill_ttft as ttft_s
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.model.config import PRESETS
    base = GPUTransformer.random(PRESETS["mistral-7b"].config, "float16", seed=0)
    cache = base.new_cache(n_tokens + 8)
    prompt = np.random.default_rng(0).integers(0, base.config.vocab_size, n_tokens)
    ms, logits = {}, {}
    for v in (1, 2):
        gpu = as_lab_model(base).with_settings(prefill_attention_version=v)
        ms[v] = ttft_s(gpu, cache, prompt) * 1e3
        cache.reset()
        logits[v] = gpu.prefill(prompt, cache)
    same = int(np.argmax(logits[1])) == int(np.argmax(logits[2]))
    say(f"\nTTFT {n_tokens} tokens, random Mistral-7B fp16: prefill v1 {ms[1]:.1f} ms, v2 {ms[2]:.1f} ms "
        f"({ms[1] - ms[2]:+.1f}); last logits v2 vs v1: {rel_err(logits[2], logits[1]):.1e} of the largest, "
        f"argmax {'the same' if same else 'differs'}")
    return ms


def main(argv=None) -> int:
    """`python -m minillm.cuda.dev.attention`: every check of this family in fp16 and bf16, then
    decode attention alone, v2 vs v3, on a Mistral-7B shape. --prefill: the prefill kernels' checks, then
    prefill attention alone, v1 vs v2, and TTFT with each."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m minillm.cuda.dev.attention", description=__doc__.split("\n")[0])
    ap.add_argument("--no-sweep", action="store_true", help="checks only")
    ap.add_argument("--prefill", action="store_true", help="the prefill kernels only (v1 fp32, v2 tensor cores)")
    args = ap.parse_args(argv)
    if not require_gpu("attention"):
        return 2
    run_cases(prefill_cases if args.prefill else cases)
    if not args.no_sweep:
        if args.prefill:
            prefill_sweep()
            prefill_ttft()
        else:
            sweep()
    return finish("attention")


if __name__ == "__main__":
    sys.exit(main())
