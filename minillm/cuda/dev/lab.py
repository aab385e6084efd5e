"""The laboratory's one entry point: every earlier kernel version and every experiment that lost, launched
beside the shipped path (llm.c's dev/cuda: the product keeps the winner, the lab keeps the ladder).

    k = LabKernels("float16", LabSettings(quant_version=3))     # the shipped kernels + the lab's
    k.gemv(w, x, y, version=2)                                   # gemv.cu v1 / v2 (v4: the shipped one)
    old = LabTransformer.of(gpu, gemv_version=2, fuse_norm=False)   # the first decode step, same weights
    tma = LabTransformer.of(gpu).with_settings(quant_version=4)

`LabSettings` are the shipped `KernelSettings` plus the lab's choices (each a version or an experiment, its
numbers in lessons/BENCHMARKS.md and lessons/BENCHMARKS_HISTORY.md); their defaults are the shipped path, so a
lab model without changes launches exactly what the engine launches. The lab's kernels are in
minillm/cuda/dev/kernels/ (they include the shipped headers from kernels/). Lessons, the course and the dev
modules reach earlier versions through here; nothing in the engine imports it.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from minillm.cuda.gpu_model import GPUTransformer
from minillm.cuda.kernels import (ATTN_WARPS, PDL_ARCH, PDL_KERNEL, QUANT_CHUNK, QWARPS, Kernels, KernelSettings,
                                  module, suffix)
from minillm.cuda.qweights import is_quantized

LAB_KERNEL_DIR = Path(__file__).parent / "kernels"
MAX_FUSED_NORM = 12000                 # gemv_rmsnorm_v3 keeps in floats in shared memory (+ static): < 48 KB
MMA_WARPS = 8                          # as #defined in gemv_quant_mma.cu (M_WARPS): warps a block
MMA_BLOCKS_PER_SM = 3                  # its grid: blocks of 8 warps (<= 85 registers a thread: 3 fit an SM)
VARIANTS = ("", "rmsnorm_", "swiglu_", "rmsnorm_swiglu_", "qkv_", "rmsnorm_qkv_")
TMA_THREADS = 32 * (8 + 1)             # as #defined in gemv_quant_tma.cu: T_WARPS consumer warps, one producer
TMA_MAX_STAGES, TMA_MAX_PAIRS = 16, 16  # T_MAX_STAGES, T_MAX_PAIRS
TMA_CHUNKS_A_THREAD = {"int8": 4, "int4": 2, "wide16": 7}   # J_MAX of Int8Tma, Int4Tma, Wide16Tma: x chunks a thread
# The kernels LabKernels launches, by source in minillm/cuda/dev/kernels (names without the dtype suffix)
LAB_KERNELS = {
    "gemv_versions": ["gemv_v1", "gemv_v2", "gemv_rmsnorm_v3"],
    # the quantized v1 (plain only) and int8's q|k|v on the 2-blocks-an-SM build
    "gemv_quant_versions": ["gemv_int8_v1", "gemv_int4_v1", "gemv_qkv_int8", "gemv_rmsnorm_qkv_int8"],
    "gemv_quant_mma": [f"gemv_{e}{m}_v3" for m in ("int8", "int4") for e in VARIANTS] + ["gemv_int8_v3u4",
                                                                                          "gemv_int4_v3u4"],
    "gemv_quant_tma": [f"gemv_{e}{m}_v4" for m in ("int8", "int4") for e in VARIANTS] + [f"gemv_{e}tma"
                                                                                         for e in VARIANTS],
}
# decode attention v1 (kernels/attention_v1.cu): the split blocks, then a combine launch (v2 fuses it)
ATTENTION_V1 = {"attention_split": "attention_split_{sfx}", "attention_combine": "attention_combine"}
# the lab's kernels that wait for the kernel ahead (pdl_wait): v1's quantized GEMV, v3 (tensor cores), v4 (TMA)
LAB_PDL_KERNEL = r"gemv_(rmsnorm_)?(swiglu_|qkv_)?(int8|int4|tma)(_v1|_v3|_v3u4|_v4)?"


@dataclass(frozen=True)
class LabSettings(KernelSettings):
    """KernelSettings plus the lab's choices; the defaults launch what the shipped path launches."""
    # the quantized GEMV: 2 = shipped (gemv_quant.cu); 1 = x as fp32 (gemv_quant_versions.cu, plain y = W·x only);
    # 3 = products on tensor cores (gemv_quant_mma.cu; int4 groups of 32 or 64 stay on v2);
    # 4 = weights streamed into shared memory by the TMA (gemv_quant_tma.cu; where tma_plan says no: v2)
    quant_version: int = 2
    quant_mma_blocks_per_sm: int = MMA_BLOCKS_PER_SM   # v3's grid (0: one block a tile of 8 row pairs)
    quant_mma_substeps: int = 2                        # v3: 2, or 4 (plain y = W·x only)
    quant_tma_blocks_per_sm: int = 2                   # v4's grid and ring of stages a block
    quant_tma_ring_bytes: int = 104 << 10
    quant_tma_lanes: int = 32                          # tma_plan: at least this many threads a row
    quant_tma_stage_share: int = 6                     # tma_plan: stages of about 1/this of the ring
    wide_tma: bool = False                             # 16-bit weights through gemv_quant_tma.cu's Wide16Tma
    wide_tma_blocks_per_sm: int = 2
    wide_tma_ring_bytes: int = 104 << 10
    qkv_one_round: bool = True                         # int8's q|k|v on its 3-blocks-an-SM build (shipped)
    attention_version: int = 3                         # 2: attention_fused (the shipped fallback) everywhere
    attention_int8_codes_per_lane: int = 16            # 8: the hd % 16 fallback everywhere
    prefill_attention_version: int = 2                 # 1: the fp32 tiles (the shipped fallback) everywhere
    prefill_widen_ahead: bool = False                  # int8/int4 prefill: widen one GEMM ahead, second stream
    prefill_widen_priority: int = 0                    # that stream's priority (lower: more urgent)


