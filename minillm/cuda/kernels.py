"""Load `kernels/*.cu` as CuPy RawModules and launch them with documented shapes.

Every kernel takes 16-bit weights as raw bits (`cupy.float16`, or `cupy.uint16` holding bf16: the same
convention as the CPU side's `np.uint16`), fp32 activations, and reads positions and token ids from
device buffers so that a captured CUDA graph sees new values on each replay. Scalars are passed as
explicit `np.int32` / `np.float32` (CuPy would otherwise guess a C type from a Python int).

All launches go on CuPy's current stream. `Kernels.timer`, when set, wraps each launch (per-kernel
CUDA-event timings for the selfcheck).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
SOURCES = ["rmsnorm", "rope", "swiglu", "kv_append", "decode_attention", "prefill_attention", "gemv", "embed"]
ATTN_WARPS, MAX_HD = 4, 256            # as #defined in decode_attention.cu
V4_WARPS = 4                           # as #defined in gemv.cu (row pairs per block)
PF_ROWS, PF_THREADS = 32, 128          # as #defined in prefill_attention.cu (query rows, threads per block)
PF_HDS = (32, 64, 128)                 # its compile-time head_dim bounds (hd <= HD, hd % 4 == 0)
MAX_FUSED_NORM = 12000                 # gemv_rmsnorm_v3 keeps in floats in shared memory (+ static): < 48 KB


def kernel_source(name: str) -> str:
    """The text of kernels/NAME.cu with `#include "common.cuh"` pasted in.

    Pasting (rather than -I) keeps NVRTC free of include paths and makes CuPy's compile cache,
    keyed by the source text, notice a change to common.cuh."""
    common = (KERNEL_DIR / "common.cuh").read_text()
    return (KERNEL_DIR / f"{name}.cu").read_text().replace('#include "common.cuh"', common)


def suffix(dtype) -> str:
    """Kernel-name suffix for a weight dtype: float16 -> f16, bfloat16 (uint16 bits) -> bf16."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name in ("float16",):
        return "f16"
    if name in ("bfloat16", "uint16"):
        return "bf16"
    raise ValueError(f"no GPU kernels for weight dtype {name!r} (float16 or bfloat16)")


_modules: dict[str, object] = {}


def module(name: str):
    """The compiled RawModule of kernels/NAME.cu (compiled once per process, cached on disk by CuPy)."""
    import cupy as cp
    if name not in _modules:
        _modules[name] = cp.RawModule(code=kernel_source(name), options=("--std=c++17",))
    return _modules[name]


