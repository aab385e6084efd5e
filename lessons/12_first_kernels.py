"""Lesson 12 — writing the first kernels: RMSNorm and SwiGLU, from the CPU loop to a coalesced, warp-reduced kernel.

Lesson 11 ran the engine's NumPy code on CuPy: correct, but every line became its own kernel. Here we
write two kernels by hand, the way llm.c's dev/cuda does: a CPU reference, then version 1, version 2,
each checked against the reference and timed over sizes from one decode token to a long prefill.

    RMSNorm  out[t, i] = x[t, i] · rsqrt(mean_i x[t, i]² + eps) · gain[i]      a reduction over each row
    SwiGLU   out[t, i] = silu(gate[t, i]) · up[t, i]                           elementwise, gate|up in one row

v1 puts the CPU loop on the GPU as it is: one thread per row. v2 gives every element a thread: RMSNorm
uses a block of threads per row, 16-byte loads, and sums with warp shuffles; SwiGLU uses one thread per
4 outputs. The engine's kernels/rmsnorm.cu and swiglu.cu run beside them. Both operations read and
write each byte once, so their speed is achieved GB/s against the GPU's copy bandwidth.

The order of a parallel sum decides its last bits: we emulate the block's order in NumPy (exercise 12),
compare its error with a one-thread sum on the CPU, and on the GPU check the emulation bit for bit.

Exercise 12.2 is v2's RMSNorm written by you: a block per row, graded on a GPU (elsewhere "not graded").

Run: python lessons/12_first_kernels.py      (MINILLM_LESSON_QUICK=1 for a smoke run)
Without a GPU the lesson runs the NumPy references, the reduction-order study and the compile of the
kernels (nvcc, NVRTC), and lists the GPU measurements it skipped.
"""
ABOUT = {                   # `minillm lesson N --about` prints this (minillm/course/lessons.py)
    "prerequisites": [
        "lesson 11 (NumPy to CuPy)",
        "basic C syntax",
    ],
    "objectives": [
        "write RMSNorm and SwiGLU kernels: a thread per row, then a block per row with warp shuffles",
        "sum in a tree and see that the order fixes the bits",
        "read registers per thread from the compiler",
    ],
    "study_time": "60 min, plus 30 min for exercise 12 (a block's fp32 sum)",
    "check_questions": [
        "Why does a block per row with shuffles beat a thread per row?",
        "Why does a tree sum give different bits from a sequential one, and which is more accurate?",
    ],
    "try_this": [
        "change the block size of the xor-shuffle tree and compare the sum's error",
        "on a GPU: compare the kernels' GB/s with the copy bandwidth",
    ],
}
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # stable timings on a shared machine (lesson 08)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

import numpy as np

from minillm.course.measure import Spread, load_line
from minillm.course import block_sum_reference, print_table, quick, run_gpu_parts, why_no_gpu
from minillm.model.layers import rmsnorm, silu

EPS = 1e-5