def lab_settings(settings: KernelSettings | None = None, **changes) -> LabSettings:
    """settings (shipped or lab) as LabSettings, with changes."""
    base = settings if isinstance(settings, LabSettings) else LabSettings(**asdict(settings or KernelSettings()))
    return replace(base, **changes)


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


def lab_source(name: str) -> str:
    """minillm/cuda/dev/kernels/NAME.cu with its includes pasted (shipped headers from kernels/)."""
    from minillm.cuda.kernels import kernel_source
    return kernel_source(name, LAB_KERNEL_DIR)


def lab_module(name: str):
    """The compiled RawModule of minillm/cuda/dev/kernels/NAME.cu (once per process)."""
    return module(name, LAB_KERNEL_DIR)


class LabKernels(Kernels):
    """The shipped Kernels plus the lab's versions: gemv(version=1|2|4), gemv_rmsnorm(version=3|4), and the
    LabSettings choices. A lab module compiles the first time settings choose it, never inside a capture:
    with_settings loads what the new settings launch."""

    def __init__(self, dtype: str = "float16", settings: KernelSettings = LabSettings()):
        super().__init__(dtype, lab_settings(settings))
        self._load_chosen()

    @classmethod
    def of(cls, k: Kernels, **changes) -> "LabKernels":
        """The lab's view of shipped Kernels k (sharing its loaded functions), with settings changes."""
        lab = cls.__new__(cls)
        lab.__dict__.update(k.__dict__)
        lab.fn = dict(k.fn)                      # the lab's functions go into its own table
        lab.settings = lab_settings(k.settings, **changes)
        lab._load_chosen()
        return lab

    def with_settings(self, **changes) -> "LabKernels":
        other = copy.copy(self)
        other.settings = replace(self.settings, **changes)
        other._load_chosen()
        return other

    def _load(self, source: str, names: list[str]) -> None:
        """Kernels `names` (without the dtype suffix) of minillm/cuda/dev/kernels/SOURCE.cu into self.fn."""
        sfx = suffix(self.dtype)
        for name in names:
            if name not in self.fn:
                f = self.fn[name] = lab_module(source).get_function(f"{name}_{sfx}")
                getattr(f, "attributes", None)                  # NVRTC + module load now, not in a capture
                if "int8" in name or "int4" in name or "tma" in name:
                    f.max_dynamic_shared_size_bytes = self.max_quant_smem

    def _load_chosen(self) -> None:
        s = self.settings
        self._load("gemv_versions", LAB_KERNELS["gemv_versions"])
        if s.quant_version == 1 or not s.qkv_one_round:
            self._load("gemv_quant_versions", LAB_KERNELS["gemv_quant_versions"])
        if s.quant_version == 3:
            self._load("gemv_quant_mma", LAB_KERNELS["gemv_quant_mma"])
        if s.quant_version == 4 or s.wide_tma:
            self._load("gemv_quant_tma", LAB_KERNELS["gemv_quant_tma"])
        for key, name in ATTENTION_V1.items():                        # attention v1: kernels/attention_v1.cu
            if key not in self.fn:
                self.fn[key] = lab_module("attention_v1").get_function(name.format(sfx=suffix(self.dtype)))

    def uses_pdl(self, name: str) -> bool:
        lab = re.fullmatch(LAB_PDL_KERNEL, name) is not None
        return self.settings.pdl and self.arch >= PDL_ARCH and (PDL_KERNEL.fullmatch(name) is not None or lab)

    # ---- the 16-bit GEMV's versions ---------------------------------------------------------------
    def gemv(self, w, x, y, accumulate: bool = False, label: str = "", version: int = 4) -> None:
        """version 1, 2 (gemv_versions.cu: 8 rows a block, one warp a row) or 4 (the shipped gemv.cu)."""
        if version >= 4 or is_quantized(w):
            super().gemv(w, x, y, accumulate, label)
            return
        rows, n_in = w.shape
        if n_in % 8:
            raise ValueError(f"gemv needs in % 8 == 0, got {n_in}")
        self._launch(f"gemv_v{version}", ((rows + 7) // 8,), (256,),
                     (w, x, y, np.int32(rows), np.int32(n_in), np.int32(1 if accumulate else 0)), label)

    def gemv_rmsnorm(self, w, x, gain, eps: float, y, label: str = "", version: int = 4) -> None:
        """version 3: the norm through shared memory (gemv_versions.cu, in <= MAX_FUSED_NORM); 4: shipped."""
        if version >= 4 or is_quantized(w):
            super().gemv_rmsnorm(w, x, gain, eps, y, label)
            return
        rows, n_in = w.shape
        if n_in % 8 or n_in > MAX_FUSED_NORM:
            raise ValueError(f"gemv_rmsnorm needs in % 8 == 0 and in <= {MAX_FUSED_NORM}, got {n_in}")
        self._launch("gemv_rmsnorm_v3", ((rows + 15) // 16,), (512,),
                     (w, x, gain, np.float32(eps), y, np.int32(rows), np.int32(n_in)), label, shared_mem=4 * n_in)

    def _v4(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None) -> None:
        plan = self.wide_tma_plan(w) if self.settings.wide_tma and not is_quantized(w) else None
        if plan is None:
            super()._v4(name, w, x, gain, eps, y, pairs, accumulate, label, qkv)
            return
        # gemv_quant_tma.cu's 16-bit twin: the matrix as 16-byte chunks, v2's signature
        rows, n_in = w.shape
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        self._launch(name.replace("_v4", "_tma"), (self._tma_grid(pairs, plan, self.settings.wide_tma_blocks_per_sm),),
                     (TMA_THREADS,), self._quant_args(w, self._nil_f32, self._nil_u16, n_in // 8, 0, 1, x, gain, eps,
                                                      n_in, pairs, y, rows, accumulate, qkv) + plan.args,
                     label, shared_mem=plan.smem)

    # ---- the quantized GEMV's versions ------------------------------------------------------------
    def _quant(self, name, w, x, gain, eps, y, pairs, accumulate=False, label="", qkv=None) -> None:
        s = self.settings
        cpg = max(1, w.group_size // 32)
        plan = self.tma_plan(w) if s.quant_version == 4 else None
        v3 = s.quant_version == 3 and (w.method == "int8" or cpg % 4 == 0)
        v2_two_blocks = s.quant_version == 2 and not s.qkv_one_round and "qkv" in name and w.method == "int8"
        if plan is None and not v3 and s.quant_version != 1 and not v2_two_blocks:
            super()._quant(name, w, x, gain, eps, y, pairs, accumulate, label, qkv)      # the shipped v2
            return
        rows, n_in = w.shape
        name = name.replace("_v4", f"_{w.method}")
        if gain is not None:
            name = name.replace("gemv_", "gemv_rmsnorm_", 1)
        chunk, sums = QUANT_CHUNK[w.method], (4 * w.n_chunks if w.method == "int4" else 0)
        grid, block, extra = self.quant_grid(pairs), 32 * QWARPS, ()
        if plan is not None:
            # v4: the ring of stages in shared memory, one producer warp + 8 consumer warps a block, each block
            # looping over stages of plan.pairs_a_stage row pairs
            name += "_v4"
            smem, block = plan.smem, TMA_THREADS
            grid, extra = self._tma_grid(pairs, plan, s.quant_tma_blocks_per_sm), plan.args
        elif v3:
            # v3: x as fp16 in the mma's k order, n_chunks rounded up to a warp step (4 chunks a sub-step); int8:
            # 32 bytes a chunk + an offset a step; int4: 80 bytes a chunk + (Z, X) per 4 chunks
            if s.quant_mma_substeps == 4 and name != f"gemv_{w.method}":
                raise ValueError(f"{name}: v3 with 4 sub-steps a warp step is kept for plain y = W·x only")
            name += "_v3" if s.quant_mma_substeps == 2 else "_v3u4"
            n_pad = -(-w.n_chunks // (4 * s.quant_mma_substeps)) * 4 * s.quant_mma_substeps
            smem = n_pad * 82 if w.method == "int4" else n_pad * 32 + 4 * n_pad // (4 * s.quant_mma_substeps)
            grid, block = self.mma_grid(pairs), 32 * MMA_WARPS
        elif s.quant_version == 1:   # v1: x as fp32, chunk + 4 floats a chunk (+ Σx per chunk, int4)
            if name != f"gemv_{w.method}":
                raise ValueError(f"{name}: the v1 quantized GEMV is kept for plain y = W·x only")
            name += "_v1"
            smem = w.n_chunks * (chunk + 4) * 4 + sums
        else:                        # v2, int8's q|k|v on the 2-blocks-an-SM build (the _3b kernels' rival)
            smem = w.n_chunks * (chunk // 2 + 5) * 4 + sums
        if smem > self.max_quant_smem:
            raise ValueError(f"{name}: a {n_in}-wide row needs {smem} bytes of shared memory for x "
                             f"(this device allows {self.max_quant_smem})")
        self._launch(name, (grid,), (block,),
                     self._quant_args(w.qweight, w.scales, self._nil_u16 if w.mins is None else w.mins, w.n_chunks,
                                      w.n_groups, cpg, x, gain, eps, n_in, pairs, y, rows, accumulate, qkv) + extra,
                     label, shared_mem=smem)

    def _tma_grid(self, pairs: int, plan: TmaPlan, blocks_per_sm: int) -> int:
        """gemv_quant_tma.cu's grid: a block per stage of pairs, at most blocks_per_sm an SM (each looping)."""
        return min(-(-pairs // plan.pairs_a_stage), blocks_per_sm * self.n_sms)

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

    # ---- attention: v1, and the shipped fallbacks everywhere -----------------------------------------
    def attention(self, qkv, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, k_cache, v_cache,
                  pos, window: int | None, parts, out, scales=None) -> None:
        """Kernels.attention; parts without counters (m, l, acc): v1, the split blocks, then a combine launch."""
        if len(parts) == 4:
            super().attention(qkv, n_tokens, n_heads, n_kv_heads, head_dim, k_cache, v_cache, pos, window, parts,
                              out, scales)
            return
        if scales is not None:
            raise ValueError("attention over an int8 KV cache: v3 only (counters in parts)")
        n_splits = parts[0].shape[-1]
        self._launch("attention_split", (n_heads, n_splits, n_tokens), (32 * ATTN_WARPS,),
                     (qkv, np.int32(qkv.shape[-1]), k_cache, v_cache, np.int32(k_cache.shape[1]), np.int32(n_heads),
                      np.int32(n_kv_heads), np.int32(head_dim), pos, np.int32(window or 0),
                      np.float32(1.0 / math.sqrt(head_dim))) + tuple(parts))
        self._launch("attention_combine", (n_heads, n_tokens), (128,),
                     tuple(parts) + (out, np.int32(n_heads), np.int32(head_dim), np.int32(n_splits)))

    def attention_kernel(self, head_dim: int, n_heads: int, n_kv_heads: int, int8: bool = False) -> str:
        name = super().attention_kernel(head_dim, n_heads, n_kv_heads, int8)
        if not int8 and self.settings.attention_version == 2:
            return "attention_fused"
        if int8 and self.settings.attention_int8_codes_per_lane == 8:
            return name.replace("_int8x16", "_int8")
        return name

    def prefill_attention_kernel(self, head_dim: int) -> str:
        name = super().prefill_attention_kernel(head_dim)
        if self.settings.prefill_attention_version == 1 and "_mma_" in name:
            return name.replace("_mma_", "_")
        return name


class LabTransformer(GPUTransformer):
    """GPUTransformer with the lab's decode steps and prefill: gemv_version 2 (gemv_versions.cu: rope, KV append
    and SwiGLU as their own launches; fuse_norm then uses v3) or 4 (shipped; fuse_norm=False: a separate rmsnorm
    launch before each normed GEMV), and LabSettings.prefill_widen_ahead. Made from a model by `of` (sharing
    its weights and buffers: run one of the two at a time)."""

    @classmethod
    def of(cls, gpu: GPUTransformer, gemv_version: int = 4, fuse_norm: bool = True, **settings) -> "LabTransformer":
        lab = cls.__new__(cls)
        lab.__dict__.update(gpu.__dict__)
        lab.k = LabKernels.of(gpu.k, **settings)
        lab._set_ladder(gemv_version, fuse_norm)
        lab._ahead_parts = lab._ahead = None
        return lab

    def _set_ladder(self, gemv_version: int, fuse_norm: bool) -> None:
        if self.quant and gemv_version < 4:
            raise ValueError("int8/int4 weights decode with the v4-shaped kernels only (gemv_version=4)")
        self.gemv_version, self.fuse_norm = gemv_version, fuse_norm

    def with_options(self, **options) -> "LabTransformer":
        """GPUTransformer.with_options, and gemv_version, fuse_norm."""
        ladder = {name: options.pop(name, getattr(self, name)) for name in ("gemv_version", "fuse_norm")}
        other = super().with_options(**options)
        other._set_ladder(**ladder)
        return other

    def _fused(self) -> bool:
        """Is the RMSNorm folded into the GEMV that follows it? (v3 keeps x in shared memory: dim-bound)"""
        return self.fuse_norm and (self.gemv_version >= 4 or self.config.dim <= MAX_FUSED_NORM)

    def _norm_input(self, gain):
        """(GEMV input, gain to fuse or None): x itself when the norm is fused, else rmsnorm(x) in self.h."""
        if self._fused():
            return self.x[0], gain
        self.k.rmsnorm(self.x, gain, self.h, self.config.norm_eps)
        return self.h[0], None

    def _norm_gemv(self, x, gain, w, out, label: str) -> None:
        """out [1, rows] = w · rmsnorm(x [1, dim]): one fused kernel (v3/v4) or rmsnorm then GEMV."""
        if self._fused():
            self.k.gemv_rmsnorm(w, x[0], gain, self.config.norm_eps, out[0], label,
                                version=4 if self.gemv_version >= 4 else 3)
        else:
            self.k.rmsnorm(x, gain, self.h, self.config.norm_eps)
            self.k.gemv(w, self.h[0], out[0], False, label, version=self.gemv_version)

    def decode_step(self, cache, n_layers: int | None = None) -> None:
        if self.gemv_version >= 4 and self.fuse_norm:
            super().decode_step(cache, n_layers)
            return
        c, k, v = self.config, self.k, self.gemv_version
        layers, hd = self.layers[:n_layers], self.config.head_dim
        parts = self._decode_parts(cache)
        k.embed(self.step_tokens, self.embed, self.x)                                  # [1, dim]
        if v >= 4:                     # the shipped step with the norms as their own launches
            x = self.x[0]
            for i, L in enumerate(layers):
                src, gain = self._norm_input(L.attn_norm)
                into = (None, None) if self.kv_cache == "int8" else (cache.k[i], cache.v[i])
                k.gemv_qkv(L.wqkv, src, gain, c.norm_eps, self.qkv[0], self.step_pos, self.inv_freq,
                           *into, c.n_heads, c.n_kv_heads, hd, "qkv")
                if self.kv_cache == "int8":
                    self._append_kv(i, cache, self.qkv, 1)
                self._attend(i, cache, self.qkv, 1, parts, self.attn)
                k.gemv(L.wo, self.attn[0], x, True, "o")
                src, gain = self._norm_input(L.mlp_norm)
                k.gemv_swiglu(L.w_gate_up, src, gain, c.norm_eps, self.act[0], "gate_up")
                k.gemv(L.w_down, self.act[0], x, True, "down")
            self._norm_gemv(self.x, self.final_norm, self.lm_head, self.logits[None], "lm_head")
            return
        for i, L in enumerate(layers):     # the first step: every operation its own launch
            self._norm_gemv(self.x, L.attn_norm, L.wqkv, self.qkv, "qkv")               # [1, qkv_width]
            k.rope(self.qkv, 1, c.n_heads + c.n_kv_heads, hd, self.step_pos, self.inv_freq)
            self._append_kv(i, cache, self.qkv, 1)
            self._attend(i, cache, self.qkv, 1, parts if self.kv_cache == "int8" else parts[:3], self.attn)
            k.gemv(L.wo, self.attn[0], self.x[0], True, "o", version=v)                # x += o_proj(attn)
            self._norm_gemv(self.x, L.mlp_norm, L.w_gate_up, self.gu, "gate_up")       # [1, 2 * ffn]
            k.swiglu(self.gu, self.act)                                                # [1, ffn]
            k.gemv(L.w_down, self.act[0], self.x[0], True, "down", version=v)          # x += down(act)
        self._norm_gemv(self.x, self.final_norm, self.lm_head, self.logits[None], "lm_head")   # [vocab]

    # ---- prefill: int8/int4 matrices widened one GEMM ahead (LabSettings.prefill_widen_ahead) -----------
    def _prefill_buffers(self, T: int):
        self._widening_parts()           # outside any capture: _prefill_chunk and _rows_by_graph call this first
        return super()._prefill_buffers(T)

    def _prefill_layers(self, ops, b, layers):
        self._ahead = self._plan_widening(layers)
        try:
            return super()._prefill_layers(ops, b, layers)
        finally:
            self._ahead = None

    def _plan_widening(self, layers):
        """The one-GEMM-ahead widening of these layers' quantized matrices, in the order the layer loop's GEMMs
        read them (None: no quantized matrix, prefill_widen_ahead off, or its buffers not allocated yet)."""
        from minillm.cuda.dev.widen_ahead import WidenAhead
        order = [w for L in layers for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down) if is_quantized(w)]
        if not order or not self.settings.prefill_widen_ahead or self._ahead_parts is None:
            return None
        second, side, events = self._ahead_parts
        return WidenAhead(self.k.dequantize, order, (self._dense_scratch, second), self.stream, side, events)

    def _dense(self, w):
        if is_quantized(w) and self._ahead is not None:     # prefill's layer loop: widened one GEMM ahead
            return self._ahead.dense(w)
        return super()._dense(w)

    def _widening_parts(self) -> None:
        """Allocate what widening ahead needs (once, and not while a graph is captured)."""
        if self._dense_scratch is None or self._ahead_parts is not None or not self.settings.prefill_widen_ahead:
            return
        import cupy as cp
        side = cp.cuda.Stream(non_blocking=True, priority=self.settings.prefill_widen_priority)
        self._ahead_parts = (cp.empty_like(self._dense_scratch), side,
                             tuple(cp.cuda.Event(disable_timing=True) for _ in range(3)))


def lab_fields() -> list[str]:
    """Every setting a lab variant may change (the shipped tunings and the lab's choices)."""
    return [f.name for f in fields(LabSettings)]


def as_lab(k: Kernels) -> LabKernels:
    """k itself if it is the lab's, else the lab's kernels around it (sharing its loaded functions)."""
    return k if isinstance(k, LabKernels) else LabKernels.of(k)


def as_lab_model(gpu: GPUTransformer) -> LabTransformer:
    """gpu itself if it is the lab's, else the lab's model around it (sharing its weights and buffers)."""
    return gpu if isinstance(gpu, LabTransformer) else LabTransformer.of(gpu)
