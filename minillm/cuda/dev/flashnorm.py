"""FlashNorm on the GPU: the deferred RMSNorm on two CUDA streams with an explicit join, and fused.

With the norm gains folded into the weights (minillm/model/flashnorm.py, Prop. 1), RMSNorm + projection is
(x · W*ᵀ) · 1/RMS(x) (Prop. 2): two independent pieces of work and one scale per row. Three ways to run it:

  unfused     rmsnorm kernel, then the projection reads the normalized x (what gpu_model.py's prefill does)
  two-stream  the projection on one stream, 1/RMS on another, each recording an event; the scaling kernel
              runs on the caller's stream after waiting on BOTH events (cudaStreamWaitEvent through CuPy's
              Stream.wait_event). That wait is the join, and it must be explicit: a stream orders only its
              own work, so a scale that waits on the RMS stream alone reads whatever the projection's output
              buffer held before (lesson 15 shows the model that then talks one step late).
  fused       kernels/flashnorm_gemv.cu: one GEMV that sums x² from the registers that feed the dot product
              and scales in its epilogue (decode shape; why no GEMM variant: see the .cu header).

`FlashNormGPUTransformer` is GPUTransformer with its LM head on the two-stream path (lesson 15, tests).
`FlashNormDecodeTransformer` runs FlashNorm at EVERY norm site of the graph-captured decode step (attention
norm -> q|k|v, MLP norm -> gate|up, final norm -> LM head), "deferred" (two streams, or one) or "fused".
`python -m minillm.cuda.dev.flashnorm [--quick]` times the three per layer (norm -> qkv and norm -> gate/up)
at SmolLM2 and Mistral-7B shapes, decode and a 512-token prefill, and prints a table; `--e2e` compares whole
decode steps (tok/s, GB/s, % of the copy roofline, launches per step) after checking their logits.
Importing this module does not import CuPy.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

from minillm.backend import as_f32
from minillm.model.attention import grouped_attention
from minillm.model.config import PRESETS, ModelConfig
from minillm.model.flashnorm import inv_rms as np_inv_rms
from minillm.model.layers import apply_rope, linear, rope_tables, silu
from minillm.cuda.gpu_kv_cache import device_dtype
from minillm.cuda.gpu_model import GPULayer, GPUTransformer
from minillm.cuda.timing import decode_bytes
from minillm.cuda.dev.common import plain_table, rel_err
from minillm.cuda.timing import copy_bandwidth, time_gpu
from minillm.cuda.dev.lab import lab_module
from minillm.cuda.graph import capture
from minillm.cuda.kernels import Kernels, suffix

SOURCE = "flashnorm_gemv"                  # dev/kernels/flashnorm_gemv.cu
KERNELS = {"gemv": "flashnorm_gemv_{sfx}", "gemv_swiglu": "flashnorm_gemv_swiglu_{sfx}",
           "gemv_scaled": "gemv_scaled_{sfx}", "inv_rms": "flashnorm_inv_rms",
           "scale_rows": "flashnorm_scale_rows", "spin": "flashnorm_spin", "gemv_qkv": "flashnorm_gemv_qkv_{sfx}"}
FN_WARPS = 4                               # as #defined in flashnorm_gemv.cu (row pairs per block)


def _cp():
    import cupy
    return cupy


class FlashNormKernels:
    """Launch helpers for kernels/flashnorm_gemv.cu, for one weight dtype; launches go on the current stream.
    `timer`, when set, wraps each launch as Kernels.timer does (CUDA events, or the CPU launch recorder)."""

    timer = None

    def __init__(self, dtype: str = "float16"):
        cp = _cp()
        sfx = suffix(dtype)
        self.fn = {key: lab_module(SOURCE).get_function(name.format(sfx=sfx)) for key, name in KERNELS.items()}
        for f in self.fn.values():          # load now, not during a graph capture
            getattr(f, "attributes", None)
        self._nil = cp.zeros(8, cp.float32)  # for pointer arguments a variant does not read

    def gemv(self, w, x, y, eps: float, accumulate: bool = False, label: str = "") -> None:
        """y [rows] (+)= (w [rows, in] · x [in]) · 1/RMS(x): x raw, w folded, the scale in the epilogue."""
        rows, n_in = _check(w)
        self._pairs("gemv", (rows + 1) // 2, (w, x, np.float32(eps), self._nil, y, np.int32(rows),
                                              np.int32(n_in), np.int32(accumulate), self._nil), label)

    def gemv_swiglu(self, w, x, eps: float, act, inv_rms_out, label: str = "") -> None:
        """act [ffn] = silu(s·gate)·up with [gate; up] = w [2 ffn, in] · x and s = 1/RMS(x) into
        inv_rms_out [1]: up is left unscaled for gemv_scaled to finish after the down projection."""
        rows, n_in = _check(w)
        self._pairs("gemv_swiglu", rows // 2, (w, x, np.float32(eps), self._nil, act,
                                               np.int32(rows), np.int32(n_in), np.int32(0), inv_rms_out), label)

    def gemv_scaled(self, w, x, scale, y, accumulate: bool = True, label: str = "") -> None:
        """y [rows] (+)= scale[0] · (w [rows, in] · x [in]): the down projection with the deferred 1/RMS."""
        rows, n_in = _check(w)
        self._pairs("gemv_scaled", (rows + 1) // 2, (w, x, np.float32(0), scale, y, np.int32(rows),
                                                     np.int32(n_in), np.int32(accumulate), self._nil), label)

    def gemv_qkv(self, w, x, eps: float, qkv, pos, inv_freq, k_cache, v_cache, n_heads: int, n_kv_heads: int,
                 head_dim: int, label: str = "") -> None:
        """One decode token on folded q|k|v weights: qkv [width] = RoPE((w · x) · 1/RMS(x)) at pos[0], k and v
        into k_cache, v_cache [n_kv_heads, capacity, hd] (one layer) at pos[0]: gemv.cu v4's qkv launch
        without the gain."""
        rows, n_in = _check(w)
        if rows != (n_heads + 2 * n_kv_heads) * head_dim or head_dim % 2 or qkv.shape != (rows,):
            raise ValueError(f"gemv_qkv: w {w.shape}, qkv {qkv.shape}, heads {n_heads}+2x{n_kv_heads} x {head_dim}")
        self._pairs("gemv_qkv", rows // 2, (w, x, np.float32(eps), qkv, np.int32(rows), np.int32(n_in), k_cache,
                                            v_cache, np.int32(k_cache.shape[1]), pos, inv_freq, np.int32(n_heads),
                                            np.int32(n_kv_heads), np.int32(head_dim)), label)

    def _pairs(self, key: str, pairs: int, args, label: str = "") -> None:
        self._launch(key, ((pairs + FN_WARPS - 1) // FN_WARPS,), (32 * FN_WARPS,), args, label)

    def _launch(self, key: str, grid, block, args, label: str = "") -> None:
        launch = lambda: self.fn[key](grid, block, args)
        if self.timer is None:
            launch()
        else:
            self.timer(f"{KERNELS[key].replace('_{sfx}', '')} {label}".strip(), launch)

    def inv_rms(self, x, s, eps: float) -> None:
        """s [T] = 1/sqrt(mean(x²) + eps) per row of x [T, dim] fp32."""
        T, dim = x.shape
        self._launch("inv_rms", (T,), (256,), (x, s, np.int32(dim), np.float32(eps)))

    def scale_rows(self, y, s, out) -> None:
        """out [T, n] = y [T, n] · s[t] row by row (fp32; out may be y)."""
        T, n = y.shape
        grid = max(1, min(132 * 16, (T * n + 255) // 256))
        self._launch("scale_rows", (grid,), (256,), (y, s, out, np.int32(n), np.int32(T)))

    def spin(self, ns: int) -> None:
        """Keep the current stream busy for `ns` nanoseconds (one thread spinning on the GPU's timer)."""
        self._launch("spin", (1,), (1,), (np.uint64(ns),))


def _check(w) -> tuple[int, int]:
    rows, n_in = w.shape
    if n_in % 8:
        raise ValueError(f"flashnorm GEMV needs in % 8 == 0, got {n_in}")
    return rows, n_in


def gemm(a, w, out, dtype: str, stream) -> None:
    """out [T, rows] fp32 = a [T, in] (16-bit) @ w [rows, in]ᵀ on cuBLAS (fp32 accumulation), on `stream`.

    Row-major a and w are column-major aᵀ and wᵀ to cuBLAS: out (column-major [rows, T]) = op(W) · aᵀ."""
    cp = _cp()
    from cupy.cuda import runtime
    from cupy_backends.cuda.libs import cublas
    T, n_in = a.shape
    rows = w.shape[0]
    ab_type = runtime.CUDA_R_16F if dtype == "float16" else runtime.CUDA_R_16BF
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream.ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rows, T, n_in, _ONE.ctypes.data,
                  w.data.ptr, ab_type, n_in, a.data.ptr, ab_type, n_in, _ZERO.ctypes.data, out.data.ptr,
                  runtime.CUDA_R_32F, rows, cublas.CUBLAS_COMPUTE_32F, -1)