def _grid_for(n: int, block: int = 256, cap: int = 132 * 16) -> int:
    return max(1, min(cap, (n + block - 1) // block))


class Kernels:
    """Launch helpers for one weight dtype ("float16" or "bfloat16"). Every function is fetched at
    construction, so nothing compiles or loads while a CUDA graph is being captured."""

    def __init__(self, dtype: str = "float16"):
        self.dtype = dtype
        sfx = suffix(dtype)
        get = lambda mod, fn: module(mod).get_function(fn)
        self.fn = {
            "rmsnorm": get("rmsnorm", "rmsnorm_f32"),
            "rmsnorm_narrow": get("rmsnorm", f"rmsnorm_to_{sfx}"),
            "rope": get("rope", "rope_qk"),
            "swiglu": get("swiglu", "swiglu_f32"),
            "swiglu_narrow": get("swiglu", f"swiglu_to_{sfx}"),
            "kv_append": get("kv_append", f"kv_append_{sfx}"),
            "attention_split": get("decode_attention", f"attention_split_{sfx}"),
            "attention_combine": get("decode_attention", "attention_combine"),
            "gemv_v1": get("gemv", f"gemv_v1_{sfx}"),
            "gemv_v2": get("gemv", f"gemv_v2_{sfx}"),
            "gemv_rmsnorm_v3": get("gemv", f"gemv_rmsnorm_v3_{sfx}"),
            "gemv_v4": get("gemv", f"gemv_v4_{sfx}"),
            "gemv_rmsnorm_v4": get("gemv", f"gemv_rmsnorm_v4_{sfx}"),
            "gemv_swiglu_v4": get("gemv", f"gemv_swiglu_v4_{sfx}"),
            "gemv_rmsnorm_swiglu_v4": get("gemv", f"gemv_rmsnorm_swiglu_v4_{sfx}"),
            "gemv_qkv_v4": get("gemv", f"gemv_qkv_v4_{sfx}"),
            "gemv_rmsnorm_qkv_v4": get("gemv", f"gemv_rmsnorm_qkv_v4_{sfx}"),
            "attention_fused": get("decode_attention", f"attention_fused_{sfx}"),
            "prefill_attention_hd32": get("prefill_attention", f"prefill_attention_hd32_{sfx}"),
            "prefill_attention_hd64": get("prefill_attention", f"prefill_attention_hd64_{sfx}"),
            "prefill_attention_hd128": get("prefill_attention", f"prefill_attention_hd128_{sfx}"),
            "embed": get("embed", f"embed_{sfx}"),
            "cast": get("embed", f"cast_to_{sfx}"),
            "fill_uniform": get("embed", f"fill_uniform_{sfx}"),
        }
        for f in self.fn.values():          # force NVRTC + module load now, not during a capture
            getattr(f, "attributes", None)
        import cupy as cp
        # stand-ins for the pointer arguments a v4 variant does not use (never dereferenced)
        self._nil_f32 = cp.zeros(8, cp.float32)
        self._nil_u16 = cp.zeros(8, cp.uint16)
        self._nil_i32 = cp.zeros(8, cp.int32)
        self.timer = None

    def _launch(self, name: str, grid, block, args, label: str = "", shared_mem: int = 0) -> None:
        fn = self.fn[name]
        if self.timer is None:
            fn(grid, block, args, shared_mem=shared_mem)
        else:
            self.timer(f"{name} {label}".strip(), lambda: fn(grid, block, args, shared_mem=shared_mem))

    # ---- the kernels ---------------------------------------------------------------------------
    def rmsnorm(self, x, gain, out, eps: float) -> None:
        """x [T, dim] fp32, gain [dim] fp32 -> out [T, dim], fp32 or narrow (the weight dtype)."""
        T, dim = x.shape
        name = "rmsnorm" if out.dtype == np.float32 else "rmsnorm_narrow"
        self._launch(name, (T,), (256,), (x, gain, out, np.int32(dim), np.float32(eps)))

    def gemv(self, w, x, y, accumulate: bool = False, version: int = 2, label: str = "") -> None:
        """y [rows] fp32 (+)= w [rows, in] · x [in] fp32; in % 8 == 0. `label` names it for the timer.
        version 1, 2 (8 rows a block, one warp a row) or 4 (two rows a warp, 16 loads in flight a lane)."""
        rows, n_in = w.shape
        if n_in % 8:
            raise ValueError(f"gemv needs in % 8 == 0, got {n_in}")
        if version >= 4:
            self._v4("gemv_v4", w, x, None, 0.0, y, (rows + 1) // 2, accumulate, label)
            return
        self._launch(f"gemv_v{version}", ((rows + 7) // 8,), (256,),
                     (w, x, y, np.int32(rows), np.int32(n_in), np.int32(1 if accumulate else 0)), label)

    def _v4(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None) -> None:
        """Launch a gemv.cu v4 variant: one warp per row pair, V4_WARPS pairs a block."""
        rows, n_in = w.shape
        if n_in % 8:
            raise ValueError(f"gemv needs in % 8 == 0, got {n_in}")
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        if qkv is None:
            kc = vc = self._nil_u16
            capacity, pos, inv_freq, n_heads, n_kv_heads, hd = 0, self._nil_i32, self._nil_f32, 0, 0, 0
        else:
            kc, vc, pos, inv_freq, n_heads, n_kv_heads, hd = qkv
            capacity = kc.shape[1]
        self._launch(name, ((pairs + V4_WARPS - 1) // V4_WARPS,), (32 * V4_WARPS,),
                     (w, x, self._nil_f32 if gain is None else gain, np.float32(eps), y, np.int32(rows),
                      np.int32(n_in), np.int32(1 if accumulate else 0), kc, vc, np.int32(capacity), pos,
                      inv_freq, np.int32(n_heads), np.int32(n_kv_heads), np.int32(hd)), label)

    def gemv_swiglu(self, w, x, gain, eps: float, out, label: str = "") -> None:
        """out [ffn] fp32 = silu(g) · u, [g; u] = w [2 ffn, in] · x, with x = rmsnorm(x, gain) when gain is
        not None (v4: the gate/up vector never reaches memory)."""
        rows = w.shape[0]
        if rows % 2 or out.shape != (rows // 2,):
            raise ValueError(f"gemv_swiglu: w has {rows} rows (gate; up), out {out.shape}")
        self._v4("gemv_swiglu_v4", w, x, gain, eps, out, rows // 2, label=label)

    def gemv_qkv(self, w, x, gain, eps: float, qkv, pos, inv_freq, k_cache, v_cache, n_heads: int,
                 n_kv_heads: int, head_dim: int, label: str = "") -> None:
        """One decode token: qkv [width] fp32 = w · x (x = rmsnorm(x, gain) when gain is not None), RoPE on
        the q and k heads at position pos[0], k and v into k_cache, v_cache [n_kv_heads, capacity, hd]
        (one layer) at pos[0]: rmsnorm + GEMV + rope + kv_append in one v4 launch."""
        rows = w.shape[0]
        if rows != (n_heads + 2 * n_kv_heads) * head_dim or head_dim % 2 or qkv.shape != (rows,):
            raise ValueError(f"gemv_qkv: w {w.shape}, qkv {qkv.shape}, heads {n_heads}+2x{n_kv_heads} x {head_dim}")
        self._v4("gemv_qkv_v4", w, x, gain, eps, qkv, rows // 2, label=label,
                 qkv=(k_cache, v_cache, pos, inv_freq, n_heads, n_kv_heads, head_dim))

    def gemv_rmsnorm(self, w, x, gain, eps: float, y, label: str = "", version: int = 3) -> None:
        """y [rows] fp32 = w [rows, in] · rmsnorm(x [in] fp32, gain [in] fp32): the norm fused in.
        version 3: a block reduction into shared memory (in <= MAX_FUSED_NORM); 4: each warp sums x² itself."""
        rows, n_in = w.shape
        if version >= 4:
            self._v4("gemv_v4", w, x, gain, eps, y, (rows + 1) // 2, label=label)
            return
        if n_in % 8 or n_in > MAX_FUSED_NORM:
            raise ValueError(f"gemv_rmsnorm needs in % 8 == 0 and in <= {MAX_FUSED_NORM}, got {n_in}")
        self._launch("gemv_rmsnorm_v3", ((rows + 15) // 16,), (512,),
                     (w, x, gain, np.float32(eps), y, np.int32(rows), np.int32(n_in)), label, shared_mem=4 * n_in)

    def rope(self, qkv, n_tokens: int, n_rotated_heads: int, head_dim: int, pos, inv_freq) -> None:
        """Rotate the first n_rotated_heads (= n_heads + n_kv_heads) heads of each qkv row [T, width],
        in place; token t at position pos[0] + t."""
        self._launch("rope", (n_tokens, n_rotated_heads), (head_dim // 2,),
                     (qkv, np.int32(qkv.shape[-1]), np.int32(head_dim), pos, inv_freq))

    def kv_append(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  k_cache, v_cache, pos) -> None:
        """k/v of each qkv row [T, width] -> k_cache, v_cache [n_kv_heads, capacity, hd] at pos[0] + t."""
        capacity = k_cache.shape[1]
        self._launch("kv_append", (n_tokens, n_kv_heads), (min(head_dim, 256),),
                     (qkv, np.int32(qkv.shape[-1]), np.int32(n_heads), np.int32(n_kv_heads),
                      np.int32(head_dim), k_cache, v_cache, np.int32(capacity), pos))

    def attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache, v_cache,
                  pos, window: int | None, parts, out) -> None:
        """Queries of each qkv row [T, width] against one layer's cache -> out [T, n_heads * hd] fp32.

        parts = (m [T, H, S], l [T, H, S], acc [T, H, S, hd]) fp32 scratch; S = n_splits is parts' last
        dim. Query t sits at pos[0] + t; window None or 0 = full causal. A fourth element, counters
        [T, H] uint32 zero-filled (and left zero), selects the one-launch kernel with the combine fused."""
        if head_dim > MAX_HD:
            raise ValueError(f"head_dim {head_dim} > {MAX_HD}")
        part_m, part_l, part_acc = parts[:3]
        n_splits = part_m.shape[-1]
        capacity = k_cache.shape[1]
        args = (qkv, np.int32(qkv.shape[-1]), k_cache, v_cache, np.int32(capacity), np.int32(n_heads),
                np.int32(n_kv_heads), np.int32(head_dim), pos, np.int32(window or 0),
                np.float32(1.0 / math.sqrt(head_dim)), part_m, part_l, part_acc)
        if len(parts) == 4:              # v2: the combine fused into the last split block (parts[3]: counters)
            counters = parts[3]
            if counters.dtype != np.uint32 or counters.size < n_tokens * n_heads:
                raise ValueError("attention counters: uint32 [T, n_heads], zero-filled")
            self._launch("attention_fused", (n_heads, n_splits, n_tokens), (32 * ATTN_WARPS,), args + (counters, out))
            return
        self._launch("attention_split", (n_heads, n_splits, n_tokens), (32 * ATTN_WARPS,), args)
        self._launch("attention_combine", (n_heads, n_tokens), (128,),
                     (part_m, part_l, part_acc, out, np.int32(n_heads), np.int32(head_dim), np.int32(n_splits)))

    @staticmethod
    def prefill_attention_supported(head_dim: int) -> bool:
        """Does prefill_attention.cu have a variant for this head_dim? (else: the decode kernel)"""
        return head_dim % 4 == 0 and head_dim <= PF_HDS[-1]

    def prefill_attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache,
                          v_cache, pos, window: int | None, out) -> None:
        """Tiled prefill attention (prefill_attention.cu): the T queries of each qkv row [T, width] at
        pos[0] + t against one layer's cache (their own keys already appended) -> out [T, n_heads * hd]
        fp32. Blocks of 32 (token, query head) rows of one KV head's group share K/V tiles in shared
        memory. No scratch. head_dim % 4 == 0 and <= 128 (see prefill_attention_supported)."""
        if not self.prefill_attention_supported(head_dim):
            raise ValueError(f"prefill_attention: head_dim {head_dim} (needs % 4 == 0 and <= {PF_HDS[-1]})")
        if n_heads % n_kv_heads:
            raise ValueError(f"prefill_attention: {n_heads} heads not a multiple of {n_kv_heads} KV heads")
        hd_max = next(h for h in PF_HDS if head_dim <= h)
        group = n_heads // n_kv_heads
        tiles = (n_tokens * group + PF_ROWS - 1) // PF_ROWS
        self._launch(f"prefill_attention_hd{hd_max}", (tiles, n_kv_heads), (PF_THREADS,),
                     (qkv, np.int32(qkv.shape[-1]), k_cache, v_cache, np.int32(k_cache.shape[1]),
                      np.int32(n_tokens), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim), pos,
                      np.int32(window or 0), np.float32(1.0 / math.sqrt(head_dim)), out))

    def swiglu(self, gu, out) -> None:
        """gu [T, 2 * ffn] fp32 (gate | up) -> out [T, ffn], fp32 or narrow."""
        T, ffn = out.shape
        name = "swiglu" if out.dtype == np.float32 else "swiglu_narrow"
        self._launch(name, (_grid_for(T * ffn),), (256,), (gu, out, np.int32(ffn), np.int32(T)))

    def embed(self, tokens, table, out) -> None:
        """tokens [T] int32 (device), table [vocab, dim] -> out [T, dim] fp32."""
        T, dim = out.shape
        self._launch("embed", (T,), (256,), (tokens, table, out, np.int32(dim)))

    def cast(self, x, out) -> None:
        """x fp32 -> out narrow, same number of elements."""
        self._launch("cast", (_grid_for(x.size),), (256,), (x, out, np.uint64(x.size)))

    def fill_uniform(self, out, seed: int, scale: float) -> None:
        """out (narrow) = scale · uniform[-1, 1), from a hash of (seed, index): random weights on the device."""
        self._launch("fill_uniform", (_grid_for(out.size, cap=132 * 64),), (256,),
                     (out, np.uint64(out.size), np.uint32(seed), np.float32(scale)))


def n_splits_for(n_heads: int, capacity: int, n_sms: int = 132) -> int:
    """Flash-decoding splits: enough (head, split) blocks to cover the SMs about 4 times, but never
    splits shorter than 16 keys at full capacity."""
    want = math.ceil(4 * n_sms / n_heads)
    return int(max(1, min(want, 64, math.ceil(capacity / 16))))