# NEW: the kernels. Each version's comment says what it changes and why it should be faster. ------------
KERNELS = r"""
// ---- RMSNorm: out[t, i] = x[t, i] * rsqrt(mean_i x[t, i]^2 + eps) * gain[i]      x, out: [T, dim] fp32

// v1: one thread per row: the CPU loop, moved to the GPU as it is. At decode (T = 1) a single thread of
// the whole GPU does the work, one load after another. At prefill the 32 threads of a warp read 32 rows,
// `dim` floats apart: every load instruction touches 32 cache lines (uncoalesced).
extern "C" __global__ void rmsnorm_v1(const float* x, const float* gain, float* out, int T, int dim, float eps) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* row = x + (size_t)t * dim;
    float ss = 0.0f;
    for (int i = 0; i < dim; i++) ss += row[i] * row[i];
    float inv_rms = rsqrtf(ss / (float)dim + eps);
    for (int i = 0; i < dim; i++) out[(size_t)t * dim + i] = row[i] * inv_rms * gain[i];
}

// Sum over the 32 lanes of a warp in registers: lane l adds the value of lane l ^ o, o = 16, 8, 4, 2, 1.
// After five rounds every lane holds the total (no shared memory, no barrier).
__device__ __forceinline__ float warp_sum_xor(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// v2: one block per row. Thread j loads float4 number j, j + blockDim, ... : 16 bytes a load, and the 32
// lanes of a warp read 512 contiguous bytes (coalesced). Partial sums meet in two rounds of shuffles:
// within each warp, then across warps through 32 floats of shared memory and one barrier. Every warp
// does the second round itself, so all threads get the total without a second barrier (the engine's
// block_sum lets warp 0 do it and broadcasts through shared memory). Needs dim % 4 == 0.
extern "C" __global__ void rmsnorm_v2(const float* __restrict__ x, const float* __restrict__ gain,
                                      float* __restrict__ out, int dim, float eps) {
    __shared__ float warp_sums[32];
    const float4* row = reinterpret_cast<const float4*>(x + (size_t)blockIdx.x * dim);
    const float4* g4 = reinterpret_cast<const float4*>(gain);
    float4* dst = reinterpret_cast<float4*>(out + (size_t)blockIdx.x * dim);
    int n4 = dim >> 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        float4 v = row[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = warp_sum_xor(ss);
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    float total = warp_sum_xor(lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.0f);
    float inv_rms = rsqrtf(total / (float)dim + eps);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {    // the row again: from L1/L2, not from memory
        float4 v = row[i], g = g4[i];
        dst[i] = make_float4(v.x * inv_rms * g.x, v.y * inv_rms * g.y, v.z * inv_rms * g.z, v.w * inv_rms * g.w);
    }
}

// ---- SwiGLU: out[t, i] = silu(g) * u, g = gu[t, i], u = gu[t, ffn + i]       gu: [T, 2 ffn], out: [T, ffn]

// v1: one thread per row, the CPU loop as it is (the same two faults as rmsnorm_v1).
extern "C" __global__ void swiglu_v1(const float* gu, float* out, int T, int ffn) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    for (int i = 0; i < ffn; i++) {
        float g = gu[(size_t)t * 2 * ffn + i], u = gu[(size_t)t * 2 * ffn + ffn + i];
        out[(size_t)t * ffn + i] = g / (1.0f + expf(-g)) * u;
    }
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// v2: one thread per 4 outputs: a 16-byte load of 4 gates, one of the 4 matching ups, one 16-byte store.
// Grid (ffn / 4 / 256, T): every output has a thread, a warp reads 512 contiguous bytes per load, and
// no thread loops. Needs ffn % 4 == 0.
extern "C" __global__ void swiglu_v2(const float* __restrict__ gu, float* __restrict__ out, int ffn) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;               // which 4 outputs of row t
    if (j >= (ffn >> 2)) return;
    size_t t = blockIdx.y;
    float4 g = reinterpret_cast<const float4*>(gu + t * 2 * ffn)[j];
    float4 u = reinterpret_cast<const float4*>(gu + t * 2 * ffn + ffn)[j];
    reinterpret_cast<float4*>(out + t * ffn)[j] =
        make_float4(silu_mul(g.x, u.x), silu_mul(g.y, u.y), silu_mul(g.z, u.z), silu_mul(g.w, u.w));
}
"""

# The engine's block reduction (kernels/common.cuh's block_sum, as rmsnorm.cu calls it) on plain values:
# its result, bit for bit, against exercise 12's NumPy emulation. Adds only, so no FMA can change the bits.
BLOCK_SUM = r"""
extern "C" __global__ void row_block_sum(const float* values, float* sums, int n) {
    const float* row = values + (size_t)blockIdx.x * n;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += row[i];
    float total = block_sum(s);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
}
"""
# -------------------------------------------------------------------------------------------------------


def swiglu_reference(gu: np.ndarray) -> np.ndarray:
    """The CPU reference: silu(gate) · up with gate|up in one row, as the engine's MLP computes it.
    gu [T, 2 ffn] -> [T, ffn]"""
    ffn = gu.shape[1] // 2
    return silu(gu[:, :ffn]) * gu[:, ffn:]


def rmsnorm_bytes(T: int, dim: int) -> int:
    return 4 * (2 * T * dim + dim)                      # read x and the gain, write out


def swiglu_bytes(T: int, ffn: int) -> int:
    return 4 * 3 * T * ffn                              # read gate and up, write out


def sizes(small: bool) -> tuple[list, list]:
    """(T, dim) for RMSNorm and (T, ffn) for SwiGLU: SmolLM2 and Mistral-7B widths, decode to prefill."""
    if small:
        return [(1, 576), (64, 4096)], [(1, 1536), (64, 14336)]
    return ([(1, 576), (1, 4096), (512, 4096), (8192, 4096)], [(1, 1536), (1, 14336), (512, 14336), (4096, 14336)])