_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)


# ---- the two-stream path -----------------------------------------------------------------------------

class TwoStreamNorm:
    """(x · wᵀ) · 1/RMS(x), the projection and the reduction on two streams, joined explicitly.

    The caller's current stream is the timeline: both branches start after what it has enqueued (x is
    ready) and the scale runs on it after both branches. `delay_ns` spins the matmul stream first (tests,
    lesson 15): with an explicit join nothing may change, only the time.
    """

    parallel = True     # False: the projection, then 1/RMS, both on the caller's stream (no fork, no join)

    def __init__(self, kernels: Kernels, flash: FlashNormKernels | None = None):
        cp = _cp()
        self.k, self.fk = kernels, flash or FlashNormKernels(kernels.dtype)
        self.mm_stream = cp.cuda.Stream(non_blocking=True)
        self.rms_stream = cp.cuda.Stream(non_blocking=True)
        self.x_ready, self.mm_done, self.rms_done = (cp.cuda.Event(disable_timing=True) for _ in range(3))
        self.delay_ns = 0

    def __call__(self, x, w, y_raw, inv_rms, out, eps: float, x16=None) -> None:
        """out [T, rows] fp32 = (x [T, dim] fp32 · w [rows, dim]ᵀ) · 1/RMS(x) per row.

        Scratch: y_raw [T, rows] fp32 (the un-normalized projection), inv_rms [T] fp32, and for T > 1
        x16 [T, dim] in the weight dtype (the GEMM's input)."""
        self.fork_join(lambda: self._project(x, w, y_raw, x16), x, inv_rms, eps)
        self.fk.scale_rows(y_raw, inv_rms, out)                 # on main, after the join

    def fork_join(self, project, x, inv_rms, eps: float) -> None:
        """project() (enqueues the projection of raw x) and inv_rms [T] = 1/RMS(x [T, dim]), both after what
        the caller's stream has enqueued; on return the caller's stream waits for both. Inside a CUDA graph
        capture the fork and the join become the graph's edges: two parallel branches, one node after."""
        if not self.parallel:
            project()
            self.fk.inv_rms(x, inv_rms, eps)
            return
        main = _cp().cuda.get_current_stream()
        main.record(self.x_ready)                               # x is written: both branches may start
        self.mm_stream.wait_event(self.x_ready)
        self.rms_stream.wait_event(self.x_ready)
        with self.mm_stream:                                    # branch 1: the projection of raw x
            if self.delay_ns:
                self.fk.spin(self.delay_ns)
            project()
            self.mm_stream.record(self.mm_done)
        with self.rms_stream:                                   # branch 2: one number per row
            self.fk.inv_rms(x, inv_rms, eps)
            self.rms_stream.record(self.rms_done)
        self.join(main)

    def join(self, main) -> None:
        """The scale may start only when BOTH branches are done: wait on both events."""
        main.wait_event(self.mm_done)
        main.wait_event(self.rms_done)

    def _project(self, x, w, y_raw, x16) -> None:
        if x.shape[0] == 1:                                     # decode: our GEMV reads fp32 x directly
            self.k.gemv(w, x[0], y_raw[0])
            return
        self.k.cast(x, x16)                                     # prefill: cuBLAS wants 16-bit inputs
        gemm(x16, w, y_raw, self.k.dtype, _cp().cuda.get_current_stream())


