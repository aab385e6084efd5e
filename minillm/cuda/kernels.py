"""Load `kernels/*.cu` as CuPy RawModules and launch them with documented shapes.

The GEMV launchers take a 16-bit matrix (a CuPy array) or a quantized one (`qweights.QuantMatrix`,
int8/int4): the same call picks gemv.cu v4 or gemv_quant.cu, with the same fused prologue/epilogues.

Every kernel takes 16-bit weights as raw bits (`cupy.float16`, or `cupy.uint16` holding bf16: the same
convention as the CPU side's `np.uint16`), fp32 activations, and reads positions and token ids from
device buffers so that a captured CUDA graph sees new values on each replay. Scalars are passed as
explicit `np.int32` / `np.float32` (CuPy would otherwise guess a C type from a Python int).

All launches go on CuPy's current stream. `Kernels.timer`, when set, wraps each launch (per-kernel
CUDA-event timings for the selfcheck).

The launch parameters that were experiments (grids, prefetches, which attention or quantized-GEMV version)
are one frozen `KernelSettings`, passed to `Kernels(dtype, settings)`; a sweep takes a variant with
`k.with_settings(field=value)` instead of changing the launcher it shares with others.

`Kernels` loads what the engine launches when it is built. The earlier versions (gemv v1/v2, the v3 fused
norm, the fp32-x quantized GEMV v1) stay here to compare and to teach (lessons 12-14, minillm/cuda/dev,
the tests), but load only the first time a launch names one, or all at once by `load_older()`; so do the
quantized GEMVs v3 (tensor cores, kernels/gemv_quant_mma.cu) and v4 (weights streamed into shared memory by
the TMA, kernels/gemv_quant_tma.cu), loaded when the settings choose one.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, replace

import numpy as np

from minillm.cuda import pdl
from minillm.cuda.qweights import is_quantized
from minillm.resources import data_dir

KERNEL_DIR = data_dir("kernels")          # the checkout's kernels/, or an installed wheel's copy
SOURCES = ["rmsnorm", "rope", "swiglu", "kv_append", "kv_int8", "decode_attention", "prefill_attention",
           "prefill_attention_mma", "gemv", "embed", "gemv_quant",
           "paged_attention", "sampling"]   # these two: loaded by gpu_batched.py (the batching engine)
ATTN_WARPS, MAX_HD = 4, 256            # as #defined in decode_attention.cu
GQA_THREADS, GQA_MAX_SPLITS = 256, 64  # decode_attention.cu v3 (attention_gqa*): block size, most splits
GQA_PREFETCH_KV = 2                    # its flags bit: the split's cached K/V rows into L2 before the wait
V4_WARPS = 4                           # as #defined in gemv.cu (row pairs per block)
PF_ROWS, PF_THREADS = 32, 128          # as #defined in prefill_attention.cu (query rows, threads per block)
PF_HDS = (32, 64, 128)                 # its compile-time head_dim bounds (hd <= HD, hd % 4 == 0)
MM_ROWS, MM_THREADS = 64, 128          # as #defined in prefill_attention_mma.cu (query rows, threads per block)
MM_HDS = (64, 128)                     # its head_dims (exactly)
MAX_FUSED_NORM = 12000                 # gemv_rmsnorm_v3 keeps in floats in shared memory (+ static): < 48 KB
QWARPS = 8                             # as #defined in gemv_quant.cu (row pairs per block)
PREWAIT_ROWS = 4                       # gemv_quant.cu's Q_PREWAIT_ROWS = gemv.cu's V4_PREWAIT_ROWS (a flags bit)
QUANT_CHUNK = {"int8": 16, "int4": 32} # weights per 16-byte load = values of x staged per chunk (gemv_quant.cu)
QUANT_BLOCKS_PER_SM = 2                # gemv_quant.cu grid: ~this many blocks per SM, looping over row pairs
QKV_BLOCKS_PER_SM = 3                  # as #defined there (Q_QKV_MIN_BLOCKS): the grid of its int8 q|k|v _3b kernels
V4_QKV_BLOCKS = 6                      # as #defined in gemv.cu: the blocks an SM its 16-bit q|k|v _6b kernels allow
# The kernels that wait for the kernel ahead before reading their inputs (pdl_wait in kernels/common.cuh), and so
# may be launched with programmatic dependent launch (settings.pdl): the decode step's embed, GEMVs (16-bit v4
# and every gemv_quant.cu / gemv_quant_mma.cu / gemv_quant_tma.cu kernel: the last's producer warp reads only
# weights, its consumers wait) and attention v3. Any other kernel launched so would race.
PDL_KERNEL = re.compile(r"embed|gemv_(rmsnorm_)?(swiglu_|qkv_)?(v4|int8|int4|tma)(_v1|_v3|_v3u4|_v4|_3b|_6b)?"
                        r"|attention_gqa[124](_int8(x16)?)?")
MMA_SOURCE = "gemv_quant_mma"          # the quantized GEMV v3 (tensor cores), loaded when settings ask for it
MMA_WARPS = 8                          # as #defined there (M_WARPS): warps a block, on one tile's k range
MMA_BLOCKS_PER_SM = 3                  # its grid: blocks of 8 warps (<= 85 registers a thread: 3 fit an SM)
MMA_VARIANTS = [f"gemv_{e}{m}" for m in ("int8", "int4") for e in ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_",
                                                                      "qkv_", "rmsnorm_qkv_")]
WIDE_TMA_VARIANTS = [f"gemv_{e}tma" for e in ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_", "qkv_", "rmsnorm_qkv_")]
TMA_SOURCE = "gemv_quant_tma"          # the quantized GEMV v4 (weights into shared memory by the TMA): same variants
TMA_THREADS = 32 * (8 + 1)             # as #defined there: T_WARPS consumer warps and one producer warp
TMA_MAX_STAGES, TMA_MAX_PAIRS = 16, 16  # T_MAX_STAGES, T_MAX_PAIRS
TMA_CHUNKS_A_THREAD = {"int8": 4, "int4": 2, "wide16": 7}   # J_MAX of Int8Tma, Int4Tma, Wide16Tma: x chunks a thread


@dataclass(frozen=True)
class TmaPlan:
    """How gemv_quant_tma.cu splits one matrix (int8 / int4: v4; 16-bit: wide_tma): `lanes` threads a row (each
    holding at most TMA_CHUNKS_A_THREAD chunks of x), `pairs_a_stage` row pairs a stage, `stages` in the ring."""
    lanes: int
    pairs_a_stage: int
    stages: int
    stage_bytes: int

    @property
    def smem(self) -> int:
        return self.stages * self.stage_bytes

    @property
    def args(self) -> tuple:
        """The kernel's last three arguments: L, P, n_stages."""
        return np.int32(self.lanes), np.int32(self.pairs_a_stage), np.int32(self.stages)