def sequential_sum(v: np.ndarray) -> np.ndarray:
    """Each row summed left to right in fp32: one thread's order (kernel v1).   [rows, n] -> [rows]"""
    acc = np.zeros(v.shape[0], np.float32)
    for i in range(v.shape[1]):
        acc = acc + v[:, i]
    return acc


def ptxas_report(source: str) -> dict[str, dict] | str:
    """Registers, shared memory and spills of each kernel, from `nvcc -arch=sm_90 -Xptxas -v`; or why not."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "nvcc is not on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "lesson12.cu"
        cu.write_text(source)
        done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(Path(tmp) / "k.cubin"),
                               str(cu)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"nvcc failed:\n{done.stderr}"
    report, name = {}, None
    for line in done.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
            report[name] = {"registers": 0, "smem": 0, "spills": 0}
        elif name and (m := re.search(r"(\d+) bytes spill stores", line)):
            report[name]["spills"] = int(m.group(1))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            report[name]["registers"] = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            report[name]["smem"] = int(smem.group(1)) if smem else 0
    return report


def nvrtc_check(source: str) -> str:
    """Compile with NVRTC for compute_90, as CuPy's RawModule does at run time (no GPU needed)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - no CuPy, or no NVRTC library
        return f"skipped: NVRTC not available ({type(e).__name__})"
    prog = nvrtc.createProgram(source, "lesson12.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90", "--std=c++17"])
        return "compiles"
    except Exception:  # noqa: BLE001 - the log says why
        return "FAILED:\n" + nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def common_cuh() -> str:
    from minillm.cuda.kernels import KERNEL_DIR
    return (KERNEL_DIR / "common.cuh").read_text()