# ---- a GPU model whose LM head runs the two-stream path ---------------------------------------------

class FlashNormGPUTransformer(GPUTransformer):
    """GPUTransformer with the final norm + LM head as FlashNorm's two-stream path (the largest matrix
    of a small model's decode step). Needs folded weights with an untied head (flashnorm.fold_checkpoint
    with untie=True): the final norm must be weightless. The layers keep gpu_model.py's fused kernels
    (their norms are all-ones after folding). Decode runs eagerly (two streams do not go through the
    captured graph) and the whole device is idle between tokens.
    """

    def __init__(self, *args, **kw):
        cp = _cp()
        super().__init__(*args, **{**kw, "use_graph": False})
        if not bool(cp.all(self.final_norm == 1.0)):
            raise ValueError("FlashNormGPUTransformer needs a weightless final norm: fold with untie=True")
        self.two_stream = TwoStreamNorm(self.k)
        self.head_raw = cp.zeros((1, self.config.vocab_size), cp.float32)     # the un-normalized logits
        self.head_inv_rms = cp.zeros(1, cp.float32)
        cp.cuda.Device().synchronize()

    def _decode_head(self) -> None:
        self.two_stream(self.x, self.lm_head, self.head_raw, self.head_inv_rms, self.logits[None], self.config.norm_eps)

    def prefill(self, tokens, cache, all_logits: bool = False) -> np.ndarray:
        """As GPUTransformer.prefill; the last position's head on the two-stream path."""
        if all_logits:
            return super().prefill(tokens, cache, all_logits=True)
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        cache.end_of_write(len(tokens))
        with self.stream:
            for start in range(0, len(tokens), self.prefill_chunk):
                x = self._prefill_chunk(tokens[start:start + self.prefill_chunk], cache)   # [T, dim]
            self.two_stream(x[-1:], self.lm_head, self.head_raw, self.head_inv_rms, self.logits[None],
                            self.config.norm_eps)
            logits = self.logits.get()
        _cp().cuda.Device().synchronize()
        return logits

    def decode(self, token: int, cache) -> np.ndarray:
        logits = super().decode(token, cache)
        _cp().cuda.Device().synchronize()          # the side streams too: each token starts on an idle GPU
        return logits


# ---- FlashNorm at every norm site of the graph-captured decode step --------------------------------

MODES = ("deferred", "fused")


