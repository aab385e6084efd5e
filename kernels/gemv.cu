// gemv.cu: y[r] = (accumulate ? y[r] : 0) + sum_k W[r, k] · x[k]     W: [rows, in] fp16/bf16 (HF layout), x, y fp32
//
// CPU reference: minillm.model.layers.linear with T = 1. This is the hot spot of decode: at batch 1 every
// weight byte is read once per token and used for one multiply-add, so the kernel is a memory stream
// and its speed is the fraction of copy bandwidth it reaches. cuBLAS does it well but cannot run inside
// a CuPy-captured CUDA graph, so the decode step uses these instead. `accumulate` fuses the residual
// add (x += W·h for o_proj and down_proj): one launch and one pass over y fewer.
//
// Requires in % 8 == 0 (every row starts on a 16-byte boundary); the launcher checks.
//
// This is v4; v1 (a warp a row), v2 (four loads in flight a lane) and v3 (the norm fused through shared
// memory) are in minillm/cuda/dev/kernels/gemv_versions.cu, to compare and to teach.
// v4: two rows per warp and 2 x V4_U = 16 sixteen-byte loads in flight per lane (8 KB per warp) before
//     any arithmetic, 4 warps (8 rows) a 128-thread block. v2 reached only about half of copy bandwidth
//     on the small matrices (qkv, o): with 2 KB in flight per warp and 4 serial round trips per
//     4096-wide row, a partly filled second wave leaves SMs far below the ~32 KB in flight per SM that
//     4 TB/s x ~1 µs needs. At 8 KB per warp a handful of resident warps saturates an SM, so tails and
//     partial waves cost little. Sharing x between the two rows also halves the L1 traffic for x per
//     weight byte. Weights are loaded with ld.global.nc.L1::no_allocate (streamed once: keep L1 for x
//     and the gain). Numbers: lessons/BENCHMARKS.md.
//     One warp per row pair means no split-K, no atomics: deterministic, graph-replay bit-identical.
//     Variants, all one template (NORM x EPI):
//       NORM: the RMSNorm fused in without shared memory or a block barrier: every warp reads all of
//             x anyway, so it also sums x² (same order in every warp: every row gets the same inv_rms)
//             and computes inv_rms · Σ_k w[r,k]·(x[k]·gain[k]). Exact up to fp32 rounding order.
//       EPI: PLAIN (+ residual), SWIGLU, QKV (RoPE + KV append), in gemv_epilogue.cuh, which
//            gemv_quant.cu (int8/int4 weights) shares.
#include "gemv_epilogue.cuh"

// ---- v4 --------------------------------------------------------------------------------------------
#define V4_U 8              // 16-byte loads in flight per lane per row per step (x 2 rows)
#define V4_WARPS 4          // row pairs per block (block = 128 threads)
// At least 4 blocks an SM: ptxas may then give a thread 128 registers for the loop's 2 x V4_U loads in flight.
// Left to its default it chose 96-104 and the 16-bit decode step ran about 1% slower (lessons/BENCHMARKS.md).
#define V4_MIN_BLOCKS 4

template <class W>
__device__ __forceinline__ float dot8v(uint4 w, const float* v) {
    return W::lo(w.x) * v[0] + W::hi(w.x) * v[1] + W::lo(w.y) * v[2] + W::hi(w.y) * v[3]
         + W::lo(w.z) * v[4] + W::hi(w.z) * v[5] + W::lo(w.w) * v[6] + W::hi(w.w) * v[7];
}

