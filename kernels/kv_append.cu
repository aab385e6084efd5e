// kv_append.cu: write the new keys and values into the contiguous KV cache of one layer.
//
// CPU reference: minillm.model.kv_cache.KVCache.append. Cache layout per layer: [n_kv_heads, capacity, hd] in
// the weight dtype (fp16/bf16: half the bytes of fp32, and what attention reads at every step). The
// position comes from a device buffer (see rope.cu for why): token t is written at pos[0] + t.
//
// v1 (this file): one block per (token, kv head), one thread per element, keys and values together;
// reads the (already rotated) k and the v straight out of the fused qkv row. Writes past the capacity
// are dropped (the host refuses them first; this only keeps a bad replay from scribbling).
#include "common.cuh"

template <class W>
__device__ void kv_append(const float* __restrict__ qkv, int row_stride, int n_heads, int n_kv_heads, int hd,
                          u16* __restrict__ k_cache, u16* __restrict__ v_cache, int capacity, const int* pos) {
    int t = blockIdx.x, kvh = blockIdx.y;
    int p = pos[0] + t;
    if (p >= capacity) return;
    const float* row = qkv + (size_t)t * row_stride;
    const float* k = row + (size_t)(n_heads + kvh) * hd;
    const float* v = row + (size_t)(n_heads + n_kv_heads + kvh) * hd;
    size_t dst = ((size_t)kvh * capacity + p) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        k_cache[dst + d] = W::from_float(k[d]);
        v_cache[dst + d] = W::from_float(v[d]);
    }
}

// grid (T, n_kv_heads), block (min(hd, 256))
extern "C" __global__ void kv_append_f16(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int hd,
                                         u16* k_cache, u16* v_cache, int capacity, const int* pos) {
    kv_append<F16>(qkv, row_stride, n_heads, n_kv_heads, hd, k_cache, v_cache, capacity, pos);
}
extern "C" __global__ void kv_append_bf16(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int hd,
                                          u16* k_cache, u16* v_cache, int capacity, const int* pos) {
    kv_append<BF16>(qkv, row_stride, n_heads, n_kv_heads, hd, k_cache, v_cache, capacity, pos);
}