class FlashNormDecodeTransformer(GPUTransformer):
    """GPUTransformer whose decode step runs FlashNorm at every norm site (attention norm -> q|k|v, MLP norm
    -> gate|up, final norm -> LM head) on folded weights: all-ones norms and an LM head of its own
    (`fold_on_device`, or flashnorm.fold_checkpoint(untie=True) on the host). The step is still captured
    as one CUDA graph (use_graph, the default). Per layer:

      fused     flashnorm_gemv.cu: 1/RMS summed from the registers that feed the dot products, one scale
                in the epilogue; 5 launches, as gemv.cu v4's step: [q|k|v + RoPE + KV append]
                [attention] [o + residual] [gate|up + silu(s·gate)·up] [s · down + residual].
      deferred  the projection of the raw x (gemv.cu v4 without its norm) and flashnorm_inv_rms forked onto
                two streams and joined inside the capture (TwoStreamNorm: the graph gets two parallel
                branches), then the scale as a step of its own; 11 launches: [q|k|v + RoPE ‖ 1/RMS]
                [scale] [KV append] [attention] [o] [gate|up ‖ 1/RMS] [scale] [SwiGLU] [down].
                two_streams=False: the same launches one after the other on one stream.
    RoPE is linear, so rotating the un-normalized q and k and scaling after is exact. The LM head: the
    fused GEMV, or GEMV ‖ 1/RMS then scale. Prefill is GPUTransformer's: rmsnorm with the all-ones gains
    and cuBLAS, the same function of the folded weights. 16-bit weights and KV cache only.
    """

    def __init__(self, *args, mode: str = "fused", two_streams: bool = True, **kw):
        cp = _cp()
        if mode not in MODES:
            raise ValueError(f"mode is one of {MODES}, not {mode!r}")
        super().__init__(*args, **kw)
        if self.quant or self.kv_cache == "int8":
            raise ValueError("FlashNormDecodeTransformer: 16-bit weights, 16-bit KV cache")
        norms = [self.final_norm] + [n for L in self.layers for n in (L.attn_norm, L.mlp_norm)]
        if not all(bool(cp.all(n == 1.0)) for n in norms):
            raise ValueError("FlashNormDecodeTransformer needs folded weights (all-ones norms): fold_on_device")
        if self.lm_head is self.embed:
            raise ValueError("FlashNormDecodeTransformer needs an LM head of its own (fold with untie=True)")
        self.mode = mode
        self.fk = FlashNormKernels(self.dtype)
        self.two = TwoStreamNorm(self.k, self.fk)
        self.two.parallel = two_streams
        self.site_inv_rms = cp.zeros(1, cp.float32)      # 1/RMS of the current norm site's input
        cp.cuda.Device().synchronize()

    def decode_step(self, cache, n_layers: int | None = None) -> None:
        """Enqueue one decode step (as GPUTransformer.decode_step: token and position from self.step,
        logits into self.logits; capturable), FlashNorm at every norm site. Every layer: no early exit."""
        if n_layers is not None:
            raise ValueError("FlashNormDecodeTransformer decodes through every layer (no early exit)")
        k = self.k
        parts = self._decode_parts(cache)
        k.embed(self.step_tokens, self.embed, self.x)                                     # [1, dim]
        for i, L in enumerate(self.layers):
            self._qkv_site(i, L, cache)                                                    # qkv [1, width]
            self._attend(i, cache, self.qkv, 1, parts, self.attn)                         # [1, n_heads * hd]
            k.gemv(L.wo, self.attn[0], self.x[0], True, "o")                           # x += o_proj(attn)
            self._mlp_site(L)                                                              # x += mlp(x)
        self._head_site()                                                                  # logits [vocab]

    def _qkv_site(self, i: int, L, cache) -> None:
        c, x, s = self.config, self.x[0], self.site_inv_rms
        heads = (c.n_heads, c.n_kv_heads, c.head_dim)
        if self.mode == "fused":
            self.fk.gemv_qkv(L.wqkv, x, c.norm_eps, self.qkv[0], self.step_pos, self.inv_freq, cache.k[i],
                             cache.v[i], *heads, "qkv")
            return
        # raw q|k|v with RoPE, no KV append (the cache must get the scaled k and v)
        project = lambda: self.k.gemv_qkv(L.wqkv, x, None, c.norm_eps, self.qkv[0], self.step_pos, self.inv_freq,
                                          None, None, *heads, "qkv")
        self.two.fork_join(project, self.x, s, c.norm_eps)
        self.fk.scale_rows(self.qkv, s, self.qkv)
        self.k.kv_append(self.qkv, 1, *heads, cache.k[i], cache.v[i], self.step_pos)

    def _mlp_site(self, L) -> None:
        c, x, s = self.config, self.x[0], self.site_inv_rms
        if self.mode == "fused":    # the gate scaled before SiLU, the up path's scale after down (Prop. 2)
            self.fk.gemv_swiglu(L.w_gate_up, x, c.norm_eps, self.act[0], s, "gate_up")
            self.fk.gemv_scaled(L.w_down, self.act[0], s, x, True, "down")
            return
        project = lambda: self.k.gemv(L.w_gate_up, x, self.gu[0], False, "gate_up")   # [2 ffn], raw
        self.two.fork_join(project, self.x, s, c.norm_eps)
        self.fk.scale_rows(self.gu, s, self.gu)
        self.k.swiglu(self.gu, self.act)
        self.k.gemv(L.w_down, self.act[0], x, True, "down")

    def _head_site(self) -> None:
        c, x, s = self.config, self.x[0], self.site_inv_rms
        if self.mode == "fused":
            self.fk.gemv(self.lm_head, x, self.logits, c.norm_eps, label="lm_head")
            return
        project = lambda: self.k.gemv(self.lm_head, x, self.logits, False, "lm_head")
        self.two.fork_join(project, self.x, s, c.norm_eps)
        self.fk.scale_rows(self.logits[None], s, self.logits[None])


