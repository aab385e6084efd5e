// swiglu.cu: out[t, i] = silu(gate[t, i]) · up[t, i],  silu(g) = g / (1 + exp(-g))
//
// CPU reference: minillm.model.layers.swiglu (the part between the projections). gate and up come from ONE
// fused GEMV/GEMM over the concatenated [gate; up] weight, so a row of `gu` is gate (ffn) then up (ffn).
//
// v1 (this file): elementwise, grid-stride, fp32 math. The fp32 output feeds the decode GEMV; the
// narrow outputs (fp16/bf16) feed cuBLAS at prefill.
#include "common.cuh"

template <class O, class W>
__device__ void swiglu(const float* __restrict__ gu, O* __restrict__ out, int ffn, int n_tokens) {
    size_t n = (size_t)ffn * n_tokens;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x) {
        size_t t = k / ffn, i = k - t * ffn;
        float g = gu[t * 2 * ffn + i], u = gu[t * 2 * ffn + ffn + i];
        Store<O>::template put<W>(out + k, g / (1.0f + expf(-g)) * u);
    }
}

// grid (any), block (256): gu [T, 2 * ffn] fp32 -> out [T, ffn]
extern "C" __global__ void swiglu_f32(const float* gu, float* out, int ffn, int n_tokens) {
    swiglu<float, F16>(gu, out, ffn, n_tokens);
}
extern "C" __global__ void swiglu_to_f16(const float* gu, u16* out, int ffn, int n_tokens) {
    swiglu<u16, F16>(gu, out, ffn, n_tokens);
}
extern "C" __global__ void swiglu_to_bf16(const float* gu, u16* out, int ffn, int n_tokens) {
    swiglu<u16, BF16>(gu, out, ffn, n_tokens);
}
