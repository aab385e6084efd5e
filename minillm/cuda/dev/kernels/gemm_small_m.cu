// gemm_small_m.cu: Y[m, r] = (accumulate ? Y[m, r] : 0) + sum_k W[r, k] · X[m, k],   m < M <= 16
// W: [rows, in] fp16/bf16 (HF layout), X: [M, in] fp32, Y: [M, rows] fp32.
//
// The products of a few rows at once: speculative decoding's verify pass (the pending token + k drafts)
// and a small batch of decode rows. At M = 5 every weight byte still serves only 5 multiply-adds, so the
// product is a weight stream like the decode GEMV (gemv.cu), and the measure is again the fraction of
// copy bandwidth it reaches. cuBLAS's kernels for M = 3..9 stream the Mistral-7B matrices at ~2.3 TB/s on
// the H200 (lessons/BENCHMARKS.md: the verify pass costs 1.7 decode steps); this is gemv.cu's v2/v4 shape
// with M rows of x:
//   - two rows per warp, 16 warps (32 rows) a 512-thread block; each lane loads 16 bytes of each row per
//     step, two steps in flight (4 x 16 bytes), streamed past L1 (ld_stream);
//   - X is staged in shared memory a tile of SM_TILE columns at a time (M x 512 floats: 32 KB at M = 16),
//     once per block instead of once per warp: 32 rows share every staged value;
//   - fp32 accumulators, 2 x M per lane, one warp reduction per output at the end; no split-K, no
//     atomics: deterministic, graph-replay bit-identical.
// Measured on the H200 (lessons/BENCHMARKS.md): right, but faster than cuBLAS only at M = 2. Per 16-byte
// load a lane does 2 x 8 x M fp32 multiply-adds and 2 x M shared-memory float4 reads, so from M = 3 the
// issue slots, not the bytes, set the time: the next version belongs on the tensor cores (mma), which
// the 64-row batched decode of issue 25 needs too.
//
// Requires in % 8 == 0; the launcher checks. M is a template parameter (gemm_small_m{M}_{f16,bf16}).
#include "gemv_epilogue.cuh"

#define SM_WARPS 16          // warps a block; two rows a warp: 32 rows a block
#define SM_TILE 512          // columns of X staged in shared memory at a time

template <class W>
__device__ __forceinline__ float dot8_shared(uint4 w, const float4* x2) {
    float4 a = x2[0], b = x2[1];
    return W::lo(w.x) * a.x + W::hi(w.x) * a.y + W::lo(w.y) * a.z + W::hi(w.y) * a.w
         + W::lo(w.z) * b.x + W::hi(w.z) * b.y + W::lo(w.w) * b.z + W::hi(w.w) * b.w;
}

template <class W, int M>
__device__ void gemm_small_m(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                             int rows, int in, int accumulate) {
    __shared__ float4 xs4[M * SM_TILE / 4];           // [M][SM_TILE / 4]: this tile's columns of X
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * SM_WARPS + warp) * 2;
    // a warp past the last row still stages X and meets every barrier; it reads a valid row, writes nothing
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)min(r0, rows - 1) * in);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)min(r0 + 1, rows - 1) * in);
    float acc0[M], acc1[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = 0.0f;

    for (int k0 = 0; k0 < in; k0 += SM_TILE) {
        const int quads = min(SM_TILE, in - k0) >> 2;                 // float4s per row of this tile
        __syncthreads();                                             // the previous tile is consumed
        for (int i = threadIdx.x; i < M * quads; i += blockDim.x) {
            int m = i / quads, j = i - m * quads;
            xs4[m * (SM_TILE / 4) + j] = reinterpret_cast<const float4*>(x + (size_t)m * in + k0)[j];
        }
        __syncthreads();
        const int n8 = quads >> 1, base = k0 >> 3;                   // 16-byte weight chunks in this tile
        int c = lane;
        for (; c + 32 < n8; c += 64) {                               // two chunks of each row in flight
            uint4 a0 = ld_stream(w0 + base + c), b0 = ld_stream(w1 + base + c);
            uint4 a1 = ld_stream(w0 + base + c + 32), b1 = ld_stream(w1 + base + c + 32);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float4* xm = xs4 + m * (SM_TILE / 4);
                acc0[m] += dot8_shared<W>(a0, xm + 2 * c) + dot8_shared<W>(a1, xm + 2 * (c + 32));
                acc1[m] += dot8_shared<W>(b0, xm + 2 * c) + dot8_shared<W>(b1, xm + 2 * (c + 32));
            }
        }
        for (; c < n8; c += 32) {
            uint4 a0 = ld_stream(w0 + base + c), b0 = ld_stream(w1 + base + c);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                const float4* xm = xs4 + m * (SM_TILE / 4);
                acc0[m] += dot8_shared<W>(a0, xm + 2 * c);
                acc1[m] += dot8_shared<W>(b0, xm + 2 * c);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float s0 = warp_sum(acc0[m]), s1 = warp_sum(acc1[m]);
        if (lane == 0) {
            float* ym = y + (size_t)m * rows;
            if (r0 < rows) ym[r0] = accumulate ? ym[r0] + s0 : s0;
            if (r0 + 1 < rows) ym[r0 + 1] = accumulate ? ym[r0 + 1] + s1 : s1;
        }
    }
}

// grid (ceil(rows / 32)), block (32 * SM_WARPS = 512)
#define GEMM_SMALL_M_KERNEL(NAME, M, W)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * SM_WARPS)                                             \
    NAME(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int rows, int in,   \
         int accumulate) {                                                                                   \
        gemm_small_m<W, M>(w, x, y, rows, in, accumulate);                                                   \
    }
GEMM_SMALL_M_KERNEL(gemm_small_m1_f16, 1, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m1_bf16, 1, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m2_f16, 2, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m2_bf16, 2, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m3_f16, 3, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m3_bf16, 3, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m4_f16, 4, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m4_bf16, 4, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m5_f16, 5, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m5_bf16, 5, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m6_f16, 6, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m6_bf16, 6, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m7_f16, 7, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m7_bf16, 7, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m8_f16, 8, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m8_bf16, 8, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m9_f16, 9, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m9_bf16, 9, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m10_f16, 10, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m10_bf16, 10, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m11_f16, 11, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m11_bf16, 11, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m12_f16, 12, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m12_bf16, 12, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m13_f16, 13, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m13_bf16, 13, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m14_f16, 14, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m14_bf16, 14, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m15_f16, 15, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m15_bf16, 15, BF16)
GEMM_SMALL_M_KERNEL(gemm_small_m16_f16, 16, F16)
GEMM_SMALL_M_KERNEL(gemm_small_m16_bf16, 16, BF16)