def fold_columns(w, gain):
    """W* = W · diag(gain) on the device (flashnorm.fold_rmsnorm_into_linear): w [rows, in] fp16, or bf16 bits
    as uint16, gain [in] fp32 -> a new array of w's dtype, rounded once (bf16: to nearest, ties to even)."""
    cp = _cp()
    f32 = as_f32(w) * gain[None, :]                                   # [rows, in] fp32
    if w.dtype == cp.float16:
        return f32.astype(cp.float16)
    bits = f32.view(cp.uint32)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(cp.uint16)


def fold_on_device(gpu: GPUTransformer) -> tuple[list, object, object]:
    """Prop. 1 on the device: (layers, final_norm, lm_head) of `gpu` with each gain folded into a copy of the
    projections after it and the norms all ones. o, down and the embedding are shared, not copied; a tied
    head gets a folded copy of its own."""
    cp = _cp()
    ones = lambda: cp.ones(gpu.config.dim, cp.float32)
    layers = [GPULayer(ones(), fold_columns(L.wqkv, L.attn_norm), L.wo, ones(),
                       fold_columns(L.w_gate_up, L.mlp_norm), L.w_down) for L in gpu.layers]
    head = fold_columns(gpu.lm_head, gpu.final_norm)
    cp.cuda.Device().synchronize()
    return layers, ones(), head


def random_gains(gpu: GPUTransformer, seed: int, spread: float = 0.2) -> None:
    """Give a random-weight model norm gains around 1 (N(1, spread²)), so that folding changes the weights."""
    cp = _cp()
    rng = np.random.default_rng(seed)
    for gain in [gpu.final_norm] + [n for L in gpu.layers for n in (L.attn_norm, L.mlp_norm)]:
        gain[...] = cp.asarray((1 + spread * rng.standard_normal(gain.shape)).astype(np.float32))
    cp.cuda.Device().synchronize()


