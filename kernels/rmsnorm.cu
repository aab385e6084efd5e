// rmsnorm.cu: out[t, i] = x[t, i] * rsqrt(mean_i(x[t, i]^2) + eps) * gain[i]
//
// CPU reference: minillm.model.layers.rmsnorm (fp32). The residual stream x and the gain stay fp32 on the GPU
// (dim floats: nothing next to the weights); the output is fp32 for the decode GEMVs (which read fp32
// activations) or narrowed to the weight dtype for prefill, where cuBLAS multiplies fp16/bf16 inputs.
//
// v1 (this file): one block per row, each thread sums the squares of a strided slice in fp32, one block
// reduction (warp shuffles, then one warp over the per-warp sums), then a strided scale-and-store.
// A row is dim floats (16 KB at dim 4096), read twice from L1/L2: the launch costs more than the work,
// which is why decode runs it inside a CUDA graph. (Fusing it into the next GEMV is the next step.)
#include "common.cuh"

template <class O, class W>
__device__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ gain, O* __restrict__ out,
                        int dim, float eps) {
    const float* row = x + (size_t)blockIdx.x * dim;
    O* dst = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += row[i] * row[i];
    float inv_rms = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        Store<O>::template put<W>(dst + i, row[i] * inv_rms * gain[i]);
}

// grid (T), block (256): x [T, dim] fp32, gain [dim] fp32 -> out [T, dim]
extern "C" __global__ void rmsnorm_f32(const float* x, const float* gain, float* out, int dim, float eps) {
    rmsnorm<float, F16>(x, gain, out, dim, eps);
}
extern "C" __global__ void rmsnorm_to_f16(const float* x, const float* gain, u16* out, int dim, float eps) {
    rmsnorm<u16, F16>(x, gain, out, dim, eps);
}
extern "C" __global__ void rmsnorm_to_bf16(const float* x, const float* gain, u16* out, int dim, float eps) {
    rmsnorm<u16, BF16>(x, gain, out, dim, eps);
}