# NEW: launching each version, as the engine's Kernels class would --------------------------------------
class Versions:
    """The lesson's kernels and the engine's, compiled by CuPy (NVRTC), each with its launch shape."""

    def __init__(self):
        import cupy as cp
        from minillm.cuda.kernels import _grid_for, module
        self.cp, self.grid_for = cp, _grid_for
        lesson = cp.RawModule(code=KERNELS, options=("--std=c++17",))
        self.k = {name: lesson.get_function(name) for name in ("rmsnorm_v1", "rmsnorm_v2", "swiglu_v1", "swiglu_v2")}
        self.k["rmsnorm engine"] = module("rmsnorm").get_function("rmsnorm_f32")
        self.k["swiglu engine"] = module("swiglu").get_function("swiglu_f32")
        engine_sum = cp.RawModule(code=common_cuh() + BLOCK_SUM, options=("--std=c++17",))
        self.block_sum = engine_sum.get_function("row_block_sum")

    def rmsnorm(self, version: str, x, gain, out) -> None:
        T, dim = x.shape
        if version == "v1":
            self.k["rmsnorm_v1"](((T + 127) // 128,), (128,),
                                 (x, gain, out, np.int32(T), np.int32(dim), np.float32(EPS)))
        elif version == "v2":
            if dim % 4:
                raise ValueError(f"rmsnorm_v2 needs dim % 4 == 0, got {dim}")
            threads = min(256, 32 * -(-dim // 128))      # one float4 per thread up to 256 threads, whole warps
            self.k["rmsnorm_v2"]((T,), (threads,), (x, gain, out, np.int32(dim), np.float32(EPS)))
        else:                                            # kernels/rmsnorm.cu, as Kernels.rmsnorm launches it
            self.k["rmsnorm engine"]((T,), (256,), (x, gain, out, np.int32(dim), np.float32(EPS)))

    def swiglu(self, version: str, gu, out) -> None:
        T, ffn = out.shape
        if version == "v1":
            self.k["swiglu_v1"](((T + 127) // 128,), (128,), (gu, out, np.int32(T), np.int32(ffn)))
        elif version == "v2":
            if ffn % 4:
                raise ValueError(f"swiglu_v2 needs ffn % 4 == 0, got {ffn}")
            self.k["swiglu_v2"]((-(-ffn // 1024), T), (256,), (gu, out, np.int32(ffn)))
        else:                                            # kernels/swiglu.cu, as Kernels.swiglu launches it
            self.k["swiglu engine"]((self.grid_for(T * ffn),), (256,), (gu, out, np.int32(ffn), np.int32(T)))
# -------------------------------------------------------------------------------------------------------

VERSIONS = ("v1", "v2", "engine")


def main():
    small = quick()
    rms_sizes, swi_sizes = sizes(small)
    rng = np.random.default_rng(0)

    # 1. The CPU reference, timed on this machine (the GPU rows come later).
    cpu_rows = []
    for name, cases, make, ref, nbytes in (
            ("RMSNorm", rms_sizes, lambda T, d: ((rng.standard_normal((T, d)) * 3).astype(np.float32),),
             lambda x: rmsnorm(x, np.ones(x.shape[1], np.float32), EPS), rmsnorm_bytes),
            ("SwiGLU", swi_sizes, lambda T, f: ((rng.standard_normal((T, 2 * f)) * 2).astype(np.float32),),
             swiglu_reference, swiglu_bytes)):
        for T, width in (cases if small else cases[:-1]):         # the largest size would take seconds here
            args = make(T, width)
            spread = Spread(tuple(_seconds(lambda: ref(*args)) for _ in range(3 if small else 5)))
            cpu_rows.append([name, T, width, spread.format(1e6, 0), f"{nbytes(T, width) / spread.median / 1e9:.2f}"])
    print_table("Lesson 12 — the NumPy references on this CPU (what every kernel version must match; µs: median "
                "(min-max))", ["op", "rows T", "dim / ffn", "µs", "GB/s (read + write)"], cpu_rows)
    print(load_line())

    # 2. The order of a parallel sum: error against float64, per order. Exercise 12 is the block's order.
    order_rows = []
    for n in ([576, 4096] if small else [576, 4096, 14336]):
        v = ((rng.standard_normal((32 if small else 128, n)) * 3) ** 2).astype(np.float32)   # squares, as RMSNorm
        exact = v.astype(np.float64).sum(axis=1)

        def rel(s):
            return float(np.max(np.abs(s.astype(np.float64) - exact) / exact)) / np.finfo(np.float32).eps
        order_rows.append([n, len(v), f"{rel(sequential_sum(v)):.1f}", f"{rel(block_sum_reference(v, 256)):.2f}",
                           f"{rel(v.sum(axis=1, dtype=np.float32)):.2f}"])
    print_table("the same fp32 sum of squares in three orders: worst relative error vs float64, in units of "
                "fp32 epsilon (1.2e-7)",
                ["values n", "rows", "one thread, left to right (v1)", "block of 256: strided + xor tree (v2)",
                 "NumPy (pairwise)"], order_rows)
    print("A tree adds numbers of similar size, so it is more accurate as well as parallel. Each order gives its\n"
          "own last bits, the same every run: exercise 12 reproduces the block's order exactly.")

    # 3. The kernels compile for Hopper here: nvcc (registers, shared memory) and NVRTC (as CuPy does).
    source = KERNELS + "\n" + common_cuh() + BLOCK_SUM
    report = ptxas_report(source)
    if isinstance(report, str):
        print(f"\nnvcc -Xptxas -v: {report}")
    else:
        print_table("nvcc -arch=sm_90 -Xptxas -v: what each kernel needs from an SM",
                    ["kernel", "registers/thread", "shared memory bytes", "spill bytes"],
                    [[k, r["registers"], r["smem"], r["spills"]] for k, r in sorted(report.items())])
    print(f"NVRTC (compute_90, what cupy.RawModule runs): {nvrtc_check(source)}")

    # 4. On a GPU: check every version against the reference, then time them.
    state, results = {}, {}

    def check():
        v = state["v"] = Versions()
        cp = v.cp
        from minillm.cuda.dev.common import F32_TOL, poisoned, rel_err
        rows = []
        for T, dim in [(3, 576), (5, 4096), (1, 4096), (130, 64)]:
            x = (rng.standard_normal((T, dim)) * 3).astype(np.float32)
            g = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
            want = rmsnorm(x, g, EPS)
            for version in VERSIONS:
                out = poisoned((T, dim), np.float32)       # NaN: an element never written shows up
                v.rmsnorm(version, cp.asarray(x), cp.asarray(g), out)
                err = rel_err(out.get(), want)
                rows.append([f"rmsnorm {version}", f"[{T}, {dim}]", f"{err:.1e}", "ok" if err <= F32_TOL else "FAIL"])
        for T, ffn in [(3, 1536), (2, 14336), (130, 64)]:
            gu = (rng.standard_normal((T, 2 * ffn)) * 2).astype(np.float32)
            want = swiglu_reference(gu)
            for version in VERSIONS:
                out = poisoned((T, ffn), np.float32)
                v.swiglu(version, cp.asarray(gu), out)
                err = rel_err(out.get(), want)
                rows.append([f"swiglu {version}", f"[{T}, {ffn}]", f"{err:.1e}", "ok" if err <= F32_TOL else "FAIL"])
        for n, threads in [(4096, 256), (576, 256), (100, 256), (14336, 1024), (1000, 128)]:
            vals = rng.standard_normal((64, n)).astype(np.float32)
            sums = poisoned(64, np.float32)
            v.block_sum((64,), (threads,), (cp.asarray(vals), sums, np.int32(n)))
            same = int(np.sum(sums.get().view(np.uint32) == block_sum_reference(vals, threads).view(np.uint32)))
            rows.append(["block_sum vs exercise 12's emulation", f"[64, {n}], {threads} threads",
                         f"{same}/64 rows bit-identical", "ok" if same == 64 else "FAIL"])
        print_table(f"correctness: relative error vs NumPy (tolerance {F32_TOL:g}; outputs poisoned with NaN first)",
                    ["kernel", "shape", "error", "verdict"], rows)
        bad = [r[0] for r in rows if r[-1] != "ok"]
        if bad:
            raise AssertionError(f"kernels disagree with the reference: {', '.join(bad)}")

    def timing(op: str):
        def run():
            from minillm.cuda.timing import copy_bandwidth, time_gpu
            v = state.get("v") or Versions()
            cp = v.cp
            bw = state.get("copy") or copy_bandwidth((64 if small else 1024) << 20)
            state["copy"] = bw
            rows = []
            for T, width in (rms_sizes if op == "RMSNorm" else swi_sizes):
                if op == "RMSNorm":
                    x, g, out = (cp.asarray((rng.standard_normal((T, width)) * 3).astype(np.float32)),
                                 cp.ones(width, cp.float32), cp.empty((T, width), cp.float32))
                    nbytes, launch = rmsnorm_bytes(T, width), lambda ver: v.rmsnorm(ver, x, g, out)
                else:
                    gu, out = cp.asarray(rng.standard_normal((T, 2 * width)).astype(np.float32)), \
                        cp.empty((T, width), cp.float32)
                    nbytes, launch = swiglu_bytes(T, width), lambda ver: v.swiglu(ver, gu, out)
                for version in VERSIONS:
                    slow = version == "v1" and T > 1
                    us = 1e3 * time_gpu(lambda: launch(version), 3 if (small or slow) else 20)
                    results[op, T, width, version] = (us, nbytes / us / 1e3)
                    rows.append([T, width, version, f"{us:,.1f}", f"{nbytes / us / 1e3:,.1f}",
                                 f"{100 * nbytes / us * 1e6 / bw:.0f}%"])
            print_table(f"{op}: µs per launch (median, CUDA events) and achieved bandwidth; copy bandwidth "
                        f"{bw / 1e12:.2f} TB/s", ["rows T", "dim" if op == "RMSNorm" else "ffn", "version", "µs",
                                                  "GB/s", "% of copy"], rows)
        return run

    failed = run_gpu_parts([("check every version against NumPy; the block sum bit for bit", check),
                            ("time RMSNorm v1, v2 and the engine's rmsnorm.cu over sizes", timing("RMSNorm")),
                            ("time SwiGLU v1, v2 and the engine's swiglu.cu over sizes", timing("SwiGLU"))])

    summary, no_gpu = [], "skipped (no GPU)" if why_no_gpu() else "not measured"
    for op, cases in (("RMSNorm", rms_sizes), ("SwiGLU", swi_sizes)):
        for T, width in (cases[0], cases[-1]):
            row = [op, f"[{T}, {width}]"]
            for version in VERSIONS:
                r = results.get((op, T, width, version))
                row.append(f"{r[0]:,.1f} µs, {r[1]:,.0f} GB/s" if r else no_gpu)
            summary.append(row)
    print_table("v1 vs v2 vs the engine at one decode row and at the largest size",
                ["op", "[T, width]", "v1", "v2", "engine"], summary)
    if results:
        print("At one row every version is far below the copy bandwidth: a few µs of launch and latency buy\n"
              "kilobytes. That cost is per launch, so lesson 13 counts launches and removes their overhead.")
    if failed:
        sys.exit(f"GPU parts failed: {', '.join(failed)}")


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
