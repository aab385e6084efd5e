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
// v1: one warp per row. Each lane loads 16 bytes (8 weights) per step as one uint4, widens them in
//     registers, and multiplies with 8 fp32 activations (two float4 loads, L1-resident: x is small and
//     every warp of the SM reads it). Fp32 accumulation, one warp shuffle reduction at the end.
//     Coalesced: the 32 lanes of a warp read 512 contiguous bytes per step.
// v2: v1 with four independent 16-byte loads in flight per lane before any arithmetic. A GEMV has no
//     reuse, so speed is bytes in flight ÷ latency; v1 relies on occupancy alone for that, v2 also on
//     instruction-level parallelism, which matters for short rows (in = 4096 is only 16 steps a lane).
// v3: v2 with the RMSNorm that precedes q/k/v, gate/up and the LM head fused in as a prologue: each
//     block reduces x itself, writes x · inv_rms · gain to shared memory, and its warps read that. One
//     launch (and one small kernel's gap in the graph) fewer per fused matrix, paid for by every block
//     re-reading x (dim floats, from L2) and waiting for its own reduction before streaming weights;
//     16 rows a block halves that re-read. Needs in · 4 bytes of shared memory (in ≤ 12288).
// v4: two rows per warp and 2 x V4_U = 16 sixteen-byte loads in flight per lane (8 KB per warp) before
//     any arithmetic, 4 warps (8 rows) a 128-thread block. The H200 run showed v2 at 47-53% of copy
//     bandwidth on the small matrices (qkv, o): with 2 KB in flight per warp and 4 serial round trips
//     per 4096-wide row, a partly filled second wave (qkv: 768 blocks, 660 resident) leaves SMs with
//     ~12 KB in flight, far below the ~32 KB per SM that 4 TB/s x ~1 µs needs. At 8 KB per warp a
//     handful of resident warps saturates an SM, so tails and partial waves cost little. Sharing x
//     between the two rows also halves the L1 traffic for x per weight byte. Weights are loaded with
//     ld.global.nc.L1::no_allocate (streamed once: keep L1 for x and the gain).
//     One warp per row pair means no split-K, no atomics: deterministic, graph-replay bit-identical.
//     Variants, all one template (NORM x EPI):
//       NORM: the RMSNorm fused in without shared memory or a block barrier: every warp reads all of
//             x anyway, so it also sums x² (same order in every warp: every row gets the same inv_rms)
//             and computes inv_rms · Σ_k w[r,k]·(x[k]·gain[k]). Exact up to fp32 rounding order.
//       EPI: PLAIN (+ residual), SWIGLU, QKV (RoPE + KV append), in gemv_epilogue.cuh, which
//            gemv_quant.cu (int8/int4 weights) shares.
#include "gemv_epilogue.cuh"

template <class W>
__device__ __forceinline__ float dot8(uint4 w, const float4* __restrict__ x2) {
    float4 a = x2[0], b = x2[1];
    return W::lo(w.x) * a.x + W::hi(w.x) * a.y + W::lo(w.y) * a.z + W::hi(w.y) * a.w
         + W::lo(w.z) * b.x + W::hi(w.z) * b.y + W::lo(w.w) * b.z + W::hi(w.w) * b.w;
}

template <class W>
__device__ void gemv_v1(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                        int rows, int in, int accumulate) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * in);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int n8 = in >> 3;                                  // 16-byte chunks per row
    float acc = 0.0f;
    for (int i = lane; i < n8; i += 32) acc += dot8<W>(wrow[i], x4 + 2 * i);
    acc = warp_sum(acc);
    if (lane == 0) y[row] = accumulate ? y[row] + acc : acc;
}

template <class W>
__device__ void gemv_v2(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                        int rows, int in, int accumulate) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * in);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int n8 = in >> 3;
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
    int i = lane;
    for (; i + 96 < n8; i += 128) {
        uint4 a = wrow[i], b = wrow[i + 32], c = wrow[i + 64], d = wrow[i + 96];   // 4 loads in flight
        acc0 += dot8<W>(a, x4 + 2 * i);
        acc1 += dot8<W>(b, x4 + 2 * (i + 32));
        acc2 += dot8<W>(c, x4 + 2 * (i + 64));
        acc3 += dot8<W>(d, x4 + 2 * (i + 96));
    }
    for (; i < n8; i += 32) acc0 += dot8<W>(wrow[i], x4 + 2 * i);
    float acc = warp_sum((acc0 + acc1) + (acc2 + acc3));
    if (lane == 0) y[row] = accumulate ? y[row] + acc : acc;
}

