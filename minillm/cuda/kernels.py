"""Load `kernels/*.cu` as CuPy RawModules and launch them with documented shapes.

Every kernel takes 16-bit weights as raw bits (`cupy.float16`, or `cupy.uint16` holding bf16, as the CPU side's
`np.uint16`), fp32 activations, and reads positions and token ids from device buffers, so a captured CUDA graph
sees new values on each replay. Scalars are passed as `np.int32` / `np.float32` (CuPy would guess a C type from a
Python int). Launches go on CuPy's current stream; `Kernels.timer`, when set, wraps each (per-kernel CUDA events).

One kernel an operation, the fastest measured (lessons/BENCHMARKS.md), and a named fallback only for the shapes it
cannot take: decode attention v2 (`attention_fused`) where head_dim % 8 or the query heads are not whole groups,
8 int8 codes a lane where head_dim % 16, the fp32 prefill tiles where head_dim is not 64 or 128. A GEMV launcher
takes a 16-bit matrix (gemv.cu v4) or a `qweights.QuantMatrix` (gemv_quant.cu), with the same fused prologue and
epilogues. Earlier versions and the experiments that lost live in minillm/cuda/dev (its lab.py launches them).
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from minillm.cuda import pdl
from minillm.cuda.qweights import is_quantized
from minillm.errors import MiniLLMError
from minillm.resources import data_dir

KERNEL_DIR = data_dir("kernels")          # the checkout's kernels/, or an installed wheel's copy
SOURCES = ["rmsnorm", "rope", "swiglu", "kv_append", "kv_int8", "decode_attention", "prefill_attention",
           "prefill_attention_mma", "gemv", "embed", "gemv_quant",
           "paged_attention", "sampling"]   # these two: loaded by forward.DeviceOps (the batching engine)
ATTN_WARPS, MAX_HD = 4, 256            # as #defined in decode_attention.cu
GQA_THREADS, GQA_MAX_SPLITS = 256, 64  # decode_attention.cu v3 (attention_gqa*): block size, most splits
V4_WARPS = 4                           # as #defined in gemv.cu (row pairs per block)
PF_ROWS, PF_THREADS = 32, 128          # as #defined in prefill_attention.cu (query rows, threads per block)
PF_HDS = (32, 64, 128)                 # its compile-time head_dim bounds (hd <= HD, hd % 4 == 0)
MM_ROWS, MM_THREADS = 64, 128          # as #defined in prefill_attention_mma.cu (query rows, threads per block)
MM_HDS = (64, 128)                     # its head_dims (exactly)
QWARPS = 8                             # as #defined in gemv_quant.cu (row pairs per block)
QUANT_CHUNK = {"int8": 16, "int4": 32} # weights per 16-byte load = values of x staged per chunk (gemv_quant.cu)
QUANT_BLOCKS_PER_SM = 2                # gemv_quant.cu grid: ~this many blocks per SM, looping over row pairs
QKV_BLOCKS_PER_SM = 3                  # as #defined there (Q_QKV_MIN_BLOCKS): the grid of its int8 q|k|v _3b kernels
GEMV_VARIANTS = ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_", "qkv_", "rmsnorm_qkv_")   # fused prologue/epilogue
# The kernels that wait for the kernel ahead before reading their inputs (pdl_wait in kernels/common.cuh), and so
# may be launched with programmatic dependent launch (settings.pdl): the decode step's embed, GEMVs (16-bit v4
# and every gemv_quant.cu GEMV) and attention v3. Any other kernel launched so would race.
PDL_KERNEL = re.compile(r"embed|gemv_(rmsnorm_)?(swiglu_|qkv_)?(v4|int8|int4)(_3b)?|attention_gqa[124](_int8(x16)?)?")
PDL_ARCH = 90          # compute capability 9.0 (Hopper) and up launch with PDL; sm_80 / sm_89 the same kernels without
MIN_ARCH = 80          # below it (no bf16 mma.sync) Kernels refuses in one line


def kernel_table(sfx: str) -> dict[str, tuple[str, str]]:
    """What Kernels loads for weights of suffix sfx ("f16", "bf16"): {key: (source in kernels/, kernel name)}."""
    table = {"rmsnorm": ("rmsnorm", "rmsnorm_f32"), "rmsnorm_narrow": ("rmsnorm", f"rmsnorm_to_{sfx}"),
             "rope": ("rope", "rope_qk"), "swiglu": ("swiglu", "swiglu_f32"),
             "swiglu_narrow": ("swiglu", f"swiglu_to_{sfx}"), "kv_append": ("kv_append", f"kv_append_{sfx}"),
             "attention_fused": ("decode_attention", f"attention_fused_{sfx}")}
    for gm in (1, 2, 4):           # attention v3, gm query heads a block: the 16-bit cache, int8 codes 8 or 16 a lane
        table[f"attention_gqa{gm}"] = ("decode_attention", f"attention_gqa{gm}_{sfx}")
        for codes in ("_int8", "_int8x16"):
            table[f"attention_gqa{gm}{codes}"] = ("decode_attention", f"attention_gqa{gm}{codes}")
    for v in GEMV_VARIANTS:
        table[f"gemv_{v}v4"] = ("gemv", f"gemv_{v}v4_{sfx}")
    table |= {"kv_append_int8": ("kv_int8", "kv_append_int8"), "kv_dequant": ("kv_int8", f"kv_dequant_{sfx}")}
    for hd in PF_HDS:
        table[f"prefill_attention_hd{hd}"] = ("prefill_attention", f"prefill_attention_hd{hd}_{sfx}")
    for hd in MM_HDS:
        table[f"prefill_attention_mma_hd{hd}"] = ("prefill_attention_mma", f"prefill_attention_mma_hd{hd}_{sfx}")
    table |= {"embed": ("embed", f"embed_{sfx}"), "cast": ("embed", f"cast_to_{sfx}"),
              "fill_uniform": ("embed", f"fill_uniform_{sfx}"), "fill_random_words": ("gemv_quant", "fill_random_words")}
    for kind in ("int8", "int4"):  # gemv_quant.cu's twins of the v4 variants (int8's q|k|v: its own 3-block build)
        for v in GEMV_VARIANTS:
            name = f"gemv_{v}{kind}" + ("_3b" if kind == "int8" and "qkv" in v else "")
            table[name] = ("gemv_quant", f"{name}_{sfx}")
        table[f"dequant_{kind}"] = ("gemv_quant", f"dequant_{kind}_{sfx}")
    return table


def kernel_source(name: str, folder: Path = KERNEL_DIR) -> str:
    """The text of FOLDER/NAME.cu with every `#include "X.cuh"` (or "X.cu") pasted in, each once; an included
    file is looked for in `folder`, then in kernels/ (so minillm/cuda/dev's kernels build on the shipped ones).
    Pasting (not -I) keeps NVRTC free of include paths, and CuPy's compile cache (keyed by the text) sees headers."""
    return _paste_includes((folder / f"{name}.cu").read_text(), set(), folder)


def _paste_includes(text: str, seen: set, folder: Path) -> str:
    def paste(match) -> str:
        header = match.group(1)
        if header in seen:                          # `#pragma once`, done by hand
            return ""
        seen.add(header)
        path = folder / header if (folder / header).exists() else KERNEL_DIR / header
        return _paste_includes(path.read_text(), seen, folder)
    return re.sub(r'^#include "([\w.]+\.cuh?)"$', paste, text, flags=re.M)


def suffix(dtype) -> str:
    """Kernel-name suffix for a weight dtype: float16 -> f16, bfloat16 (uint16 bits) -> bf16."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name in ("float16", "bfloat16", "uint16"):
        return "f16" if name == "float16" else "bf16"
    raise ValueError(f"no GPU kernels for weight dtype {name!r} (float16 or bfloat16)")


_modules: dict[tuple, object] = {}


def module(name: str, folder: Path = KERNEL_DIR):
    """The compiled RawModule of FOLDER/NAME.cu (compiled once per process, cached on disk by CuPy)."""
    import cupy as cp
    if (folder, name) not in _modules:
        _modules[folder, name] = cp.RawModule(code=kernel_source(name, folder), options=("--std=c++17",))
    return _modules[folder, name]


def _grid_for(n: int, block: int = 256, cap: int = 132 * 16) -> int:
    return max(1, min(cap, (n + block - 1) // block))


@dataclass(frozen=True)
class KernelSettings:
    """The launch tunings a benchmark compares (defaults: the fastest measured, lessons/BENCHMARKS.md). Frozen and
    hashable: a captured CUDA graph is keyed by the settings it was captured with."""
    quant_blocks_per_sm: int = QUANT_BLOCKS_PER_SM  # gemv_quant.cu's grid, each warp looping over row pairs (0: none)
    attention_split_keys: int = 0    # decode attention v3: the fewest keys a split holds (0: one tile)
    attention_one_wave: bool = True  # v3: at most a block an SM (a second wave costs more than fewer splits)
    pdl: bool = True                 # programmatic dependent launch in a graph (pdl.py): Hopper only, logits unchanged


class Kernels:
    """Launch helpers for one weight dtype ("float16" or "bfloat16"). Every function is fetched at construction
    (kernel_table), so nothing compiles while a CUDA graph is captured. `settings` are read at each launch: a
    graph keeps the values it was captured with, so its owner keys it by them (graph.GraphDecode)."""

    def __init__(self, dtype: str = "float16", settings: KernelSettings = KernelSettings()):
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.arch = 10 * props["major"] + props["minor"]      # compute capability: 90 Hopper, 80 A100, 89 Ada
        if self.arch < MIN_ARCH:                              # the tensor-core prefill's mma.sync, bf16 math
            raise MiniLLMError(f"minillm's GPU kernels need compute capability 8.0 or newer (sm_80, an A100); "
                               f"this GPU is sm_{self.arch}: run it with --device cpu")
        self.dtype, self.settings, self.timer, self.n_sms = dtype, settings, None, props["multiProcessorCount"]
        self.fn = {key: module(src).get_function(name) for key, (src, name) in kernel_table(suffix(dtype)).items()}
        # gemv_quant.cu stages x in dynamic shared memory: a 14336-wide int8 row needs 72 KB (> the 48 KB default),
        # so each quantized GEMV may use the device's opt-in maximum (97: cudaDevAttrMaxSharedMemoryPerBlockOptin),
        # less 4 KB for the kernels' own __shared__ arrays (<= 1.2 KB); set here, never mid-capture.
        optin = props.get("sharedMemPerBlockOptin") or cp.cuda.runtime.deviceGetAttribute(97, cp.cuda.Device().id)
        self.max_quant_smem = optin - 4096
        for name, f in self.fn.items():
            getattr(f, "attributes", None)                    # NVRTC + module load now, not during a capture
            if name.startswith("gemv_") and ("int8" in name or "int4" in name):
                f.max_dynamic_shared_size_bytes = self.max_quant_smem
        # stand-ins for the pointer arguments a variant does not use (never dereferenced)
        self._nil_f32, self._nil_u16, self._nil_i32 = (cp.zeros(8, t) for t in (cp.float32, cp.uint16, cp.int32))

    def with_settings(self, **changes) -> "Kernels":
        """These kernels launched with some settings changed: a copy sharing the loaded functions."""
        other = copy.copy(self)
        other.settings = replace(self.settings, **changes)
        return other

    def uses_pdl(self, name: str) -> bool:
        """Is kernel `name` launched with programmatic dependent launch (in a captured graph) here?"""
        return self.settings.pdl and self.arch >= PDL_ARCH and PDL_KERNEL.fullmatch(name) is not None

    def _launch(self, name: str, grid, block, args, label: str = "", shared_mem: int = 0) -> None:
        # PDL only into a CUDA graph, where a launch's cost is paid once; eagerly its ctypes call would cost more
        # host time than CuPy's launch (and eager steps are host-bound: lesson 13).
        def launch():
            if self.uses_pdl(name) and _capturing():
                pdl.launch(self.fn[name], grid, block, args, shared_mem)
            else:
                self.fn[name](grid, block, args, shared_mem=shared_mem)
        if self.timer is None:
            launch()
        else:
            self.timer(f"{name} {label}".strip(), launch)

    # ---- the kernels ---------------------------------------------------------------------------
    def rmsnorm(self, x, gain, out, eps: float) -> None:
        """x [T, dim] fp32, gain [dim] fp32 -> out [T, dim], fp32 or narrow (the weight dtype)."""
        T, dim = x.shape
        name = "rmsnorm" if out.dtype == np.float32 else "rmsnorm_narrow"
        self._launch(name, (T,), (256,), (x, gain, out, np.int32(dim), np.float32(eps)))

    def gemv(self, w, x, y, accumulate: bool = False, label: str = "") -> None:
        """y [rows] fp32 (+)= w [rows, in] · x [in] fp32 (16-bit w: in % 8 == 0). `label` names it for the timer."""
        self._v4("gemv_v4", w, x, None, 0.0, y, (w.shape[0] + 1) // 2, accumulate, label)

    def _v4(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None) -> None:
        """Launch gemv.cu's v4 variant `name` (a warp a row pair, V4_WARPS pairs a block), or its gemv_quant.cu twin."""
        if is_quantized(w):
            self._quant(name, w, x, gain, eps, y, pairs, accumulate, label, qkv)
            return
        rows, n_in = w.shape
        if n_in % 8:
            raise ValueError(f"gemv needs in % 8 == 0, got {n_in}")
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        kc, vc, capacity, pos, inv_freq, n_heads, n_kv_heads, hd = self._qkv_args(qkv)
        self._launch(name, ((pairs + V4_WARPS - 1) // V4_WARPS,), (32 * V4_WARPS,),
                     (w, x, self._nil_f32 if gain is None else gain, np.float32(eps), y, np.int32(rows),
                      np.int32(n_in), np.int32(1 if accumulate else 0), kc, vc, np.int32(capacity), pos,
                      inv_freq, np.int32(n_heads), np.int32(n_kv_heads), np.int32(hd)), label)

    def _quant(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None) -> None:
        """The gemv_quant.cu twin of v4 variant `name` for a QuantMatrix w, same epilogues. x is staged in shared
        memory (fp16, chunk/2 + 4 words and 2^-e a chunk, + Σx for int4), so `in` need not be a multiple of 8."""
        rows, n_in = w.shape
        name = name.replace("_v4", f"_{w.method}")
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        chunk, sums = QUANT_CHUNK[w.method], (4 * w.n_chunks if w.method == "int4" else 0)
        cpg = max(1, w.group_size // 32)                       # 16-byte chunks per int4 group
        smem = w.n_chunks * (chunk // 2 + 5) * 4 + sums
        grid = self.quant_grid(pairs)
        if "qkv" in name and w.method == "int8":
            # int8's q|k|v: its own build, 3 blocks an SM, one round of the row pairs (int4 measured slower so)
            name += "_3b"
            grid = self.quant_grid(pairs, QKV_BLOCKS_PER_SM)
        if smem > self.max_quant_smem:
            raise ValueError(f"{name}: a {n_in}-wide row needs {smem} bytes of shared memory for x "
                             f"(this device allows {self.max_quant_smem})")
        self._launch(name, (grid,), (32 * QWARPS,),
                     self._quant_args(w.qweight, w.scales, self._nil_u16 if w.mins is None else w.mins, w.n_chunks,
                                      w.n_groups, cpg, x, gain, eps, n_in, pairs, y, rows, accumulate, qkv),
                     label, shared_mem=smem)

    def _quant_args(self, qw, scales, mins, n_chunks, n_groups, cpg, x, gain, eps, n_in, pairs, y, rows, accumulate,
                    qkv) -> tuple:
        """The one signature of gemv_quant.cu's GEMVs (cpg: 16-byte chunks an int4 group, and its log2 or -1)."""
        shift = cpg.bit_length() - 1 if cpg & (cpg - 1) == 0 else -1
        kc, vc, capacity, pos, inv_freq, n_heads, n_kv_heads, hd = self._qkv_args(qkv)
        return (qw, scales, mins, np.int32(n_chunks), np.int32(n_groups), np.int32(cpg), np.int32(shift), x,
                self._nil_f32 if gain is None else gain, np.float32(eps), np.int32(n_in), np.int32(pairs), y,
                np.int32(rows), np.int32(1 if accumulate else 0), kc, vc, np.int32(capacity), pos, inv_freq,
                np.int32(n_heads), np.int32(n_kv_heads), np.int32(hd))

    def _qkv_args(self, qkv) -> tuple:
        """The EPI_QKV epilogue's arguments from gemv_qkv's tuple, stand-ins without one; k_cache None: RoPE only,
        no append (capacity 0: the int8 cache quantizes the row with its own kernel after)."""
        if qkv is None:
            return self._nil_u16, self._nil_u16, 0, self._nil_i32, self._nil_f32, 0, 0, 0
        kc, vc, pos, inv_freq, n_heads, n_kv_heads, hd = qkv
        if kc is None:
            return self._nil_u16, self._nil_u16, 0, pos, inv_freq, n_heads, n_kv_heads, hd
        return kc, vc, kc.shape[1], pos, inv_freq, n_heads, n_kv_heads, hd

    def quant_grid(self, pairs: int, per_sm: int | None = None) -> int:
        """Blocks for a quantized GEMV over `pairs` row pairs: about per_sm (settings.quant_blocks_per_sm) an SM,
        each warp taking the same number of pairs in turn (0: one pair a warp)."""
        need = -(-pairs // QWARPS)
        per_sm = self.settings.quant_blocks_per_sm if per_sm is None else per_sm
        if not per_sm:
            return need
        per_warp = -(-need // (per_sm * self.n_sms))
        return -(-need // per_warp)

    def dequantize(self, w, out) -> None:
        """out [rows, in] (16-bit, the weight dtype) = the QuantMatrix w, widened for prefill's cuBLAS GEMM."""
        rows, n_in = w.shape
        if out.shape != (rows, n_in):
            raise ValueError(f"dequantize: w {w.shape}, out {out.shape}")
        mins = self._nil_u16 if w.mins is None else w.mins
        self._launch(f"dequant_{w.method}", (_grid_for(rows * -(-n_in // 8), cap=132 * 32),), (256,),
                     (w.qweight, w.scales, mins, np.int32(w.qweight.shape[1]), np.int32(w.n_groups),
                      np.int32(max(1, w.group_size)), out, np.int32(rows), np.int32(n_in)))

    def fill_random_words(self, out, seed: int) -> None:
        """Random bits into any device array whose size is whole 32-bit words (random int8/int4 codes)."""
        if out.nbytes % 4:
            raise ValueError("fill_random_words: the array must be whole 32-bit words")
        n = out.nbytes // 4
        self._launch("fill_random_words", (_grid_for(n, cap=132 * 64),), (256,), (out, np.uint64(n), np.uint32(seed)))

    def gemv_swiglu(self, w, x, gain, eps: float, out, label: str = "") -> None:
        """out [ffn] fp32 = silu(g) · u, [g; u] = w [2 ffn, in] · x (x = rmsnorm(x, gain) unless gain is None)."""
        rows = w.shape[0]
        if rows % 2 or out.shape != (rows // 2,):
            raise ValueError(f"gemv_swiglu: w has {rows} rows (gate; up), out {out.shape}")
        self._v4("gemv_swiglu_v4", w, x, gain, eps, out, rows // 2, label=label)

    def gemv_qkv(self, w, x, gain, eps: float, qkv, pos, inv_freq, k_cache, v_cache, n_heads: int,
                 n_kv_heads: int, head_dim: int, label: str = "") -> None:
        """One decode token's rmsnorm + GEMV + RoPE + KV append in one launch: qkv [width] fp32 = w · rmsnorm(x, gain),
        q and k heads rotated at pos[0], k and v into one layer's k_cache, v_cache [n_kv_heads, capacity, hd]
        (None: no append; the int8 cache quantizes them from qkv next, kv_append_int8)."""
        rows = w.shape[0]
        if rows != (n_heads + 2 * n_kv_heads) * head_dim or head_dim % 2 or qkv.shape != (rows,):
            raise ValueError(f"gemv_qkv: w {w.shape}, qkv {qkv.shape}, heads {n_heads}+2x{n_kv_heads} x {head_dim}")
        self._v4("gemv_qkv_v4", w, x, gain, eps, qkv, rows // 2, label=label,
                 qkv=(k_cache, v_cache, pos, inv_freq, n_heads, n_kv_heads, head_dim))

    def gemv_rmsnorm(self, w, x, gain, eps: float, y, label: str = "") -> None:
        """y [rows] fp32 = w [rows, in] · rmsnorm(x [in], gain [in]), the norm fused (every warp sums x² itself)."""
        self._v4("gemv_v4", w, x, gain, eps, y, (w.shape[0] + 1) // 2, label=label)

    def rope(self, qkv, n_tokens: int, n_rotated_heads: int, head_dim: int, pos, inv_freq) -> None:
        """Rotate the first n_rotated_heads (q and k) heads of each qkv row [T, width] in place, row t at pos[0] + t."""
        self._launch("rope", (n_tokens, n_rotated_heads), (head_dim // 2,),
                     (qkv, np.int32(qkv.shape[-1]), np.int32(head_dim), pos, inv_freq))

    def kv_append(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  k_cache, v_cache, pos) -> None:
        """k/v of each qkv row [T, width] -> k_cache, v_cache [n_kv_heads, capacity, hd] at pos[0] + t."""
        capacity = k_cache.shape[1]
        self._launch("kv_append", (n_tokens, n_kv_heads), (min(head_dim, 256),),
                     (qkv, np.int32(qkv.shape[-1]), np.int32(n_heads), np.int32(n_kv_heads),
                      np.int32(head_dim), k_cache, v_cache, np.int32(capacity), pos))

    def kv_append_int8(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                       k_cache, v_cache, k_scale, v_scale, pos) -> None:
        """kv_append into the int8 cache: codes [n_kv_heads, capacity, hd], a scale a vector [n_kv_heads, capacity]."""
        self._launch("kv_append_int8", (n_tokens, n_kv_heads), (64,),
                     (qkv, np.int32(qkv.shape[-1]), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
                      k_cache, v_cache, k_scale, v_scale, np.int32(k_cache.shape[1]), pos))

    def kv_dequantize(self, k_cache, v_cache, k_scale, v_scale, n_positions: int, k_out, v_out) -> None:
        """Positions [0, n) of one layer's int8 cache -> k_out, v_out [n_kv_heads, capacity, hd] 16-bit (prefill)."""
        n_kv, capacity, hd = k_cache.shape
        if n_positions:
            self._launch("kv_dequant", (n_positions, n_kv), (min(hd, 256),),
                         (k_cache, v_cache, k_scale, v_scale, np.int32(capacity), np.int32(hd), k_out, v_out))

    def attention_kernel(self, head_dim: int, n_heads: int, n_kv_heads: int, int8: bool = False) -> str:
        """The decode attention kernel: v3, attention_gqa{GM}, a block per GM query heads (1, 2 or 4) and split
        (_int8x16 over an int8 cache, _int8 where head_dim % 16); where head_dim % 8 or the heads are not whole
        groups, its fallback v2, attention_fused (a block per query head and split; no int8 variant)."""
        if head_dim % 8 or n_heads % n_kv_heads:
            if int8:
                raise ValueError("attention over an int8 KV cache needs head_dim % 8 == 0 and whole GQA groups")
            return "attention_fused"
        group = n_heads // n_kv_heads
        gm = group if group <= 2 else 4
        return f"attention_gqa{gm}" + ("" if not int8 else "_int8" if head_dim % 16 else "_int8x16")

    def attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache, v_cache,
                  pos, window: int | None, parts, out, scales=None) -> None:
        """Queries of each qkv row [T, width] at pos[0] + t against one layer's cache -> out [T, n_heads * hd] fp32,
        in one launch, the split combine fused into the last split block (attention_kernel says which kernel).

        parts = (m [T, H, S], l [T, H, S], acc [T, H, S, hd]) fp32 scratch and counters [T, H] uint32, zero-filled
        (and left zero); S, the most splits (v3: <= 64, fewer while the context is short). window None or 0: full
        causal. scales = (k_scale, v_scale) [n_kv_heads, capacity] fp32: the cache is int8 (kv_int8.cu)."""
        if head_dim > MAX_HD:
            raise ValueError(f"head_dim {head_dim} > {MAX_HD}")
        part_m, part_l, part_acc, counters = parts
        if counters.dtype != np.uint32 or counters.size < n_tokens * n_heads:
            raise ValueError("attention counters: uint32 [T, n_heads], zero-filled")
        n_splits = part_m.shape[-1]
        args = (qkv, np.int32(qkv.shape[-1]), k_cache, v_cache) + (tuple(scales) if scales is not None else ()) + (
            np.int32(k_cache.shape[1]), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim), pos,
            np.int32(window or 0), np.float32(1.0 / math.sqrt(head_dim)))
        name = self.attention_kernel(head_dim, n_heads, n_kv_heads, int8=scales is not None)
        if name == "attention_fused":                               # a block per query head and split
            self._launch(name, (n_heads, n_splits, n_tokens), (32 * ATTN_WARPS,), args + tuple(parts) + (out,))
            return
        if n_splits > GQA_MAX_SPLITS:
            raise ValueError(f"attention v3: at most {GQA_MAX_SPLITS} splits, got {n_splits}")
        group = n_heads // n_kv_heads
        blocks = n_kv_heads * -(-group // (group if group <= 2 else 4))     # a block per 1, 2 or 4 query heads
        most = n_splits                                             # a second wave of blocks would double the time
        if self.settings.attention_one_wave:
            most = max(1, min(n_splits, self.n_sms // blocks))
        self._launch(name, (blocks, n_splits, n_tokens), (GQA_THREADS,),
                     args + (np.int32(self.settings.attention_split_keys), np.int32(most)) + tuple(parts) + (out,))

    @staticmethod
    def prefill_attention_supported(head_dim: int) -> bool:
        """Does prefill_attention.cu have a variant for this head_dim? (else: the decode kernel)"""
        return head_dim % 4 == 0 and head_dim <= PF_HDS[-1]

    def prefill_attention_kernel(self, head_dim: int) -> str:
        """prefill_attention_mma.cu (tensor cores) at head_dim 64 or 128, else prefill_attention.cu's fp32 tiles."""
        if head_dim in MM_HDS:
            return f"prefill_attention_mma_hd{head_dim}"
        return f"prefill_attention_hd{next(h for h in PF_HDS if head_dim <= h)}"

    def prefill_attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache,
                          v_cache, pos, window: int | None, out) -> None:
        """The T queries of each qkv row [T, width] at pos[0] + t against one layer's cache (their own keys appended)
        -> out [T, n_heads * hd] fp32: blocks of 64 (tensor cores) or 32 (fp32) (token, query head) rows of one KV
        head's group share K/V tiles in shared memory (prefill_attention_kernel says which)."""
        if not self.prefill_attention_supported(head_dim):
            raise ValueError(f"prefill_attention: head_dim {head_dim} (needs % 4 == 0 and <= {PF_HDS[-1]})")
        if n_heads % n_kv_heads:
            raise ValueError(f"prefill_attention: {n_heads} heads not a multiple of {n_kv_heads} KV heads")
        name = self.prefill_attention_kernel(head_dim)
        group = n_heads // n_kv_heads
        common = (qkv, np.int32(qkv.shape[-1]), k_cache, v_cache, np.int32(k_cache.shape[1]), np.int32(n_tokens),
                  np.int32(n_heads), np.int32(n_kv_heads))
        tail = (pos, np.int32(window or 0), np.float32(1.0 / math.sqrt(head_dim)), out)
        if name.startswith("prefill_attention_mma"):        # head_dim is the kernel's compile-time HD
            self._launch(name, (-(-n_tokens * group // MM_ROWS), n_kv_heads), (MM_THREADS,), common + tail)
        else:                                               # head_dim <= HD, passed
            self._launch(name, (-(-n_tokens * group // PF_ROWS), n_kv_heads), (PF_THREADS,),
                         common + (np.int32(head_dim),) + tail)

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


def _capturing() -> bool:
    """Is CuPy's current stream being captured into a CUDA graph?"""
    import cupy
    return cupy.cuda.get_current_stream().is_capturing()


def n_splits_for(n_heads: int, capacity: int, n_sms: int = 132) -> int:
    """Flash-decoding splits, the most a launch may use (the scratch's S): enough (head, split) blocks
    to cover the SMs about 4 times, at most 64, but never splits shorter than 16 keys at full capacity.
    Attention v3 uses only ceil(keys / 64) of them (hd 128) while the context is short: the kernel
    decides at each launch from the current length, so a captured graph stays right."""
    want = math.ceil(4 * n_sms / n_heads)
    return int(max(1, min(want, GQA_MAX_SPLITS, math.ceil(capacity / 16))))
