// attention_v1.cu: decode attention v1, the laboratory's (minillm/cuda/dev/lab.py launches it): the split blocks
// of kernels/decode_attention.cu (attention_split: an online softmax over each split of the keys), then a second
// launch that merges the splits. The shipped kernels fuse that merge (v2, attention_fused) or take the whole GQA
// group a block (v3); this two-launch version is kept to compare and to teach (exercise 24: the merge in NumPy).
#include "decode_attention.cu"

// grid (n_heads, n_splits, T), block (32 * ATTN_WARPS = 128)
// q: fp32, query head h of token t at q[t * q_stride + h * hd] (the fused qkv row: q_stride = its width)
// k_cache, v_cache: one layer, [n_kv_heads, capacity, hd] 16-bit
// part_m, part_l: [T, n_heads, n_splits] fp32; part_acc: [T, n_heads, n_splits, hd] fp32
extern "C" __global__ void attention_split_f16(const float* q, int q_stride, const u16* k_cache, const u16* v_cache,
                                               int capacity, int n_heads, int n_kv_heads, int hd, const int* pos,
                                               int window, float scale, float* part_m, float* part_l, float* part_acc) {
    attention_split<F16>(q, q_stride, k_cache, v_cache, capacity, n_heads, n_kv_heads, hd, pos, window, scale,
                         part_m, part_l, part_acc);
}
extern "C" __global__ void attention_split_bf16(const float* q, int q_stride, const u16* k_cache, const u16* v_cache,
                                                int capacity, int n_heads, int n_kv_heads, int hd, const int* pos,
                                                int window, float scale, float* part_m, float* part_l, float* part_acc) {
    attention_split<BF16>(q, q_stride, k_cache, v_cache, capacity, n_heads, n_kv_heads, hd, pos, window, scale,
                          part_m, part_l, part_acc);
}

// grid (n_heads, T), block (128): merge the splits -> out [T, n_heads * hd] fp32
extern "C" __global__ void attention_combine(const float* part_m, const float* part_l, const float* part_acc,
                                             float* out, int n_heads, int hd, int n_splits) {
    int h = blockIdx.x, t = blockIdx.y;
    size_t base = ((size_t)t * n_heads + h) * n_splits;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, part_m[base + s]);
    float L = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        float m = part_m[base + s];
        L += m == NEG_INF ? 0.0f : part_l[base + s] * expf(m - M);
    }
    float inv_L = 1.0f / L;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            float m = part_m[base + s];
            if (m != NEG_INF) a += part_acc[(base + s) * hd + d] * expf(m - M);
        }
        out[((size_t)t * n_heads + h) * hd + d] = a * inv_L;
    }
}
