"""The serving engine's few-row products on the tensor cores (kernels/gemm_small_m_mma.cu).

    out [T, rows] fp32 (+)= x [T, in] 16-bit @ w [rows, in]ᵀ,   T <= 64

A batched decode step multiplies every weight by its B <= 64 new tokens: still a weight stream (64 multiply-adds
a weight byte), where cuBLAS reaches 50-60% of the copy bandwidth on the H200. The kernel streams W through a
4-stage cp.async pipeline and multiplies it on the tensor cores against every row of x at once; a matrix with
few 128-row tiles is split along k over a thread block cluster of S blocks (S = 1, 2, 4, 8), whose partials
meet in shared memory in a fixed order (deterministic). `split_for` picks S so the grid fills the GPU once.

Measured on the H200 (lessons/BENCHMARKS.md, issue 25): right (fp32-exact against NumPy, deterministic) but
SLOWER than cuBLAS at every T (a Mistral-7B layer at T = 64: 314-382 µs against cuBLAS's ~180-206; 47-54% of
copy at T = 1): with 8-12 warps an SM, mma.sync's fixed-latency dependencies and the per-stage barrier, not
the bytes, set its time (Nsight Compute: 2.1 of 4.3 cycles between issues stalled on them). So the engine
keeps cuBLAS; `python -m minillm.cuda.dev.small_m_mma [--variants]` reruns the comparison. Not tried yet:
launches captured in a CUDA graph (a first try inside the decode graph read garbage; the compile-time cluster
dimensions may need cuLaunchKernelEx's cluster attribute there), wgmma + TMA (Hopper's own path).

`BatchGemm(dtype).usable(x, w)` says whether a product fits the kernel; importing this module does not import CuPy.
"""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from minillm.cuda.kernels import kernel_source, module, suffix

SOURCE = "gemm_small_m_mma"                       # kernels/gemm_small_m_mma.cu
SPLITS = (1, 2, 4, 8)                             # cluster sizes compiled (gemm_mma_s{S})
KERNELS = {f"s{s}": f"gemm_mma_s{s}_{{sfx}}" for s in SPLITS}
MAX_T = 64                                        # GM_MAX_T
SM_SHARED = 227 * 1024                            # shared memory a block may have on sm_90 (an SM: 228 KB)
MIN_K_TILES = 4                                   # each block of a split keeps at least this many stages to stream


@dataclass(frozen=True)
class Variant:
    """The kernel's compile-time shape (GM_WARPS, GM_BK, GM_STAGES there); the default is what measured best."""
    warps: int = 4          # warps along W's rows (32 rows each)
    bk: int = 64
    stages: int = 4
    tw: int = 1             # warps along X's rows (each takes 8 / tw of the n8 tiles)

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.tw

    @property
    def rows(self) -> int:                        # W rows a block: 32 a warp
        return 32 * self.warps

    @property
    def smem(self) -> int:                        # GM_SMEM_BYTES: the stages of W and X tiles
        return self.stages * (self.rows + MAX_T) * self.bk * 2

    @property
    def blocks_per_sm(self) -> int:
        return max(1, SM_SHARED // (self.smem + 1024))

    def options(self) -> tuple[str, ...]:
        return (f"-DGM_WARPS={self.warps}", f"-DGM_BK={self.bk}", f"-DGM_STAGES={self.stages}", f"-DGM_TW={self.tw}")


DEFAULT = Variant()


def split_for(rows: int, n_in: int, sms: int, v: Variant = DEFAULT) -> int:
    """The cluster size S: the largest that keeps the grid (row tiles x S blocks) within one wave of
    the blocks an SM holds, and every block at least MIN_K_TILES stages of k."""
    tiles = -(-rows // v.rows)
    k_tiles = -(-n_in // v.bk)
    fits = [s for s in SPLITS if tiles * s <= sms * v.blocks_per_sm and k_tiles >= MIN_K_TILES * s]
    return max(fits, default=1)


class BatchGemm:
    """Launch helper for one 16-bit weight dtype; launches go on CuPy's current stream."""

    def __init__(self, dtype: str = "float16", variant: Variant = DEFAULT):
        import cupy as cp
        sfx = suffix(dtype)
        self.v = variant
        mod = (module(SOURCE) if variant == DEFAULT else
               cp.RawModule(code=kernel_source(SOURCE), options=("--std=c++17",) + variant.options()))
        self.fn = {s: mod.get_function(KERNELS[f"s{s}"].format(sfx=sfx)) for s in SPLITS}
        for f in self.fn.values():                 # over the 48 KB a kernel gets without asking, and the
            f.max_dynamic_shared_size_bytes = variant.smem           # split of L1 that gives shared memory the most
            f.preferred_shared_memory_carveout = 100
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.weight_dtype = np.dtype(np.float16 if dtype == "float16" else np.uint16)

    def usable(self, x, w) -> bool:
        """Whether out = x @ wᵀ fits the kernel: 1..64 rows of x, in % 8 == 0, both 16-bit of the weights'
        type and C-contiguous (w a plain 16-bit matrix, not a quantized one)."""
        return (getattr(w, "ndim", 0) == 2 and w.dtype == self.weight_dtype and x.dtype == self.weight_dtype
                and 1 <= x.shape[0] <= MAX_T and x.shape[1] == w.shape[1] and w.shape[1] % 8 == 0
                and x.flags.c_contiguous and w.flags.c_contiguous)

    def __call__(self, x, w, out, accumulate: bool = False) -> None:
        """out [T, rows] fp32 (+)= x [T, in] @ w [rows, in]ᵀ."""
        T, n_in = x.shape
        rows = w.shape[0]
        if not self.usable(x, w) or out.shape != (T, rows) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"gemm_small_m_mma: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, out {out.shape} "
                             f"(T <= {MAX_T}, in % 8 == 0, contiguous)")
        s = split_for(rows, n_in, self.sms, self.v)
        grid = -(-rows // self.v.rows) * s
        self.fn[s]((grid,), (self.v.threads,), (w, x, out, np.int32(rows), np.int32(n_in), np.int32(T),
                                                  np.int32(accumulate)), shared_mem=self.v.smem)
