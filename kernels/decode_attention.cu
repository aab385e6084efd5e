// decode_attention.cu: softmax(q·Kᵀ/√hd + mask)·V for new queries against the KV cache (flash-decoding).
//
// CPU reference: minillm.attention.attend (GQA: query head h reads KV head h / (n_heads / n_kv_heads)).
// Query t of this call sits at absolute position p = pos[0] + t and sees keys [lo, p], lo = 0, or
// p - window + 1 with a sliding window (window = 0: none). The cache is contiguous (slot = position),
// so the window is a range, not a rolling buffer. Lengths come from a device buffer (graph replay).
//
// At batch 1 a single query has little parallelism: one block per head is only n_heads blocks, a
// fraction of the 132 SMs of an H100/H200, each streaming a long K/V range alone. Flash-decoding splits
// the key range of every head into n_splits pieces, each block computes an online softmax over its
// piece (running max m, sum l, unnormalized output acc), and a second kernel merges the pieces:
//     M = max_s m_s,  L = Σ_s l_s·e^(m_s − M),  out = Σ_s acc_s·e^(m_s − M) / L
// The split count is fixed per launch configuration (so a graph can be captured once) while each
// split's length follows the current sequence length: ceil(n_keys / n_splits).
//
// v2 (attention_fused_*): v1 with the combine folded into the split kernel's last block per (t, h)
// (threadfence + counter), one launch instead of two.
// v1 (this file): block = 4 warps per (head, split, query); each warp takes every 4th key of the split,
// its lanes hold hd/32 dims of q, K and V (hd ≤ 256), a warp shuffle gives the score, and each warp
// keeps its own online-softmax state in registers; the 4 warp states are merged in shared memory.
// The KV heads shared by a GQA group are re-read by each query head of the group from L2, not shared
// in shared memory (a v2 would process the whole group per block). Prefill reuses this kernel with
// one query per token (grid z = T): correct and simple, but not a tiled FlashAttention that shares
// K/V tiles between queries.
#include "common.cuh"

#define ATTN_WARPS 4
#define MAX_HD 256
#define PER_LANE (MAX_HD / 32)