// the 8 activations of 16-byte chunk i: x, or x·gain (sum of x² into ss) when the norm is fused
template <bool NORM>
__device__ __forceinline__ void load_x8(const float4* __restrict__ x4, const float4* __restrict__ g4, int i,
                                        float* v, float& ss) {
    float4 a = x4[2 * i], b = x4[2 * i + 1];
    if (NORM) {
        float4 ga = g4[2 * i], gb = g4[2 * i + 1];
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        v[0] = a.x * ga.x; v[1] = a.y * ga.y; v[2] = a.z * ga.z; v[3] = a.w * ga.w;
        v[4] = b.x * gb.x; v[5] = b.y * gb.y; v[6] = b.z * gb.z; v[7] = b.w * gb.w;
    } else {
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
}

template <class W, bool NORM, int EPI>
__device__ __forceinline__ void gemv_v4(const u16* __restrict__ w, const float* __restrict__ x,
                                        const float* __restrict__ gain, float eps, float* __restrict__ y,
                                        int rows, int in, int accumulate, u16* __restrict__ k_cache,
                                        u16* __restrict__ v_cache, int capacity, const int* __restrict__ pos,
                                        const float* __restrict__ inv_freq, int n_heads, int n_kv_heads, int hd) {
    int lane = threadIdx.x & 31;
    int p = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);      // this warp's row pair
    RowPair r;
    if (!row_pair<EPI>(p, rows, hd, r)) return;                        // whole warp: uniform
    int ra = r.ra, rb = r.rb;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)ra * in);
    const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)rb * in);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* g4 = reinterpret_cast<const float4*>(gain);
    int n8 = in >> 3;                                                  // 16-byte chunks per row
    float acc_a = 0.0f, acc_b = 0.0f, ss = 0.0f;
    int base = 0;
    if (lane == 0) {          // the first step's bytes of both rows on their way to L2 before x is ready (PDL;
        // L2, not registers: the loop is as before)
        unsigned int first = (unsigned int)min(n8, 32 * V4_U) * 16u;
        prefetch_l2(wa, first);
        if (rb != ra) prefetch_l2(wb, first);
    }
    pdl_wait_then_trigger();                                           // x, y and the cache: the last kernel's
    for (; base + 32 * V4_U <= n8; base += 32 * V4_U) {
        uint4 va[V4_U], vb[V4_U];
#pragma unroll
        for (int u = 0; u < V4_U; u++) {                                  // 2 x U loads in flight
            va[u] = ld_stream(wa + base + 32 * u + lane);
            vb[u] = ld_stream(wb + base + 32 * u + lane);
        }
#pragma unroll
        for (int u = 0; u < V4_U; u++) {
            float v[8];
            load_x8<NORM>(x4, g4, base + 32 * u + lane, v, ss);
            acc_a += dot8v<W>(va[u], v);
            acc_b += dot8v<W>(vb[u], v);
        }
    }
    if (base < n8) {                                                   // the ragged end (in % (256 V4_U) != 0)
        uint4 va[V4_U], vb[V4_U];
#pragma unroll
        for (int u = 0; u < V4_U; u++) {
            int i = base + 32 * u + lane;
            if (i < n8) { va[u] = ld_stream(wa + i); vb[u] = ld_stream(wb + i); }
        }
#pragma unroll
        for (int u = 0; u < V4_U; u++) {
            int i = base + 32 * u + lane;
            if (i < n8) {
                float v[8];
                load_x8<NORM>(x4, g4, i, v, ss);
                acc_a += dot8v<W>(va[u], v);
                acc_b += dot8v<W>(vb[u], v);
            }
        }
    }
    acc_a = warp_sum(acc_a);
    acc_b = warp_sum(acc_b);
    if (NORM) {
        float inv_rms = rsqrtf(warp_sum(ss) / (float)in + eps);
        acc_a *= inv_rms;
        acc_b *= inv_rms;
    }
    if (lane != 0) return;
    Epilogue<W> ep{y, accumulate, k_cache, v_cache, capacity, pos, inv_freq, n_heads, n_kv_heads, hd};
    ep.template store<EPI>(r, p, acc_a, acc_b);
}

// grid (ceil(pairs / V4_WARPS)), block (32 * V4_WARPS = 128); pairs = ceil(rows / 2) (PLAIN), rows / 2 (SWIGLU,
// QKV). One signature for every variant (unused arguments: any valid pointer / 0):
//   w [rows, in] 16-bit; x [in] fp32; gain [in] fp32 (NORM); y: [rows] (PLAIN, QKV) or [rows / 2] (SWIGLU)
//   k_cache, v_cache: one layer [n_kv_heads, capacity, hd] (QKV); pos [1] int32; inv_freq [hd / 2] fp32.
#define GEMV_V4_KERNEL(NAME, W, NORM, EPI)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * V4_WARPS, V4_MIN_BLOCKS) NAME(                            \
        const u16* w, const float* x, const float* gain, float eps, float* y, int rows, int in, int accumulate, \
        u16* k_cache, u16* v_cache, int capacity, const int* pos, const float* inv_freq, int n_heads,          \
        int n_kv_heads, int hd) {                                                                               \
        gemv_v4<W, NORM, EPI>(w, x, gain, eps, y, rows, in, accumulate, k_cache, v_cache, capacity, pos,        \
                              inv_freq, n_heads, n_kv_heads, hd);                                               \
    }
GEMV_V4_KERNEL(gemv_v4_f16, F16, false, EPI_PLAIN)
GEMV_V4_KERNEL(gemv_v4_bf16, BF16, false, EPI_PLAIN)
GEMV_V4_KERNEL(gemv_rmsnorm_v4_f16, F16, true, EPI_PLAIN)
GEMV_V4_KERNEL(gemv_rmsnorm_v4_bf16, BF16, true, EPI_PLAIN)
GEMV_V4_KERNEL(gemv_swiglu_v4_f16, F16, false, EPI_SWIGLU)
GEMV_V4_KERNEL(gemv_swiglu_v4_bf16, BF16, false, EPI_SWIGLU)
GEMV_V4_KERNEL(gemv_rmsnorm_swiglu_v4_f16, F16, true, EPI_SWIGLU)
GEMV_V4_KERNEL(gemv_rmsnorm_swiglu_v4_bf16, BF16, true, EPI_SWIGLU)
GEMV_V4_KERNEL(gemv_qkv_v4_f16, F16, false, EPI_QKV)
GEMV_V4_KERNEL(gemv_qkv_v4_bf16, BF16, false, EPI_QKV)
GEMV_V4_KERNEL(gemv_rmsnorm_qkv_v4_f16, F16, true, EPI_QKV)
GEMV_V4_KERNEL(gemv_rmsnorm_qkv_v4_bf16, BF16, true, EPI_QKV)