template <class W>
__device__ void gemv_rmsnorm_v3(const u16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gain,
                                float eps, float* __restrict__ y, int rows, int in) {
    extern __shared__ float4 xn4[];                   // [in / 4]: the normalized activations
    float* xn = reinterpret_cast<float*>(xn4);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < in; i += blockDim.x) ss += x[i] * x[i];
    float inv_rms = rsqrtf(block_sum(ss) / (float)in + eps);     // every thread takes part: no early exit above
    for (int i = threadIdx.x; i < in; i += blockDim.x) xn[i] = x[i] * inv_rms * gain[i];
    __syncthreads();

    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)row * in);
    int n8 = in >> 3;
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
    int i = lane;
    for (; i + 96 < n8; i += 128) {
        uint4 a = wrow[i], b = wrow[i + 32], c = wrow[i + 64], d = wrow[i + 96];
        acc0 += dot8<W>(a, xn4 + 2 * i);
        acc1 += dot8<W>(b, xn4 + 2 * (i + 32));
        acc2 += dot8<W>(c, xn4 + 2 * (i + 64));
        acc3 += dot8<W>(d, xn4 + 2 * (i + 96));
    }
    for (; i < n8; i += 32) acc0 += dot8<W>(wrow[i], xn4 + 2 * i);
    float acc = warp_sum((acc0 + acc1) + (acc2 + acc3));
    if (lane == 0) y[row] = acc;
}

// grid (ceil(rows / (block / 32))), block (256 = 8 rows a block)
extern "C" __global__ void gemv_v1_f16(const u16* w, const float* x, float* y, int rows, int in, int accumulate) {
    gemv_v1<F16>(w, x, y, rows, in, accumulate);
}
extern "C" __global__ void gemv_v1_bf16(const u16* w, const float* x, float* y, int rows, int in, int accumulate) {
    gemv_v1<BF16>(w, x, y, rows, in, accumulate);
}
extern "C" __global__ void gemv_v2_f16(const u16* w, const float* x, float* y, int rows, int in, int accumulate) {
    gemv_v2<F16>(w, x, y, rows, in, accumulate);
}
extern "C" __global__ void gemv_v2_bf16(const u16* w, const float* x, float* y, int rows, int in, int accumulate) {
    gemv_v2<BF16>(w, x, y, rows, in, accumulate);
}

// grid (ceil(rows / 16)), block (512 = 16 rows a block), dynamic shared memory in * 4 bytes
// y [rows] = w [rows, in] · rmsnorm(x [in], gain [in])
extern "C" __global__ void gemv_rmsnorm_v3_f16(const u16* w, const float* x, const float* gain, float eps, float* y,
                                               int rows, int in) {
    gemv_rmsnorm_v3<F16>(w, x, gain, eps, y, rows, in);
}
extern "C" __global__ void gemv_rmsnorm_v3_bf16(const u16* w, const float* x, const float* gain, float eps, float* y,
                                                int rows, int in) {
    gemv_rmsnorm_v3<BF16>(w, x, gain, eps, y, rows, in);
}

// ---- v4 --------------------------------------------------------------------------------------------
#define V4_U 8              // 16-byte loads in flight per lane per row per step (x 2 rows)
#define V4_WARPS 4          // row pairs per block (block = 128 threads)
#define V4_PREWAIT_ROWS 4   // flags bit: the warp's whole rows into L2 before the wait (gemv_quant.cu's twin)
// The q|k|v GEMV's own build (the _6b kernels): 6 blocks an SM with half the loads in flight a step (<= 80
// registers instead of 102-104, where 4 blocks an SM fit): Mistral-7B's 3072 row pairs are 768 blocks, one round
// of the 792 slots, where 4 an SM (528 slots) take 1.45 rounds. Each lane sums its chunks in the same order.
// Measured (H200, 2026-12-02): fp16 decode 0.993x, so KernelSettings.qkv_one_round leaves 16-bit out.
#define V4_QKV_BLOCKS 6
#define V4_QKV_U 4

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