template <class W>
__device__ void attention_split(const float* __restrict__ q, int q_stride, const u16* __restrict__ k_cache,
                                const u16* __restrict__ v_cache, int capacity, int n_heads, int n_kv_heads,
                                int hd, const int* pos, int window, float scale, float* __restrict__ part_m,
                                float* __restrict__ part_l, float* __restrict__ part_acc,
                                unsigned int* counters = nullptr, float* out = nullptr) {
    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS], sm_acc[ATTN_WARPS][MAX_HD];
    __shared__ unsigned int ticket;
    int h = blockIdx.x, s = blockIdx.y, t = blockIdx.z, n_splits = gridDim.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int p = pos[0] + t;
    int lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
    int n_keys = p + 1 - lo;
    int chunk = (n_keys + n_splits - 1) / n_splits;
    int start = lo + s * chunk;
    int end = min(p + 1, start + chunk);

    int kvh = h / (n_heads / n_kv_heads);
    const float* qh = q + (size_t)t * q_stride + (size_t)h * hd;
    const u16* K = k_cache + (size_t)kvh * capacity * hd;
    const u16* V = v_cache + (size_t)kvh * capacity * hd;

    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        int d = lane + 32 * i;
        qr[i] = d < hd ? qh[d] * scale : 0.0f;        // fold 1/√hd into q once
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = start + warp; j < end; j += ATTN_WARPS) {
        const u16* kj = K + (size_t)j * hd;
        float sc = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            int d = lane + 32 * i;
            if (d < hd) sc += qr[i] * W::to_float(kj[d]);
        }
        sc = warp_sum(sc);
        float m_new = fmaxf(m, sc);
        float correction = expf(m - m_new);           // m = -inf on the first key: e^-inf = 0
        float pj = expf(sc - m_new);
        l = l * correction + pj;
        const u16* vj = V + (size_t)j * hd;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            int d = lane + 32 * i;
            if (d < hd) acc[i] = acc[i] * correction + pj * W::to_float(vj[d]);
        }
        m = m_new;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < hd) sm_acc[warp][d] = acc[i];
    }
    __syncthreads();

    float M = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.0f, weight[ATTN_WARPS];
    for (int w = 0; w < ATTN_WARPS; w++) {
        weight[w] = sm_m[w] == NEG_INF ? 0.0f : expf(sm_m[w] - M);   // an empty warp adds nothing
        L += sm_l[w] * weight[w];
    }
    size_t slot = ((size_t)t * n_heads + h) * n_splits + s;
    if (threadIdx.x == 0) { part_m[slot] = M; part_l[slot] = L; }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) a += sm_acc[w][d] * weight[w];
        part_acc[slot * hd + d] = a;
    }
    if (counters == nullptr) return;

    // Fused combine (v2): the last of the n_splits blocks of (t, h) to finish merges them, so no second
    // launch. Each thread fences its own partial writes, the block agrees, one thread takes a ticket;
    // the block that draws n_splits - 1 reads everyone's partials (volatile: from L2, never a stale L1
    // line) and resets the counter to 0 for the next launch (a captured graph needs no memset).
    __threadfence();
    __syncthreads();
    unsigned int* counter = counters + (size_t)t * n_heads + h;
    if (threadIdx.x == 0) ticket = atomicAdd(counter, 1u);
    __syncthreads();
    if (ticket != (unsigned int)(n_splits - 1)) return;
    __threadfence();
    size_t base = ((size_t)t * n_heads + h) * n_splits;
    const volatile float* vm = part_m + base;
    const volatile float* vl = part_l + base;
    const volatile float* va = part_acc + base * hd;
    float Mc = NEG_INF;
    for (int i = 0; i < n_splits; i++) Mc = fmaxf(Mc, vm[i]);
    float Lc = 0.0f;
    for (int i = 0; i < n_splits; i++) {                 // attention_combine's arithmetic, in its order
        float mi = vm[i];
        Lc += mi == NEG_INF ? 0.0f : vl[i] * expf(mi - Mc);
    }
    float inv_L = 1.0f / Lc;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < n_splits; i++) {
            float mi = vm[i];
            if (mi != NEG_INF) a += va[(size_t)i * hd + d] * expf(mi - Mc);
        }
        out[((size_t)t * n_heads + h) * hd + d] = a * inv_L;
    }
    if (threadIdx.x == 0) *counter = 0u;
}

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

// v2, combine fused: grid (n_heads, n_splits, T), block (128); attention_split's arguments, then
// counters [T, n_heads] uint32 (all 0 before the launch; 0 again after it) and out [T, n_heads * hd] fp32.
extern "C" __global__ void attention_fused_f16(const float* q, int q_stride, const u16* k_cache, const u16* v_cache,
                                               int capacity, int n_heads, int n_kv_heads, int hd, const int* pos,
                                               int window, float scale, float* part_m, float* part_l, float* part_acc,
                                               unsigned int* counters, float* out) {
    attention_split<F16>(q, q_stride, k_cache, v_cache, capacity, n_heads, n_kv_heads, hd, pos, window, scale,
                         part_m, part_l, part_acc, counters, out);
}
extern "C" __global__ void attention_fused_bf16(const float* q, int q_stride, const u16* k_cache, const u16* v_cache,
                                                int capacity, int n_heads, int n_kv_heads, int hd, const int* pos,
                                                int window, float scale, float* part_m, float* part_l, float* part_acc,
                                                unsigned int* counters, float* out) {
    attention_split<BF16>(q, q_stride, k_cache, v_cache, capacity, n_heads, n_kv_heads, hd, pos, window, scale,
                          part_m, part_l, part_acc, counters, out);
}