def tma_plan(method: str, n_chunks: int, n_groups: int, ring_bytes: int, min_lanes: int = 32,
             stage_share: int = 6) -> TmaPlan | None:
    """v4's split of a matrix with rows of n_chunks 16-byte chunks (and, int4, n_groups scales and mins a
    row) for a ring of at most ring_bytes; None where v4 does not apply (the launcher keeps v2): a row
    wider than 256 threads' chunks, int4 scales that are not whole 16-byte copies, a ring of < 2 stages.

    L is the smallest power of two (>= min_lanes, but no wider than the row) that keeps a thread's chunks
    within its registers: fewer threads a row means fewer partial sums to add. A stage aims at 1/stage_share
    of the ring, and holds a whole number of the 256 / L slots' pairs where that fits."""
    consumers = TMA_THREADS - 32
    most = TMA_CHUNKS_A_THREAD[method]
    if n_chunks > most * consumers or (method == "int4" and n_groups % 8):
        return None
    lanes = 32
    while lanes * most < n_chunks or (lanes < min_lanes and lanes < n_chunks):
        lanes *= 2
    slots = consumers // lanes
    pair_bytes = 2 * (16 * n_chunks + (4 * n_groups if method == "int4" else 0))
    pairs = max(1, min(TMA_MAX_PAIRS, ring_bytes // stage_share // pair_bytes))
    if pairs >= slots:
        pairs -= pairs % slots
    elif slots * pair_bytes <= ring_bytes // 2:
        pairs = slots
    stages = min(TMA_MAX_STAGES, ring_bytes // (pairs * pair_bytes))
    if stages < 2:
        return None
    return TmaPlan(lanes, pairs, stages, pairs * pair_bytes)


def kernel_source(name: str) -> str:
    """The text of kernels/NAME.cu with every `#include "X.cuh"` pasted in (each header once).

    Pasting (rather than -I) keeps NVRTC free of include paths and makes CuPy's compile cache,
    keyed by the source text, notice a change to a header."""
    return _paste_includes((KERNEL_DIR / f"{name}.cu").read_text(), set())


def _paste_includes(text: str, seen: set) -> str:
    def paste(match) -> str:
        header = match.group(1)
        if header in seen:                          # `#pragma once`, done by hand
            return ""
        seen.add(header)
        return _paste_includes((KERNEL_DIR / header).read_text(), seen)
    return re.sub(r'^#include "([\w.]+\.cuh)"$', paste, text, flags=re.M)


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


@dataclass(frozen=True)
class KernelSettings:
    """How the decode kernels are launched: the defaults are what measured fastest on the H200
    (lessons/BENCHMARKS.md, 2026-11-29); the other values stay to rerun those experiments. Frozen and
    hashable: a captured CUDA graph is keyed by the settings it was captured with."""
    # gemv_quant.cu's grid: about this many blocks per SM, each warp looping over row pairs (0: one block per
    # QWARPS row pairs, no looping). With both L2 prefetches on, int8 decode went 259.7 tok/s at 2 blocks/SM,
    # 240.9 at 1, 252.6 with no looping.
    quant_blocks_per_sm: int = QUANT_BLOCKS_PER_SM
    # The weights ("int8", "16-bit") whose q|k|v GEMV runs a build that holds more blocks an SM with half the loads
    # in flight a step, so Mistral-7B's 3072 row pairs take one round instead of 1.45 (a quarter of the warps idle
    # in the last): int8, gemv_quant.cu's _3b kernels (v2), QKV_BLOCKS_PER_SM blocks an SM (74 registers instead
    # of 110), 384 blocks; 16-bit, gemv.cu's _6b kernels (v4), 6 blocks an SM instead of 4 (80 registers instead
    # of 102-104), its 768 blocks all resident. Decode, median of 5 alternating rounds (dev.qfloor "3 blocks qkv
    # only", H200, 2026-12-02): int8 382.2 -> 394.4 tok/s (1.032x); int4 (Q_U4 steps, 3 blocks) 465.9 -> 459.5
    # (0.986x): not for int4. 16-bit (python -m minillm.cuda.dev.ab, same day): fp16 244.4 -> 242.8 (0.993x): off.
    qkv_one_round: tuple[str, ...] = ("int8",)
    # gemv_quant.cu's Q_LOOKAHEAD bits: 1 = each warp prefetches its next row pair into L2, 3 = two pairs ahead.
    # Slower: int8 284.5 -> 269.2 tok/s, int4 313.2 -> 303.3 (the GEMVs are issue-bound, not waiting on HBM).
    quant_flags: int = 0
    # The quantized GEMV: 2 = x staged as fp16, HFMA2 products (inner loop int8 4.0 -> 2.8 instructions a
    # weight, int4 5.1 -> 2.9; with attention v3, int8 decode 285-303 -> 340 tok/s); 1 = x as fp32 (plain
    # y = W·x only), kept to compare; 3 = products on tensor cores (kernels/gemv_quant_mma.cu; int4 groups of
    # 32 or 64 stay on v2): right but slower, decode int8 356 -> 318 tok/s, int4 443 -> 380 (H200, 2026-12-02).
    quant_version: int = 2
    # 4 = weights streamed into shared memory by the TMA, x in registers (kernels/gemv_quant_tma.cu; where its
    # layout does not fit, tma_plan: v2): right but slower, decode int8 372 -> 332 tok/s, int4 463 -> 328; its
    # consumers hold each stage too long (int8 gate_up 83% of copy vs v2's 92%) (H200, 2026-12-02).
    # v4's grid (blocks an SM, each looping over stages) and the bytes of its ring of stages a block (two
    # blocks an SM must fit the SM's 228 KB with the kernels' 2.2 KB of static shared memory each).
    quant_tma_blocks_per_sm: int = 2
    quant_tma_ring_bytes: int = 104 << 10
    # v4's split (tma_plan): at least this many threads a row (32: as few as x's registers allow), and stages of
    # about 1 / quant_tma_stage_share of the ring (also for wide_tma). 256 a row: slower on every 4096-wide matrix
    # (int8 gate_up 33.3 -> 45.6 µs; fp16 56.4 -> 65.9), smaller stages slower still.
    quant_tma_lanes: int = 32
    quant_tma_stage_share: int = 6
    # 16-bit weights through the same kernel (its Wide16Tma format) instead of gemv.cu v4. A pair of Mistral-7B's
    # 14336-wide rows is 57 KB: two blocks an SM with 104 KB rings leave down on gemv.cu v4 (one stage only).
    # Each GEMV alone as fast or faster (gate_up 58.8 -> 56.4 µs, 98% of copy), but decode 243 -> 225 tok/s:
    # its 208 KB of shared memory an SM likely keep the next kernel from starting early (BENCHMARKS, stop 35).
    # One block an SM with a 200 KB ring: 200 tok/s.
    wide_tma: bool = False
    wide_tma_blocks_per_sm: int = 2
    wide_tma_ring_bytes: int = 104 << 10
    # v3's grid: about this many blocks per SM, each looping over tiles of 8 row pairs (0: one block a tile).
    quant_mma_blocks_per_sm: int = MMA_BLOCKS_PER_SM
    # v3's sub-steps a warp step (4 chunks of each row each): 2, or 4 (plain y = W·x only, ~100 registers: for
    # 2 blocks an SM), twice the bytes in flight a warp.
    quant_mma_substeps: int = 2
    # GPUTransformer's decode names each v4 GEMV's next weights (next_w), whose first bytes its last blocks
    # prefetch into L2 during the launch gap and the next kernel's ramp. Slower everywhere tried:
    # fp16 243.0 -> 232.1 tok/s, int8 284.5 -> 276.8, int4 313.2 -> 309.3.
    prefetch_next: bool = False
    # Bytes of a next_w prefetched, 0: none (12 MB: ~3 µs of HBM time; fp16 with 6 MB 238.5 tok/s, 24 MB
    # 223.1), by the last prefetch_tail blocks of a grid (None: 2 per SM, 264 on the H200).
    prefetch_next_bytes: int = 12 << 20
    prefetch_tail: int | None = None
    # The GEMVs (by label: "o", ...) whose warps ask L2 for their whole rows before waiting for the kernel ahead
    # (Q_PREWAIT_ROWS / V4_PREWAIT_ROWS), not only each warp's first step: for a GEMV behind a kernel that leaves
    # HBM idle (o_proj behind decode attention), so its matrix arrives while that kernel runs. Measured (dev.chain,
    # H200, 2026-12-02): ("o",) fp16 1.000-1.002x, int8 0.990-0.996x, int4 0.981-0.998x; ("qkv",) 0.97-0.98x;
    # ("down",) 0.96-0.99x: not kept.
    prefetch_rows_before_wait: tuple[str, ...] = ()
    # Fused-combine decode attention: 3 = a block per KV head's GQA group, splits chosen from the length at
    # run time (7.6 vs 15.4 µs a layer at 144 keys, 11.9 vs 71.8 at 4096; fp16 decode 244.4 -> 256.6 tok/s);
    # 2 = a block per query head and split (also what v3 falls back to when head_dim % 8).
    attention_version: int = 3
    # v3: the fewest keys a split holds (0: one tile, 64 keys at hd 128). 128 keys: slower up to 640 keys;
    # 256: 7.0 vs 7.6 µs at 144 keys, but 10.9 vs 8.4 at 640.
    attention_split_keys: int = 0
    # v3: at most as many blocks as SMs; all splits (a second wave of blocks) is 14.8 vs 9.6 µs at 2048 keys.
    attention_one_wave: bool = True
    # v3: GQA_HEAVY_FENCE (1) = v2's fences in every thread around the ticket instead of one thread's
    # release/acquire (7.8 vs 7.6 µs at 144 keys); GQA_PREFETCH_KV (2) = each block asks L2 for its split's
    # cached K/V rows before waiting for the qkv GEMV (dev.chain: decode fp16 1.004x, int8 0.997x, int4 1.001x).
    attention_flags: int = 0
    # int8 KV cache: codes a lane reads per key, 16 (head_dim % 16 == 0; int8 vs 16-bit cache at 32k keys
    # 1.00x) or 8 (the first kernel: 0.96x).
    attention_int8_codes_per_lane: int = 16
    # Prefill attention: 2 = prefill_attention_mma.cu (tensor cores, head_dim 64 or 128; others keep 1):
    # 29.3 vs 184.1 µs a layer at T = 512 on Mistral-7B, TTFT 512 19.5 -> 14.6 ms (H200, 2026-12-02);
    # 1 = prefill_attention.cu (fp32 FMAs), kept to compare.
    prefill_attention_version: int = 2
    # Prefill with int8/int4 weights: each matrix widened to 16 bits on a second stream one GEMM ahead, into the
    # other of two scratch buffers (minillm/cuda/widen_ahead.py), instead of right before its GEMM on the same
    # stream; one more scratch buffer (the largest matrix: 235 MB for Mistral-7B's gate|up). TTFT 512 (dev.widen,
    # H200, 2026-12-02): int8 20.9 -> 20.5 ms, int4 20.9 -> 20.7-20.8: not kept (cuBLAS's GEMMs likely hold every SM).
    prefill_widen_ahead: bool = False
    # Its side stream's priority (CUDA's convention: lower is more urgent), so that the widening's blocks take SMs
    # ahead of the GEMM's next ones: -5 measured int8 21.1 ms, int4 20.6 (widening before each GEMM: 21.0, 20.9).
    prefill_widen_priority: int = 0
    # Programmatic dependent launch (minillm/cuda/pdl.py) for the kernels that allow it (PDL_KERNEL): each may
    # start during the previous kernel's tail, its first weight loads issued before it waits for x. Decode
    # with vs without, same run (H200, 2026-12-02): fp16 1.02x, int8 1.07x (341 -> 365 tok/s), int4 1.11x
    # (416 -> 460); logits bit-identical.
    pdl: bool = True

    def __post_init__(self):
        if not set(self.qkv_one_round) <= {"int8", "16-bit"}:
            raise ValueError(f"qkv_one_round: 'int8' and/or '16-bit' (the builds there are), not {self.qkv_one_round}")


class Kernels:
    """Launch helpers for one weight dtype ("float16" or "bfloat16"). Every function is fetched at
    construction, so nothing compiles or loads while a CUDA graph is being captured.

    `settings` (KernelSettings) are read at each launch; a captured graph keeps the values it was captured
    with, so the graph's owner keys it by them (GPUTransformer._graph_for)."""

    def __init__(self, dtype: str = "float16", settings: KernelSettings = KernelSettings()):
        self.dtype, self.settings = dtype, settings
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
            "gemv_v4": get("gemv", f"gemv_v4_{sfx}"),
            "gemv_rmsnorm_v4": get("gemv", f"gemv_rmsnorm_v4_{sfx}"),
            "gemv_swiglu_v4": get("gemv", f"gemv_swiglu_v4_{sfx}"),
            "gemv_rmsnorm_swiglu_v4": get("gemv", f"gemv_rmsnorm_swiglu_v4_{sfx}"),
            "gemv_qkv_v4": get("gemv", f"gemv_qkv_v4_{sfx}"),
            "gemv_rmsnorm_qkv_v4": get("gemv", f"gemv_rmsnorm_qkv_v4_{sfx}"),
            "gemv_qkv_v4_6b": get("gemv", f"gemv_qkv_v4_6b_{sfx}"),                    # settings.qkv_one_round
            "gemv_rmsnorm_qkv_v4_6b": get("gemv", f"gemv_rmsnorm_qkv_v4_6b_{sfx}"),
            "attention_fused": get("decode_attention", f"attention_fused_{sfx}"),
            "attention_gqa1": get("decode_attention", f"attention_gqa1_{sfx}"),
            "attention_gqa2": get("decode_attention", f"attention_gqa2_{sfx}"),
            "attention_gqa4": get("decode_attention", f"attention_gqa4_{sfx}"),
            "attention_gqa1_int8": get("decode_attention", "attention_gqa1_int8"),   # over an int8 KV cache
            "attention_gqa2_int8": get("decode_attention", "attention_gqa2_int8"),
            "attention_gqa4_int8": get("decode_attention", "attention_gqa4_int8"),
            "attention_gqa1_int8x16": get("decode_attention", "attention_gqa1_int8x16"),   # 16 codes a lane
            "attention_gqa2_int8x16": get("decode_attention", "attention_gqa2_int8x16"),
            "attention_gqa4_int8x16": get("decode_attention", "attention_gqa4_int8x16"),
            "kv_append_int8": get("kv_int8", "kv_append_int8"),
            "kv_dequant": get("kv_int8", f"kv_dequant_{sfx}"),
            "prefill_attention_hd32": get("prefill_attention", f"prefill_attention_hd32_{sfx}"),
            "prefill_attention_hd64": get("prefill_attention", f"prefill_attention_hd64_{sfx}"),
            "prefill_attention_hd128": get("prefill_attention", f"prefill_attention_hd128_{sfx}"),
            "prefill_attention_mma_hd64": get("prefill_attention_mma", f"prefill_attention_mma_hd64_{sfx}"),
            "prefill_attention_mma_hd128": get("prefill_attention_mma", f"prefill_attention_mma_hd128_{sfx}"),
            "embed": get("embed", f"embed_{sfx}"),
            "cast": get("embed", f"cast_to_{sfx}"),
            "fill_uniform": get("embed", f"fill_uniform_{sfx}"),
            # int8 / int4 weights (gemv_quant.cu): the v4 variants' names with the method for "v4"
            "gemv_int8": get("gemv_quant", f"gemv_int8_{sfx}"),
            "gemv_rmsnorm_int8": get("gemv_quant", f"gemv_rmsnorm_int8_{sfx}"),
            "gemv_swiglu_int8": get("gemv_quant", f"gemv_swiglu_int8_{sfx}"),
            "gemv_rmsnorm_swiglu_int8": get("gemv_quant", f"gemv_rmsnorm_swiglu_int8_{sfx}"),
            "gemv_qkv_int8": get("gemv_quant", f"gemv_qkv_int8_{sfx}"),
            "gemv_rmsnorm_qkv_int8": get("gemv_quant", f"gemv_rmsnorm_qkv_int8_{sfx}"),
            "gemv_qkv_int8_3b": get("gemv_quant", f"gemv_qkv_int8_3b_{sfx}"),          # settings.qkv_one_round
            "gemv_rmsnorm_qkv_int8_3b": get("gemv_quant", f"gemv_rmsnorm_qkv_int8_3b_{sfx}"),
            "gemv_int4": get("gemv_quant", f"gemv_int4_{sfx}"),
            "gemv_rmsnorm_int4": get("gemv_quant", f"gemv_rmsnorm_int4_{sfx}"),
            "gemv_swiglu_int4": get("gemv_quant", f"gemv_swiglu_int4_{sfx}"),
            "gemv_rmsnorm_swiglu_int4": get("gemv_quant", f"gemv_rmsnorm_swiglu_int4_{sfx}"),
            "gemv_qkv_int4": get("gemv_quant", f"gemv_qkv_int4_{sfx}"),
            "gemv_rmsnorm_qkv_int4": get("gemv_quant", f"gemv_rmsnorm_qkv_int4_{sfx}"),
            "dequant_int8": get("gemv_quant", f"dequant_int8_{sfx}"),
            "dequant_int4": get("gemv_quant", f"dequant_int4_{sfx}"),
            "fill_random_words": get("gemv_quant", "fill_random_words"),
        }
        self.older = {           # earlier versions, to compare: loaded on first use (`load_older`)
            "gemv_v1": lambda: get("gemv", f"gemv_v1_{sfx}"),
            "gemv_v2": lambda: get("gemv", f"gemv_v2_{sfx}"),
            "gemv_rmsnorm_v3": lambda: get("gemv", f"gemv_rmsnorm_v3_{sfx}"),
            "gemv_int8_v1": lambda: get("gemv_quant", f"gemv_int8_v1_{sfx}"),   # v1 (fp32 x), plain only
            "gemv_int4_v1": lambda: get("gemv_quant", f"gemv_int4_v1_{sfx}"),
        }
        self.by_settings = set()  # the older kernels whose modules load only with the settings that choose them

        def chosen(name, source, fn_name):
            self.older[name] = lambda: get(source, fn_name)
            self.by_settings.add(name)
        for v in MMA_VARIANTS:   # v3: every variant of v2, on tensor cores; v4: its weights streamed by the TMA
            chosen(f"{v}_v3", MMA_SOURCE, f"{v}_v3_{sfx}")
            chosen(f"{v}_v4", TMA_SOURCE, f"{v}_v4_{sfx}")
        for m in ("int8", "int4"):   # v3 with 4 sub-steps a warp step, plain only
            chosen(f"gemv_{m}_v3u4", MMA_SOURCE, f"gemv_{m}_v3u4_{sfx}")
        for v in WIDE_TMA_VARIANTS:   # gemv.cu v4's variants over 16-bit weights, streamed by the TMA
            chosen(v, TMA_SOURCE, f"{v}_{sfx}")
        for f in self.fn.values():          # force NVRTC + module load now, not during a capture
            getattr(f, "attributes", None)
        import cupy as cp
        # stand-ins for the pointer arguments a v4 variant does not use (never dereferenced)
        self._nil_f32 = cp.zeros(8, cp.float32)
        self._nil_u16 = cp.zeros(8, cp.uint16)
        self._nil_i32 = cp.zeros(8, cp.int32)
        self.timer = None
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.n_sms = props["multiProcessorCount"]
        # gemv_quant.cu stages x in dynamic shared memory: a 14336-wide int8 row needs 72 KB (> the 48 KB
        # default), so allow each quantized GEMV the device's opt-in maximum once, here, not mid-capture.
        optin = props.get("sharedMemPerBlockOptin") or cp.cuda.runtime.deviceGetAttribute(97, cp.cuda.Device().id)
        # 97: cudaDevAttrMaxSharedMemoryPerBlockOptin. Static + dynamic must fit under it: the kernels' own
        # __shared__ arrays are <= 1.2 KB (v3: two tiles' row sums), so 4 KB is left for them.
        self.max_quant_smem = optin - 4096
        for name, f in self.fn.items():
            self._allow_quant_smem(name, f)
        self._load_quant_version()

    def with_settings(self, **changes) -> "Kernels":
        """These kernels launched with some settings changed (dataclasses.replace): a copy that shares the
        loaded functions, so nothing compiles again."""
        other = copy.copy(self)
        other.settings = replace(self.settings, **changes)
        other._load_quant_version()
        return other

    def _load_quant_version(self) -> None:
        """The v3 or v4 quantized GEMVs when the settings choose one, loaded now (not in the middle of a graph
        capture that launches one)."""
        version = self.settings.quant_version
        if version in (3, 4):
            for v in MMA_VARIANTS:
                self._function(f"{v}_v{version}")
        if self.settings.wide_tma:
            for v in WIDE_TMA_VARIANTS:
                self._function(v)
        if version == 3 and self.settings.quant_mma_substeps == 4:
            for m in ("int8", "int4"):
                self._function(f"gemv_{m}_v3u4")

    def _allow_quant_smem(self, name: str, f) -> None:
        if name.startswith("gemv_") and ("int8" in name or "int4" in name or "tma" in name):
            f.max_dynamic_shared_size_bytes = self.max_quant_smem

    def load_older(self) -> None:
        """Load every earlier kernel version now (before capturing a graph that may launch one); the quantized
        GEMVs v3 / v4 and the 16-bit TMA GEMVs load with the settings that choose them (_load_quant_version),
        so their modules compile only where they are used."""
        for name in self.older.keys() - self.by_settings:
            self._function(name)

    def _function(self, name: str):
        """The loaded kernel `name`; an earlier version is loaded here the first time it is named."""
        f = self.fn.get(name)
        if f is None:
            f = self.fn[name] = self.older[name]()
            getattr(f, "attributes", None)                  # NVRTC + module load now
            self._allow_quant_smem(name, f)
        return f

    def uses_pdl(self, name: str) -> bool:
        """Is kernel `name` launched with programmatic dependent launch (while a graph is captured) under
        these settings?"""
        return self.settings.pdl and PDL_KERNEL.fullmatch(name) is not None

    def _launch(self, name: str, grid, block, args, label: str = "", shared_mem: int = 0) -> None:
        # PDL only into a CUDA graph: there a launch's cost is paid once; eagerly, the ctypes call would cost
        # more host time than CuPy's launch (and eager steps are host-bound: lesson 13's comparison).
        def launch():
            if self.uses_pdl(name) and _capturing():
                pdl.launch(self._function(name), grid, block, args, shared_mem)
            else:
                self._function(name)(grid, block, args, shared_mem=shared_mem)
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

    def gemv(self, w, x, y, accumulate: bool = False, version: int = 2, label: str = "", next_w=None) -> None:
        """y [rows] fp32 (+)= w [rows, in] · x [in] fp32; in % 8 == 0. `label` names it for the timer.
        version 1, 2 (8 rows a block, one warp a row) or 4 (two rows a warp, 16 loads in flight a lane)."""
        rows, n_in = w.shape
        if version >= 4 or is_quantized(w):
            self._v4("gemv_v4", w, x, None, 0.0, y, (rows + 1) // 2, accumulate, label, next_w=next_w)
            return
        if n_in % 8:
            raise ValueError(f"gemv needs in % 8 == 0, got {n_in}")
        self._launch(f"gemv_v{version}", ((rows + 7) // 8,), (256,),
                     (w, x, y, np.int32(rows), np.int32(n_in), np.int32(1 if accumulate else 0)), label)

    def _v4(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None, next_w=None) -> None:
        """Launch a gemv.cu v4 variant: one warp per row pair, V4_WARPS pairs a block (or, for a
        quantized w, the gemv_quant.cu kernel of the same variant)."""
        if is_quantized(w):
            self._quant(name, w, x, gain, eps, y, pairs, accumulate, label, qkv, next_w)
            return
        rows, n_in = w.shape
        if n_in % 8:
            raise ValueError(f"gemv needs in % 8 == 0, got {n_in}")
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        plan = self.wide_tma_plan(w) if self.settings.wide_tma else None
        if plan is not None:       # gemv_quant_tma.cu's 16-bit twin: the matrix as 16-byte chunks, v2's signature
            grid = self._tma_grid(pairs, plan, self.settings.wide_tma_blocks_per_sm)
            self._launch(name.replace("_v4", "_tma"), (grid,), (TMA_THREADS,),
                         self._quant_args(w, self._nil_f32, self._nil_u16, n_in // 8, 0, 1, x, gain, eps, n_in, pairs,
                                          y, rows, accumulate, qkv, 0, next_w) + plan.args,
                         label, shared_mem=plan.smem)
            return
        kc, vc, capacity, pos, inv_freq, n_heads, n_kv_heads, hd = self._qkv_args(qkv)
        if "qkv" in name and "16-bit" in self.settings.qkv_one_round:
            name += "_6b"                    # its own build: V4_QKV_BLOCKS blocks an SM, every block resident at once
        self._launch(name, ((pairs + V4_WARPS - 1) // V4_WARPS,), (32 * V4_WARPS,),
                     (w, x, self._nil_f32 if gain is None else gain, np.float32(eps), y, np.int32(rows),
                      np.int32(n_in), np.int32(1 if accumulate else 0), kc, vc, np.int32(capacity), pos,
                      inv_freq, np.int32(n_heads), np.int32(n_kv_heads), np.int32(hd)) + self._next_args(next_w)
                     + (np.int32(self._prewait_flag(label)),), label)

    def _prewait_flag(self, label: str) -> int:
        """PREWAIT_ROWS for a GEMV that settings.prefetch_rows_before_wait names, else 0."""
        return PREWAIT_ROWS if label in self.settings.prefetch_rows_before_wait else 0

    def _quant(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None, next_w=None) -> None:
        """Launch the gemv_quant.cu twin of v4 variant `name` (gemv_v4, gemv_swiglu_v4, gemv_qkv_v4) for a
        QuantMatrix w: same arguments and epilogues; x is staged in shared memory, so in is not bound
        to % 8 (int8 rows are padded to 16 bytes on upload, int4 rows to whole groups by quant.py)."""
        rows, n_in = w.shape
        name = name.replace("_v4", f"_{w.method}")
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        chunk, sums = QUANT_CHUNK[w.method], (4 * w.n_chunks if w.method == "int4" else 0)
        cpg = max(1, w.group_size // 32)                       # 16-byte chunks per int4 group
        grid, block, extra = self.quant_grid(pairs), 32 * QWARPS, ()
        plan = self.tma_plan(w) if self.settings.quant_version == 4 else None
        if plan is not None:
            # v4: the ring of stages in shared memory, one producer warp + 8 consumer warps a block, each block
            # looping over stages of plan.pairs_a_stage row pairs
            name += "_v4"
            smem, block = plan.smem, TMA_THREADS
            grid, extra = self._tma_grid(pairs, plan, self.settings.quant_tma_blocks_per_sm), plan.args
        elif self.settings.quant_version == 3 and (w.method == "int8" or cpg % 4 == 0):
            # v3: x as fp16 in the mma's k order, n_chunks rounded up to a warp step (4 chunks a sub-step); int8:
            # 32 bytes a chunk + an offset a step; int4: 80 bytes a chunk + (Z, X) per 4 chunks. int4 groups of
            # 32 or 64 stay on v2 (a scale inside a quad).
            substeps = self.settings.quant_mma_substeps
            if substeps == 4 and name != f"gemv_{w.method}":
                raise ValueError(f"{name}: v3 with 4 sub-steps a warp step is kept for plain y = W·x only")
            name += "_v3" if substeps == 2 else "_v3u4"
            n_pad = -(-w.n_chunks // (4 * substeps)) * 4 * substeps
            smem = n_pad * 82 if w.method == "int4" else n_pad * 32 + 4 * n_pad // (4 * substeps)
            grid, block = self.mma_grid(pairs), 32 * MMA_WARPS
        elif self.settings.quant_version == 1:   # v1: x as fp32, chunk + 4 floats a chunk (+ Σx per chunk, int4)
            if name != f"gemv_{w.method}":
                raise ValueError(f"{name}: the v1 quantized GEMV is kept for plain y = W·x only")
            name += "_v1"
            smem = w.n_chunks * (chunk + 4) * 4 + sums
        else:                                # v2: x as fp16, chunk/2 + 4 words a chunk, 2^-e per chunk (+ Σx)
            smem = w.n_chunks * (chunk // 2 + 5) * 4 + sums
            if "qkv" in name and w.method in self.settings.qkv_one_round:
                name += "_3b"                # its own build: 3 blocks an SM, one round of the q|k|v rows
                grid = self.quant_grid(pairs, QKV_BLOCKS_PER_SM)
        if smem > self.max_quant_smem:
            raise ValueError(f"{name}: a {n_in}-wide row needs {smem} bytes of shared memory for x "
                             f"(this device allows {self.max_quant_smem})")
        self._launch(name, (grid,), (block,),
                     self._quant_args(w.qweight, w.scales, self._nil_u16 if w.mins is None else w.mins, w.n_chunks,
                                      w.n_groups, cpg, x, gain, eps, n_in, pairs, y, rows, accumulate, qkv,
                                      self.settings.quant_flags | self._prewait_flag(label), next_w) + extra,
                     label, shared_mem=smem)

    def _quant_args(self, qw, scales, mins, n_chunks, n_groups, cpg, x, gain, eps, n_in, pairs, y, rows, accumulate,
                    qkv, flags, next_w) -> tuple:
        """The one signature of gemv_quant.cu's kernels (gemv_quant_mma.cu's and gemv_quant_tma.cu's take it too;
        the last appends its plan): cpg = 16-byte chunks per int4 group, passed with its log2 (-1: not a power
        of two)."""
        shift = cpg.bit_length() - 1 if cpg & (cpg - 1) == 0 else -1
        kc, vc, capacity, pos, inv_freq, n_heads, n_kv_heads, hd = self._qkv_args(qkv)
        return ((qw, scales, mins, np.int32(n_chunks), np.int32(n_groups), np.int32(cpg), np.int32(shift), x,
                 self._nil_f32 if gain is None else gain, np.float32(eps), np.int32(n_in), np.int32(pairs), y,
                 np.int32(rows), np.int32(1 if accumulate else 0), kc, vc, np.int32(capacity), pos, inv_freq,
                 np.int32(n_heads), np.int32(n_kv_heads), np.int32(hd), np.int32(flags))
                + self._next_args(next_w))

    def _tma_grid(self, pairs: int, plan: TmaPlan, blocks_per_sm: int) -> int:
        """gemv_quant_tma.cu's grid: a block per stage of pairs, at most blocks_per_sm an SM (each looping)."""
        return min(-(-pairs // plan.pairs_a_stage), blocks_per_sm * self.n_sms)

    def _qkv_args(self, qkv) -> tuple:
        """The EPI_QKV epilogue's arguments (k_cache, v_cache, capacity, pos, inv_freq, n_heads, n_kv_heads,
        hd) from gemv_qkv's tuple; stand-ins when there is none. A k_cache of None: RoPE only, no append
        (capacity 0; the int8 cache quantizes the row with its own kernel after)."""
        if qkv is None:
            return self._nil_u16, self._nil_u16, 0, self._nil_i32, self._nil_f32, 0, 0, 0
        kc, vc, pos, inv_freq, n_heads, n_kv_heads, hd = qkv
        if kc is None:
            return self._nil_u16, self._nil_u16, 0, pos, inv_freq, n_heads, n_kv_heads, hd
        return kc, vc, kc.shape[1], pos, inv_freq, n_heads, n_kv_heads, hd

    def _next_args(self, next_w) -> tuple:
        """Kernel arguments naming the next GEMV's weights for the L2 prefetch in a GEMV's tail (NextWeights
        in gemv_epilogue.cuh). next_w: None, a matrix, or (matrix, halves): halves = it is [gate; up],
        whose two halves the next kernel starts reading at once."""
        none = (np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0), np.int32(0))
        w, halves = next_w if isinstance(next_w, tuple) else (next_w, False)
        a = w.qweight if is_quantized(w) else w
        ptr = getattr(getattr(a, "data", None), "ptr", None)          # None: not a device array (a stand-in)
        most = self.settings.prefetch_next_bytes
        if w is None or ptr is None or not most:
            return none
        tail = np.int32(2 * self.n_sms if self.settings.prefetch_tail is None else self.settings.prefetch_tail)
        if halves:
            half = a.nbytes // 2
            n = np.uint64(min(half, most // 2))
            return np.uint64(ptr), n, np.uint64(ptr + half), n, tail
        return np.uint64(ptr), np.uint64(min(a.nbytes, most)), np.uint64(0), np.uint64(0), tail

    def quant_grid(self, pairs: int, per_sm: int | None = None) -> int:
        """Blocks for a quantized GEMV over `pairs` row pairs: about per_sm (default settings.quant_blocks_per_sm)
        an SM, each warp taking the same number of pairs in turn (0: one pair per warp, as v4 does)."""
        need = -(-pairs // QWARPS)
        per_sm = self.settings.quant_blocks_per_sm if per_sm is None else per_sm
        if not per_sm:
            return need
        per_warp = -(-need // (per_sm * self.n_sms))
        return -(-need // per_warp)

    def tma_plan(self, w) -> TmaPlan | None:
        """v4's split of the QuantMatrix w under these settings (None: v4 does not apply, v2 runs)."""
        s = self.settings
        return tma_plan(w.method, w.n_chunks, w.n_groups, s.quant_tma_ring_bytes, s.quant_tma_lanes,
                        s.quant_tma_stage_share)

    def wide_tma_plan(self, w) -> TmaPlan | None:
        """The split of a 16-bit matrix [rows, in] for gemv_quant_tma.cu's 16-bit kernels (None: gemv.cu v4)."""
        n_in = w.shape[1]
        s = self.settings
        return None if n_in % 8 else tma_plan("wide16", n_in // 8, 0, s.wide_tma_ring_bytes, s.quant_tma_lanes,
                                              s.quant_tma_stage_share)

    def mma_grid(self, pairs: int) -> int:
        """Blocks for the v3 quantized GEMV: tiles of 8 row pairs, about settings.quant_mma_blocks_per_sm
        blocks an SM, each looping over the same number of tiles (0: one tile a block)."""
        tiles = -(-pairs // 8)
        per_sm = self.settings.quant_mma_blocks_per_sm
        if not per_sm:
            return tiles
        per_block = -(-tiles // (per_sm * self.n_sms))
        return -(-tiles // per_block)

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

    def gemv_swiglu(self, w, x, gain, eps: float, out, label: str = "", next_w=None) -> None:
        """out [ffn] fp32 = silu(g) · u, [g; u] = w [2 ffn, in] · x, with x = rmsnorm(x, gain) when gain is
        not None (v4: the gate/up vector never reaches memory)."""
        rows = w.shape[0]
        if rows % 2 or out.shape != (rows // 2,):
            raise ValueError(f"gemv_swiglu: w has {rows} rows (gate; up), out {out.shape}")
        self._v4("gemv_swiglu_v4", w, x, gain, eps, out, rows // 2, label=label, next_w=next_w)

    def gemv_qkv(self, w, x, gain, eps: float, qkv, pos, inv_freq, k_cache, v_cache, n_heads: int,
                 n_kv_heads: int, head_dim: int, label: str = "", next_w=None) -> None:
        """One decode token: qkv [width] fp32 = w · x (x = rmsnorm(x, gain) when gain is not None), RoPE on
        the q and k heads at position pos[0], k and v into k_cache, v_cache [n_kv_heads, capacity, hd]
        (one layer) at pos[0]: rmsnorm + GEMV + rope + kv_append in one v4 launch. k_cache = v_cache =
        None: no append (an int8 cache quantizes the rotated k and v from qkv next: kv_append_int8)."""
        rows = w.shape[0]
        if rows != (n_heads + 2 * n_kv_heads) * head_dim or head_dim % 2 or qkv.shape != (rows,):
            raise ValueError(f"gemv_qkv: w {w.shape}, qkv {qkv.shape}, heads {n_heads}+2x{n_kv_heads} x {head_dim}")
        self._v4("gemv_qkv_v4", w, x, gain, eps, qkv, rows // 2, label=label,
                 qkv=(k_cache, v_cache, pos, inv_freq, n_heads, n_kv_heads, head_dim), next_w=next_w)

    def gemv_rmsnorm(self, w, x, gain, eps: float, y, label: str = "", version: int = 3, next_w=None) -> None:
        """y [rows] fp32 = w [rows, in] · rmsnorm(x [in] fp32, gain [in] fp32): the norm fused in.
        version 3: a block reduction into shared memory (in <= MAX_FUSED_NORM); 4: each warp sums x² itself."""
        rows, n_in = w.shape
        if version >= 4 or is_quantized(w):
            self._v4("gemv_v4", w, x, gain, eps, y, (rows + 1) // 2, label=label, next_w=next_w)
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

    def kv_append_int8(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                       k_cache, v_cache, k_scale, v_scale, pos) -> None:
        """k/v of each qkv row [T, width], quantized (one scale per token and KV head) -> k_cache, v_cache
        int8 [n_kv_heads, capacity, hd] and k_scale, v_scale fp32 [n_kv_heads, capacity] at pos[0] + t."""
        self._launch("kv_append_int8", (n_tokens, n_kv_heads), (64,),
                     (qkv, np.int32(qkv.shape[-1]), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
                      k_cache, v_cache, k_scale, v_scale, np.int32(k_cache.shape[1]), pos))

    def kv_dequantize(self, k_cache, v_cache, k_scale, v_scale, n_positions: int, k_out, v_out) -> None:
        """Positions [0, n) of one layer's int8 cache -> k_out, v_out [n_kv_heads, capacity, hd] in the
        weight dtype (what prefill's tiled attention reads)."""
        n_kv, capacity, hd = k_cache.shape
        if n_positions:
            self._launch("kv_dequant", (n_positions, n_kv), (min(hd, 256),),
                         (k_cache, v_cache, k_scale, v_scale, np.int32(capacity), np.int32(hd), k_out, v_out))

    def attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache, v_cache,
                  pos, window: int | None, parts, out, scales=None) -> None:
        """Queries of each qkv row [T, width] against one layer's cache -> out [T, n_heads * hd] fp32.

        parts = (m [T, H, S], l [T, H, S], acc [T, H, S, hd]) fp32 scratch; S = n_splits is parts' last
        dim. Query t sits at pos[0] + t; window None or 0 = full causal. A fourth element, counters
        [T, H] uint32 zero-filled (and left zero), selects a one-launch kernel with the combine fused:
        v3 (settings.attention_version 3, head_dim % 8 == 0): a block per KV head and split for the whole GQA
        group, S the most splits (<= 64), fewer at run time when the context is short; else v2.
        scales = (k_scale, v_scale) [n_kv_heads, capacity] fp32: k_cache, v_cache are an int8 cache
        (kv_int8.cu), read by v3's int8 variants (they need the counters and head_dim % 8 == 0): 16 codes a
        lane where head_dim % 16 == 0 (attention_gqa*_int8x16, faster), else 8."""
        opt = self.settings
        if head_dim > MAX_HD:
            raise ValueError(f"head_dim {head_dim} > {MAX_HD}")
        part_m, part_l, part_acc = parts[:3]
        n_splits = part_m.shape[-1]
        capacity = k_cache.shape[1]
        args = (qkv, np.int32(qkv.shape[-1]), k_cache, v_cache, np.int32(capacity), np.int32(n_heads),
                np.int32(n_kv_heads), np.int32(head_dim), pos, np.int32(window or 0),
                np.float32(1.0 / math.sqrt(head_dim)))
        scratch = (part_m, part_l, part_acc)
        if scales is not None:
            if len(parts) != 4 or head_dim % 8 or n_heads % n_kv_heads:
                raise ValueError("attention over an int8 KV cache: v3 only (counters in parts, head_dim % 8 == 0)")
            args = args[:4] + tuple(scales) + args[4:]           # the scales follow the codes
        if len(parts) == 4:              # the combine fused into the last split block (parts[3]: counters)
            counters = parts[3]
            if counters.dtype != np.uint32 or counters.size < n_tokens * n_heads:
                raise ValueError("attention counters: uint32 [T, n_heads], zero-filled")
            if scales is not None or (opt.attention_version >= 3 and head_dim % 8 == 0
                                      and n_heads % n_kv_heads == 0):
                if n_splits > GQA_MAX_SPLITS:
                    raise ValueError(f"attention v3: at most {GQA_MAX_SPLITS} splits, got {n_splits}")
                group = n_heads // n_kv_heads
                gm = group if group <= 2 else 4                     # query heads per block (1, 2 or 4)
                blocks = n_kv_heads * -(-group // gm)
                most = n_splits                                     # a second wave of blocks would double the time
                if opt.attention_one_wave:
                    most = max(1, min(n_splits, getattr(self, "n_sms", 132) // blocks))
                name = f"attention_gqa{gm}" + ("" if scales is None else "_int8" if head_dim % 16
                                               or opt.attention_int8_codes_per_lane == 8 else "_int8x16")
                self._launch(name, (blocks, n_splits, n_tokens), (GQA_THREADS,),
                             args + (np.int32(opt.attention_split_keys), np.int32(most), np.int32(opt.attention_flags))
                             + scratch + (counters, out))
                return
            self._launch("attention_fused", (n_heads, n_splits, n_tokens), (32 * ATTN_WARPS,),
                         args + scratch + (counters, out))
            return
        self._launch("attention_split", (n_heads, n_splits, n_tokens), (32 * ATTN_WARPS,), args + scratch)
        self._launch("attention_combine", (n_heads, n_tokens), (128,),
                     (part_m, part_l, part_acc, out, np.int32(n_heads), np.int32(head_dim), np.int32(n_splits)))

    @staticmethod
    def prefill_attention_supported(head_dim: int) -> bool:
        """Does prefill_attention.cu have a variant for this head_dim? (else: the decode kernel)"""
        return head_dim % 4 == 0 and head_dim <= PF_HDS[-1]

    def prefill_attention_kernel(self, head_dim: int) -> str:
        """The kernel prefill_attention launches for this head_dim under the current settings: the tensor-core
        one (prefill_attention_mma.cu) with prefill_attention_version 2 and head_dim 64 or 128, else the tiled
        fp32 one (prefill_attention.cu)."""
        if self.settings.prefill_attention_version == 2 and head_dim in MM_HDS:
            return f"prefill_attention_mma_hd{head_dim}"
        return f"prefill_attention_hd{next(h for h in PF_HDS if head_dim <= h)}"

    def prefill_attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache,
                          v_cache, pos, window: int | None, out) -> None:
        """Tiled prefill attention: the T queries of each qkv row [T, width] at pos[0] + t against one layer's
        cache (their own keys already appended) -> out [T, n_heads * hd] fp32. Blocks of (token, query head)
        rows of one KV head's group share K/V tiles in shared memory: 32 rows on fp32 FMAs
        (prefill_attention.cu), or 64 on the tensor cores (prefill_attention_mma.cu, settings
        .prefill_attention_version 2, head_dim 64 or 128). No scratch. head_dim % 4 == 0 and <= 128 (see
        prefill_attention_supported)."""
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