template <class W, bool NORM, int EPI, int U = V4_U>        // U: 16-byte loads in flight a lane and row a step
__device__ __forceinline__ void gemv_v4(const u16* __restrict__ w, const float* __restrict__ x,
                                        const float* __restrict__ gain, float eps, float* __restrict__ y,
                                        int rows, int in, int accumulate, u16* __restrict__ k_cache,
                                        u16* __restrict__ v_cache, int capacity, const int* __restrict__ pos,
                                        const float* __restrict__ inv_freq, int n_heads, int n_kv_heads, int hd,
                                        const NextWeights& next, int flags) {
    int lane = threadIdx.x & 31;
    int p = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);      // this warp's row pair
    if (threadIdx.x == 0) next.prefetch();                             // tail blocks only: see NextWeights
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
    if (lane == 0) {          // the first step's bytes of both rows on their way to L2 before x is ready (PDL);
        // (L2, not registers: the loop is as before); V4_PREWAIT_ROWS: the whole rows (gemv_quant.cu's Q_PREWAIT_ROWS)
        unsigned int first = (unsigned int)((flags & V4_PREWAIT_ROWS) ? n8 : min(n8, 32 * V4_U)) * 16u;   // (_6b: 2 steps)
        prefetch_l2(wa, first);
        if (rb != ra) prefetch_l2(wb, first);
    }
    pdl_wait_then_trigger();                                           // x, y and the cache: the last kernel's
    for (; base + 32 * U <= n8; base += 32 * U) {
        uint4 va[U], vb[U];
#pragma unroll
        for (int u = 0; u < U; u++) {                                  // 2 x U loads in flight
            va[u] = ld_stream(wa + base + 32 * u + lane);
            vb[u] = ld_stream(wb + base + 32 * u + lane);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float v[8];
            load_x8<NORM>(x4, g4, base + 32 * u + lane, v, ss);
            acc_a += dot8v<W>(va[u], v);
            acc_b += dot8v<W>(vb[u], v);
        }
    }
    if (base < n8) {                                                   // the ragged end (in % (256 U) != 0)
        uint4 va[U], vb[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + 32 * u + lane;
            if (i < n8) { va[u] = ld_stream(wa + i); vb[u] = ld_stream(wb + i); }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
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
//   k_cache, v_cache: one layer [n_kv_heads, capacity, hd] (QKV); pos [1] int32; inv_freq [hd / 2] fp32;
//   next_*: the next GEMV's weights to prefetch into L2 from the last next_tail blocks (null / 0: none);
//   flags: V4_PREWAIT_ROWS.
#define GEMV_V4_KERNEL(NAME, W, NORM, EPI) GEMV_V4_KERNEL_AT(NAME, W, NORM, EPI, V4_U, (32 * V4_WARPS))
#define GEMV_V4_KERNEL_AT(NAME, W, NORM, EPI, U, BOUNDS)                                                        \
    extern "C" __global__ void __launch_bounds__ BOUNDS NAME(                                                   \
        const u16* w, const float* x, const float* gain, float eps, float* y, int rows, int in, int accumulate, \
        u16* k_cache, u16* v_cache, int capacity, const int* pos, const float* inv_freq, int n_heads,          \
        int n_kv_heads, int hd, const unsigned char* next_a, unsigned long long next_bytes_a,                  \
        const unsigned char* next_b, unsigned long long next_bytes_b, int next_tail, int flags) {              \
        NextWeights next{next_a, next_bytes_a, next_b, next_bytes_b, next_tail};                               \
        gemv_v4<W, NORM, EPI, U>(w, x, gain, eps, y, rows, in, accumulate, k_cache, v_cache, capacity, pos,     \
                              inv_freq, n_heads, n_kv_heads, hd, next, flags);                                  \
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
GEMV_V4_KERNEL_AT(gemv_qkv_v4_6b_f16, F16, false, EPI_QKV, V4_QKV_U, (32 * V4_WARPS, V4_QKV_BLOCKS))
GEMV_V4_KERNEL_AT(gemv_qkv_v4_6b_bf16, BF16, false, EPI_QKV, V4_QKV_U, (32 * V4_WARPS, V4_QKV_BLOCKS))
GEMV_V4_KERNEL_AT(gemv_rmsnorm_qkv_v4_6b_f16, F16, true, EPI_QKV, V4_QKV_U, (32 * V4_WARPS, V4_QKV_BLOCKS))
GEMV_V4_KERNEL_AT(gemv_rmsnorm_qkv_v4_6b_bf16, BF16, true, EPI_QKV, V4_QKV_U, (32 * V4_WARPS, V4_QKV_BLOCKS))
