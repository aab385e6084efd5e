// gemv_versions.cu: the 16-bit decode GEMV's first versions, v1 to v3, kept to compare and to teach (lessons 12
// and 13, minillm/cuda/dev/lab.py launches them). The shipped kernel is kernels/gemv.cu's v4; its header says
// how each version led to the next. y[r] = (accumulate ? y[r] : 0) + sum_k W[r, k] · x[k], in % 8 == 0.
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
#include "common.cuh"

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

