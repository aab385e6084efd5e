// kv_int8.cu: the int8 KV cache: quantize new keys and values into it, and widen a layer of it for prefill.
//
// CPU reference: minillm.model.kv_cache.Int8KVCache (and minillm.model.quant.quantize_int8, its rounding). Each vector
// of head_dim values (one token, one KV head; keys and values apart) gets its own symmetric scale
// (common.cuh, quantize_vector_int8: scale = max |x| / 127, code = rint(x / scale)).
// Layout per layer: codes int8 [n_kv_heads, capacity, hd], scales fp32 [n_kv_heads, capacity], so that a
// decode attention block streams one KV head's codes and scales as two contiguous ranges. head_dim + 4 bytes
// a vector instead of 2·head_dim: 0.52 of the 16-bit cache at hd 128.
//
// Decode reads the codes directly (decode_attention.cu, attention_gqa*_int8). Prefill is compute-bound and
// has its tiled kernel for 16-bit K/V, so it widens the layer's first n positions into a 16-bit scratch
// (kv_dequant) and runs that: 4 bytes written and read per value and token, small next to the GEMMs.
#include "common.cuh"

// grid (T, n_kv_heads), block 64: warp 0 quantizes token t's key of KV head kvh, warp 1 its value. The
// (already rotated) k and the v come straight out of the fused qkv row, as kv_append.cu reads them.
extern "C" __global__ void kv_append_int8(const float* __restrict__ qkv, int row_stride, int n_heads, int n_kv_heads,
                                          int hd, signed char* __restrict__ k_cache, signed char* __restrict__ v_cache,
                                          float* __restrict__ k_scale, float* __restrict__ v_scale, int capacity,
                                          const int* pos) {
    int t = blockIdx.x, kvh = blockIdx.y;
    int is_v = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = pos[0] + t;
    if (p >= capacity) return;                      // the host refuses this first; a bad replay must not scribble
    const float* src = qkv + (size_t)t * row_stride + (size_t)(n_heads + is_v * n_kv_heads + kvh) * hd;
    size_t vec = (size_t)kvh * capacity + p;
    quantize_vector_int8(src, hd, lane, (is_v ? v_cache : k_cache) + vec * hd, (is_v ? v_scale : k_scale) + vec);
}

// out = code · scale, narrowed to the weight dtype W, for positions [0, n) of every KV head, keys and values.
// grid (n, n_kv_heads), block min(hd, 256). codes [n_kv_heads, capacity, hd], scales [n_kv_heads, capacity],
// out 16-bit [n_kv_heads, capacity, hd] (only the first n positions are written).
template <class W>
__device__ void kv_dequant(const signed char* __restrict__ k_codes, const signed char* __restrict__ v_codes,
                           const float* __restrict__ k_scale, const float* __restrict__ v_scale, int capacity, int hd,
                           u16* __restrict__ k_out, u16* __restrict__ v_out) {
    size_t vec = (size_t)blockIdx.y * capacity + blockIdx.x;
    float ks = k_scale[vec], vs = v_scale[vec];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        size_t i = vec * hd + d;
        k_out[i] = W::from_float((float)k_codes[i] * ks);
        v_out[i] = W::from_float((float)v_codes[i] * vs);
    }
}

extern "C" __global__ void kv_dequant_f16(const signed char* k_codes, const signed char* v_codes, const float* k_scale,
                                          const float* v_scale, int capacity, int hd, u16* k_out, u16* v_out) {
    kv_dequant<F16>(k_codes, v_codes, k_scale, v_scale, capacity, hd, k_out, v_out);
}
extern "C" __global__ void kv_dequant_bf16(const signed char* k_codes, const signed char* v_codes, const float* k_scale,
                                           const float* v_scale, int capacity, int hd, u16* k_out, u16* v_out) {
    kv_dequant<BF16>(k_codes, v_codes, k_scale, v_scale, capacity, hd, k_out, v_out);
}