def reference_decode(model, token: int, cache, mode: str) -> np.ndarray:
    """One decode step in NumPy, in FlashNormDecodeTransformer's order of operations (`mode`), on a CPU
    Transformer with folded weights and its KV cache.   -> logits [vocab]

    The reorderings it makes against Transformer(flashnorm=True) are exact in real arithmetic: RoPE on the
    raw q and k, then · 1/RMS (RoPE is linear); fused: silu(s·gate)·up, then s · down(...) (the up path's
    scale moved through the linear down projection); deferred: [gate; up] · s, then SwiGLU."""
    if mode not in MODES:
        raise ValueError(f"mode is one of {MODES}, not {mode!r}")
    cfg, eps = model.config, model.config.norm_eps
    T, hd = 1, cfg.head_dim
    cos, sin = rope_tables(np.arange(cache.length, cache.length + 1), model.inv_freq)     # [1, hd/2]
    x = as_f32(model.embed[[token]])                                                        # [1, dim]
    for i, L in enumerate(model.layers):
        s = np_inv_rms(x, eps)                                                              # [1, 1]
        q = apply_rope(linear(x, L.wq).reshape(T, cfg.n_heads, hd), cos, sin) * s            # RoPE, then scale
        k = apply_rope(linear(x, L.wk).reshape(T, cfg.n_kv_heads, hd), cos, sin) * s
        v = linear(x, L.wv).reshape(T, cfg.n_kv_heads, hd) * s
        keys, values = cache.append(i, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        x = x + linear(grouped_attention(q, keys, values, cfg.sliding_window), L.wo)
        s = np_inv_rms(x, eps)
        gate, up = linear(x, L.w_gate), linear(x, L.w_up)                                   # [1, ffn], raw
        if mode == "fused":
            x = x + linear(silu(gate * s) * up, L.w_down) * s
        else:
            x = x + linear(silu(gate * s) * (up * s), L.w_down)
    cache.advance(1)
    return (linear(x, model.lm_head) * np_inv_rms(x, eps))[0]


# ---- the end-to-end comparison (--e2e) ----------------------------------------------------------------

E2E_TOL = 5e-3            # logits, relative to the largest: fp16 folding rounds every weight once more
BASELINE = "v4 (production)"


def _variants_e2e(base: GPUTransformer) -> dict:
    """name -> a function building that model: the production step on the original weights, and on folded
    copies of them (fold_on_device) the production step, fused, and deferred on two streams and on one."""
    cfg, dtype = base.config, base.dtype
    folded = {}

    def on_folded(cls, **kw):
        def build():
            if not folded:
                folded["weights"] = fold_on_device(base)
            layers, final_norm, head = folded["weights"]
            return cls(cfg, layers, base.embed, final_norm, head, dtype=dtype, **kw)
        return build
    return {BASELINE: lambda: base,
            "v4 on folded weights": on_folded(GPUTransformer),
            "fused flashnorm_gemv": on_folded(FlashNormDecodeTransformer, mode="fused"),
            "deferred, two streams": on_folded(FlashNormDecodeTransformer, mode="deferred"),
            "deferred, one stream": on_folded(FlashNormDecodeTransformer, mode="deferred", two_streams=False)}


def teacher_forced(model, tokens, prompt_len: int) -> np.ndarray:
    """Logits after the prompt, then after each later token fed in (the graph-captured decode step):
    [len(tokens) - prompt_len + 1, vocab]."""
    cache = model.new_cache(len(tokens) + 8)
    out = [model.prefill(tokens[:prompt_len], cache)]
    out += [model.decode(int(t), cache) for t in tokens[prompt_len:]]
    return np.stack(out)


def count_launches(model, cache) -> int:
    """Kernel launches in one decode step (run eagerly once, each launch counted)."""
    names = []
    timer = lambda name, launch: (names.append(name), launch())
    kernels = [model.k] + ([model.fk] if hasattr(model, "fk") else [])
    with model.stream:
        model.step.set(np.array([1, cache.length], dtype=np.int32))
        for k in kernels:
            k.timer = timer
        try:
            model.decode_step(cache)
        finally:
            for k in kernels:
                k.timer = None
        model.stream.synchronize()
    return len(names)


def _host_loop(model, cache, prompt, n_new: int) -> float:
    """tok/s of n_new greedy steps after the prompt, host argmax and logits copy each step (the engine's loop)."""
    cache.reset()
    logits = model.prefill(prompt, cache)
    start = time.perf_counter()
    for _ in range(n_new):
        logits = model.decode(int(np.argmax(logits)), cache)
    return n_new / (time.perf_counter() - start)


def _graph_ms(model, cache, replays: int = 20) -> float:
    """GPU ms per decode step: the captured step replayed back to back (no host work between), at the
    position the last step left in model.step."""
    graph = cache.graph
    with model.stream:
        return time_gpu(lambda: [graph.launch(model.stream) for _ in range(replays)], reps=5) / replays


def e2e(presets=("smollm2-135m", "mistral-7b"), dtype: str = "float16", n_new: int = 128, prompt_len: int = 16,
        repeats: int = 3, check_steps: int = 8, log=print) -> list[dict]:
    """Whole decode steps, FlashNorm at every norm site vs the production step, per preset shape (random
    weights made on the device, random norm gains): check each variant's logits, then time them
    interleaved, `repeats` times (medians).

    The check: the production step on the original weights is the reference; the folded variants are
    compared with it (err: the fold's fp16 rounding included) and with the production step on the same
    folded weights (err_folded: the deferred or fused math alone), which must be within E2E_TOL to be timed.
    Returns rows {preset, variant, launches, err, err_folded, tok_s, gpu_ms, bytes, roofline, error}; a
    variant that fails has `error` set (one line, printed) and the others go on."""
    cp = _cp()
    bw = copy_bandwidth(1 << 30)
    log(f"device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written): the roofline")
    rows = []
    for preset in presets:
        rows += _e2e_preset(PRESETS[preset].config, preset, dtype, n_new, prompt_len, repeats, check_steps, log)
        cp.get_default_memory_pool().free_all_blocks()         # the next shape starts with the memory free
    for row in rows:
        row["roofline"] = bw
    return rows


def _e2e_preset(cfg: ModelConfig, preset: str, dtype: str, n_new: int, prompt_len: int, repeats: int,
                check_steps: int, log) -> list[dict]:
    tokens = np.random.default_rng(26).integers(0, cfg.vocab_size, prompt_len + check_steps)
    base = GPUTransformer.random(cfg, dtype, seed=26)
    random_gains(base, seed=26)
    rows, ok, refs = [], {}, {}
    for name, build in _variants_e2e(base).items():
        row = dict(preset=preset, variant=name, launches=None, err=None, err_folded=None, tok_s=None, gpu_ms=None,
                   bytes=None, error=None)
        rows.append(row)
        try:
            if name != BASELINE and BASELINE not in refs:
                raise RuntimeError(f"no reference logits: {BASELINE} failed")
            model = build()
            logits = teacher_forced(model, tokens, prompt_len)
            refs.setdefault(name, logits)
            row["err"] = rel_err(logits, refs[BASELINE])
            folded_ref = refs.get("v4 on folded weights")
            if name not in (BASELINE, "v4 on folded weights") and folded_ref is not None:
                row["err_folded"] = rel_err(logits, folded_ref)
            gate = row["err_folded"] if row["err_folded"] is not None else row["err"]
            log(f"  {preset:<13} {name:<22} logits: max rel error {row['err']:.2e} vs {BASELINE}"
                + ("" if row["err_folded"] is None else f", {row['err_folded']:.2e} vs v4 on the same folded weights")
                + ("" if row["err"] <= E2E_TOL else f"  (above {E2E_TOL:.0e})"))
            if name != "v4 on folded weights" and not gate <= E2E_TOL:    # the fold's own rounding: shown, not gated
                raise ValueError(f"logits off: max rel error {gate:.2e} > {E2E_TOL:.0e} (not timed)")
            row["bytes"] = _token_bytes(cfg, model.weight_bytes, prompt_len, n_new)
            cache = model.new_cache(prompt_len + n_new + 8)
            row["launches"] = count_launches(model, cache)
            ok[name] = (model, cache, row)
        except Exception as e:  # noqa: BLE001 - one variant's failure is a line, not the end of the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"  {preset:<13} {name:<22} FAILED: {row['error']}")
            _cp().cuda.Device().synchronize()
    _time_e2e(ok, tokens[:prompt_len], n_new, repeats, log)
    return rows


def _time_e2e(ok: dict, prompt, n_new: int, repeats: int, log) -> None:
    """Median tok/s (host loop) and GPU ms per step (graph replay) of each model, interleaved."""
    times = {name: ([], []) for name in ok}
    for rep in range(repeats + 1):                              # the first round warms up (and captures)
        for name, (model, cache, row) in list(ok.items()):
            try:
                tok_s = _host_loop(model, cache, prompt, n_new)
                gpu_ms = _graph_ms(model, cache)
                if rep:
                    times[name][0].append(tok_s)
                    times[name][1].append(gpu_ms)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"timing: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"  {row['preset']:<13} {name:<22} FAILED: {row['error']}")
                del ok[name]
    for name, (_, _, row) in ok.items():
        row["tok_s"] = statistics.median(times[name][0])
        row["gpu_ms"] = statistics.median(times[name][1])


def _token_bytes(cfg: ModelConfig, weight_bytes: int, prompt_len: int, n_new: int) -> float:
    """Bytes a decode token reads: the weights once, the 16-bit KV cache at the average context."""
    return decode_bytes(cfg, weight_bytes, prompt_len, n_new)[0]


def print_e2e(rows: list[dict], dtype: str, n_new: int, print_table=None) -> None:
    """The table: per preset and variant, launches, the logits check, tok/s and the roofline's share."""
    print_table = print_table or plain_table
    base = {r["preset"]: r for r in rows if r["variant"] == BASELINE}

    def line(r):
        if r["error"]:
            return [r["preset"], r["variant"], r["launches"] or "", "FAILED: " + r["error"]] + [""] * 7
        b, bw, ref = r["bytes"], r["roofline"], base[r["preset"]]
        ratio = f" ({ref['gpu_ms'] / r['gpu_ms']:.2f}x)" if ref.get("gpu_ms") else ""
        return [r["preset"], r["variant"], r["launches"], f"{r['err']:.1e}",
                "" if r["err_folded"] is None else f"{r['err_folded']:.1e}", f"{r['tok_s']:.1f}",
                f"{1e3 / r['tok_s']:.3f}", f"{b * r['tok_s'] / 1e9:.0f}", f"{100 * b * r['tok_s'] / bw:.0f}%",
                f"{r['gpu_ms'] * 1e3:.1f}{ratio}", f"{100 * b / (r['gpu_ms'] / 1e3) / bw:.0f}%"]
    print_table(f"FlashNorm end to end, {dtype}, batch 1: {n_new} greedy tokens (host argmax each step), and the "
                f"captured step replayed back to back (GPU only); speed-up vs {BASELINE} in brackets",
                ["model", "decode step", "launches", "err vs v4", "vs v4 folded", "tok/s", "ms/token", "GB/s",
                 "% copy BW",
                 "GPU µs/step", "% copy BW (GPU)"], [line(r) for r in rows])


# ---- the micro-benchmark -----------------------------------------------------------------------------

def _sites(cfg: ModelConfig) -> dict[str, int]:
    """The two norm -> projection pairs of a layer: rows of the stacked matrices."""
    return {"qkv": (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, "gate_up": 2 * cfg.ffn_dim}


class _Site:
    """Random folded weights and every buffer the variants need, for one (matrix, T)."""

    def __init__(self, k: Kernels, rows: int, dim: int, T: int, seed: int):
        cp = _cp()
        nd = device_dtype(k.dtype)
        self.w = cp.empty((rows, dim), nd)
        k.fill_uniform(self.w, seed, math.sqrt(3.0 / dim))
        rng = np.random.default_rng(seed)
        self.x = cp.asarray((rng.standard_normal((T, dim)) * 3).astype(np.float32))
        self.ones = cp.ones(dim, cp.float32)
        self.h = cp.empty((T, dim), cp.float32 if T == 1 else nd)         # the normalized x (unfused)
        self.x16 = cp.empty((T, dim), nd)
        k.cast(self.x, self.x16)                                           # "projection alone" reads real values
        self.y = cp.empty((T, rows), cp.float32)
        self.y_raw = cp.empty((T, rows), cp.float32)
        self.s = cp.empty(T, cp.float32)


def _variants(k: Kernels, fk: FlashNormKernels, two: TwoStreamNorm, site: _Site, eps: float) -> dict:
    """name -> a function enqueueing that variant on the current stream."""
    cp = _cp()
    T = site.x.shape[0]
    if T == 1:
        return {
            "projection alone": lambda: k.gemv(site.w, site.x[0], site.y[0]),
            "unfused": lambda: (k.rmsnorm(site.x, site.ones, site.h, eps),
                                k.gemv(site.w, site.h[0], site.y[0])),
            "two-stream": lambda: two(site.x, site.w, site.y_raw, site.s, site.y, eps),
            "fused flashnorm_gemv": lambda: fk.gemv(site.w, site.x[0], site.y[0], eps),
            "gemv.cu v4 norm-fused": lambda: k.gemv_rmsnorm(site.w, site.x[0], site.ones, eps, site.y[0]),
        }
    cur = cp.cuda.get_current_stream
    return {
        "projection alone": lambda: gemm(site.x16, site.w, site.y, k.dtype, cur()),
        "unfused": lambda: (k.rmsnorm(site.x, site.ones, site.h, eps), gemm(site.h, site.w, site.y, k.dtype, cur())),
        "two-stream": lambda: two(site.x, site.w, site.y_raw, site.s, site.y, eps, site.x16),
    }


def _time_us(fn, stream, graph: bool, inner: int, outer: int) -> float | None:
    """Median µs per call of fn: `inner` calls captured as one CUDA graph (GPU time, no Python in it), or
    enqueued eagerly (what a Python engine pays, launch costs included). None if capture fails."""
    cp = _cp()
    with stream:
        fn()
        stream.synchronize()
        step = lambda: [fn() for _ in range(inner)]
        if graph:
            try:
                g = capture(stream, step)
            except Exception:   # noqa: BLE001 - e.g. a library that cannot be captured: report no number
                cp.cuda.Device().synchronize()
                return None
            step = lambda: g.launch(stream)
        return time_gpu(step, outer, warmup=1) * 1000.0 / inner


def benchmark(presets=("smollm2-135m", "mistral-7b"), dtype: str = "float16", prefill_tokens: int = 512,
              quick: bool = False) -> list[dict]:
    """µs per layer (norm -> qkv plus norm -> gate/up) of each variant, decode (T = 1) and prefill.

    Returns rows {preset, phase, variant, graph_us, eager_us}; random folded weights, made on the device."""
    cp = _cp()
    k, fk = Kernels(dtype), FlashNormKernels(dtype)
    two = TwoStreamNorm(k, fk)
    stream = cp.cuda.Stream(non_blocking=True)
    inner, outer = (4, 3) if quick else (20, 15)
    rows = []
    for preset in presets:
        cfg = PRESETS[preset].config
        for phase, T in (("decode", 1), (f"prefill {prefill_tokens}", prefill_tokens)):
            sites = [_Site(k, n, cfg.dim, T, seed) for seed, n in enumerate(_sites(cfg).values(), 1)]
            cp.cuda.Device().synchronize()
            for name in _variants(k, fk, two, sites[0], cfg.norm_eps):
                per = [_variants(k, fk, two, s, cfg.norm_eps)[name] for s in sites]
                timed = {mode: [_time_us(f, stream, mode == "graph", inner, outer) for f in per]
                         for mode in ("graph", "eager")}
                rows.append(dict(preset=preset, phase=phase, variant=name,
                                 **{f"{m}_us": None if None in v else sum(v) for m, v in timed.items()}))
            del sites
    return rows


def print_benchmark(rows: list[dict], dtype: str, print_table=None) -> None:
    """The table: µs per layer and the ratio to the unfused path (graph: GPU time; eager: with launches).
    print_table(title, headers, rows): how to print it (lesson 15 passes the course's; plain columns here)."""
    print_table = print_table or plain_table
    base = {(r["preset"], r["phase"]): r for r in rows if r["variant"] == "unfused"}

    def cell(r, mode):
        us, ref = r[f"{mode}_us"], base[(r["preset"], r["phase"])][f"{mode}_us"]
        if us is None:
            return "(no capture)"
        return f"{us:8.1f}" + (f"  {us / ref:4.2f}x" if ref else "")
    print_table(f"FlashNorm micro-benchmark, {dtype}: µs per layer (norm -> qkv + norm -> gate/up), "
                f"ratio to unfused", ["model", "phase", "variant", "graph µs (ratio)", "eager µs (ratio)"],
                [[r["preset"], r["phase"], r["variant"], cell(r, "graph"), cell(r, "eager")] for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="FlashNorm: unfused vs two-stream vs fused, µs per layer; "
                                                 "--e2e: whole decode steps with FlashNorm at every norm site")
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--e2e", action="store_true", help="whole decode steps: production v4 vs deferred vs fused "
                        "(logits checked first), tok/s, GB/s, %% of the copy roofline, launches per step")
    parser.add_argument("--presets", default="smollm2-135m,mistral-7b", help="--e2e: comma-separated shapes")
    parser.add_argument("--tokens", type=int, default=128, help="--e2e: decode tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="--e2e: timed runs per variant (median)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.presets.split(",") if p not in PRESETS]
    if unknown or args.tokens < 1 or args.repeats < 1:
        print(f"minillm.cuda.dev.flashnorm: unknown preset(s) {', '.join(unknown)}" if unknown else
              "minillm.cuda.dev.flashnorm: --tokens and --repeats must be at least 1", file=sys.stderr)
        return 2
    from minillm.cuda import available
    if not available():
        print("minillm.cuda.dev.flashnorm: no CUDA device (or no CuPy): nothing to time", file=sys.stderr)
        return 1
    from minillm.cuda.timing import device_name
    print(f"device: {device_name()}")
    if args.e2e:
        tokens, repeats = (16, 1) if args.quick else (args.tokens, args.repeats)
        rows = e2e(tuple(args.presets.split(",")), args.dtype, n_new=tokens, repeats=repeats)
        print_e2e(rows, args.dtype, tokens)
        failed = [f"{r['preset']} {r['variant']}" for r in rows if r["error"]]
        print(f"e2e: {len(failed)} FAILED: {', '.join(failed)}" if failed else "e2e: every variant matched and was timed")
        return 1 if failed else 0
    print_benchmark(benchmark(dtype=args.dtype, quick=args.quick), args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
