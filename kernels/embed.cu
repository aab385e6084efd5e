// embed.cu: token embedding lookup (widened to the fp32 residual stream) and fp32 -> fp16/bf16 casts.
//
// CPU reference: `as_f32(embed[tokens])` in minillm.model.transformer.Transformer.forward, and backend.to_dtype.
// The token ids are read from device memory, so a captured decode step picks up each new token.
//
// v1 (this file): one block per token, strided copy; the cast is a grid-stride elementwise loop.
#include "common.cuh"

template <class W>
__device__ void embed(const int* __restrict__ tokens, const u16* __restrict__ table, float* __restrict__ out, int dim) {
    pdl_wait_then_trigger();                  // out is x, which the kernel before (a head) may still read
    const u16* row = table + (size_t)tokens[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = W::to_float(row[i]);
}

// grid (T), block (256): tokens [T] int32, table [vocab, dim] -> out [T, dim] fp32
extern "C" __global__ void embed_f16(const int* tokens, const u16* table, float* out, int dim) { embed<F16>(tokens, table, out, dim); }
extern "C" __global__ void embed_bf16(const int* tokens, const u16* table, float* out, int dim) { embed<BF16>(tokens, table, out, dim); }

template <class W>
__device__ void cast(const float* __restrict__ x, u16* __restrict__ out, size_t n) {
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x)
        out[k] = W::from_float(x[k]);
}

// grid (any), block (256): x [n] fp32 -> out [n] 16-bit
extern "C" __global__ void cast_to_f16(const float* x, u16* out, unsigned long long n) { cast<F16>(x, out, n); }
extern "C" __global__ void cast_to_bf16(const float* x, u16* out, unsigned long long n) { cast<BF16>(x, out, n); }

// Random weights for benchmarks, made on the device (a 7B model is 14.5 GB: never ship it from the host).
// out[k] = scale · u, u uniform in [-1, 1) from hash_u32(k, seed) (common.cuh): deterministic, no cuRAND.
template <class W>
__device__ void fill_uniform(u16* __restrict__ out, size_t n, unsigned int seed, float scale) {
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x) {
        float u = (float)hash_u32(k, seed) * (2.0f / 4294967296.0f) - 1.0f;
        out[k] = W::from_float(scale * u);
    }
}

extern "C" __global__ void fill_uniform_f16(u16* out, unsigned long long n, unsigned int seed, float scale) {
    fill_uniform<F16>(out, n, seed, scale);
}
extern "C" __global__ void fill_uniform_bf16(u16* out, unsigned long long n, unsigned int seed, float scale) {
    fill_uniform<BF16>(out, n, seed, scale);
}
