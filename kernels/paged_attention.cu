// paged_attention.cu: attention for a batch of sequences whose K/V live in the paged pool (vLLM's
// PagedAttention), plus the two small kernels around it that a mixed batch needs: RoPE at per-token
// positions, and the write of new keys/values into their (block, slot).
//
// CPU reference: minillm.cuda.gpu_batched.paged_attention_reference (a NumPy gather through the block
// table, then the plain softmax), and minillm.engine.batched / minillm.engine.paged_kv for the layout:
//
//     k_pool, v_pool (one layer)  [num_blocks, block_size, n_kv_heads, hd]   16-bit, or int8 codes with
//     k_scale, v_scale            [num_blocks, block_size, n_kv_heads]       fp32 (the int8 pool: a scale per
//                                                                            position and KV head, Int8KVCache's)
//     block_tables                [B, max_blocks] int32   row b = sequence b's blocks (padded past its end)
//     position p of sequence b    block block_tables[b][p / block_size], slot p % block_size
//
// A batch is N query tokens (the rows of the fused qkv matrix, after RoPE): a decode contributes one row,
// a prefill chunk T rows. Row t belongs to sequence token_seq[t] and sits at position token_pos[t]; it
// sees that sequence's keys [lo, p], lo = 0 or p - window + 1 (sliding window; window = 0: none). Its own
// key is already in the pool (paged_kv_write runs first), so causality inside a chunk is just "keys up
// to my position". One kernel serves decode and prefill alike: simple, and the engine's chunks are short
// (a token budget per step), so a prefill chunk re-reading its keys once per query costs little here.
//
// v1 (this file): one block per (query row, query head), PA_WARPS warps. Each warp takes every
// PA_WARPS-th key of the range, follows the block table to find it, and keeps its own online-softmax
// state (running max m, sum l, unnormalized acc) in registers: its lanes hold hd/32 dims of q, K and V
// (hd <= 256) and a warp shuffle gives each score. The warp states merge in shared memory:
//     M = max_w m_w,  L = Σ_w l_w·e^(m_w − M),  out = Σ_w acc_w·e^(m_w − M) / L
// GQA: query head h reads KV head h / (n_heads / n_kv_heads); the query heads of a group re-read the
// same K/V from L2. All accumulation is fp32.
//
// v2 (paged_attention_g{G}): one block per (query row, KV head) serves the G = n_heads / n_kv_heads query
// heads of its group: a warp loads each K/V row once into registers and scores it against G queries
// (Mistral: G = 4, so a quarter of v1's K/V loads). Same online softmax and merge, per query head.
#include "common.cuh"

#define PA_WARPS 4
#define PA_MAX_HD 256
#define PA_PER_LANE (PA_MAX_HD / 32)

// The pool's formats: Pool16<W>, the weights' 16 bits; Pool8, int8 codes whose vector scale is applied once
// per key (to its score, and to its probability before it weighs v), as decode_attention.cu's KV8.
template <class W>
struct Pool16 {
    using Elem = u16;
    static constexpr bool SCALED = false;
    static __device__ __forceinline__ float at(const Elem* p, int d) { return W::to_float(p[d]); }
};
struct Pool8 {
    using Elem = signed char;
    static constexpr bool SCALED = true;
    static __device__ __forceinline__ float at(const Elem* p, int d) { return (float)p[d]; }
};

template <class P>
__device__ void paged_attention(const float* __restrict__ q, int q_stride, const typename P::Elem* __restrict__ k_pool,
                                const typename P::Elem* __restrict__ v_pool, const float* __restrict__ k_scale,
                                const float* __restrict__ v_scale, int block_size, int n_heads, int n_kv_heads,
                                int hd, const int* __restrict__ block_tables, int max_blocks,
                                const int* __restrict__ token_seq, const int* __restrict__ token_pos,
                                int window, float scale, float* __restrict__ out) {
    __shared__ float sm_m[PA_WARPS], sm_l[PA_WARPS], sm_acc[PA_WARPS][PA_MAX_HD];
    int t = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int p = token_pos[t];
    int lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
    int kvh = h / (n_heads / n_kv_heads);
    size_t slot_stride = (size_t)n_kv_heads * hd;          // elements from one slot to the next

    const float* qh = q + (size_t)t * q_stride + (size_t)h * hd;
    float qr[PA_PER_LANE], acc[PA_PER_LANE];
#pragma unroll
    for (int i = 0; i < PA_PER_LANE; i++) {
        int d = lane + 32 * i;
        qr[i] = d < hd ? qh[d] * scale : 0.0f;             // fold 1/√hd into q once
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = lo + warp; j <= p; j += PA_WARPS) {
        size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const typename P::Elem* kj = k_pool + slot * slot_stride + (size_t)kvh * hd;
        const typename P::Elem* vj = v_pool + slot * slot_stride + (size_t)kvh * hd;
        float sc = 0.0f;
#pragma unroll
        for (int i = 0; i < PA_PER_LANE; i++) {
            int d = lane + 32 * i;
            if (d < hd) sc += qr[i] * P::at(kj, d);
        }
        sc = warp_sum(sc);
        if (P::SCALED) sc *= k_scale[slot * n_kv_heads + kvh];    // q·(k8·s) = (q·k8)·s
        float m_new = fmaxf(m, sc);
        float correction = expf(m - m_new);                // m = -inf on a warp's first key: e^-inf = 0
        float pj = expf(sc - m_new);
        l = l * correction + pj;
        float pv = P::SCALED ? pj * v_scale[slot * n_kv_heads + kvh] : pj;   // p·(v8·s)
#pragma unroll
        for (int i = 0; i < PA_PER_LANE; i++) {
            int d = lane + 32 * i;
            if (d < hd) acc[i] = acc[i] * correction + pv * P::at(vj, d);
        }
        m = m_new;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < PA_PER_LANE; i++) {
        int d = lane + 32 * i;
        if (d < hd) sm_acc[warp][d] = acc[i];
    }
    __syncthreads();
    // Merge: at least one warp saw a key (the query's own), so M is finite; a warp that saw none has
    // m = -inf, l = 0 and weighs e^-inf = 0.
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < PA_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.0f, weight[PA_WARPS];
#pragma unroll
    for (int w = 0; w < PA_WARPS; w++) { weight[w] = expf(sm_m[w] - M); L += sm_l[w] * weight[w]; }
    float* o = out + (size_t)t * n_heads * hd + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < PA_WARPS; w++) s += sm_acc[w][d] * weight[w];
        o[d] = s / L;
    }
}

// grid (N, n_heads), block (32 * PA_WARPS); q = the qkv rows [N, q_stride] fp32, out [N, n_heads * hd] fp32
#define PAGED_ATTENTION_KERNEL(name, W)                                                                        \
    extern "C" __global__ void name(const float* q, int q_stride, const u16* k_pool, const u16* v_pool,       \
                                    int block_size, int n_heads, int n_kv_heads, int hd,                       \
                                    const int* block_tables, int max_blocks, const int* token_seq,             \
                                    const int* token_pos, int window, float scale, float* out) {               \
        paged_attention<Pool16<W>>(q, q_stride, k_pool, v_pool, nullptr, nullptr, block_size, n_heads,          \
                                   n_kv_heads, hd, block_tables, max_blocks, token_seq, token_pos, window,     \
                                   scale, out);                                                                \
    }
PAGED_ATTENTION_KERNEL(paged_attention_f16, F16)
PAGED_ATTENTION_KERNEL(paged_attention_bf16, BF16)

// The same over the int8 pool: k_pool, v_pool int8 codes, k_scale, v_scale fp32 [num_blocks, block_size,
// n_kv_heads] (one layer), following the codes in the argument list.
extern "C" __global__ void paged_attention_int8(const float* q, int q_stride, const signed char* k_pool,
                                                const signed char* v_pool, const float* k_scale, const float* v_scale,
                                                int block_size, int n_heads, int n_kv_heads, int hd,
                                                const int* block_tables, int max_blocks, const int* token_seq,
                                                const int* token_pos, int window, float scale, float* out) {
    paged_attention<Pool8>(q, q_stride, k_pool, v_pool, k_scale, v_scale, block_size, n_heads, n_kv_heads, hd,
                           block_tables, max_blocks, token_seq, token_pos, window, scale, out);
}


// v2: grid (N, n_kv_heads), block (32 * PA_WARPS); G query heads kvh·G .. kvh·G + G-1 per block.
template <class P, int G>
__device__ void paged_attention_group(const float* __restrict__ q, int q_stride,
                                      const typename P::Elem* __restrict__ k_pool,
                                      const typename P::Elem* __restrict__ v_pool, const float* __restrict__ k_scale,
                                      const float* __restrict__ v_scale, int block_size, int n_heads, int n_kv_heads,
                                      int hd, const int* __restrict__ block_tables, int max_blocks,
                                      const int* __restrict__ token_seq, const int* __restrict__ token_pos,
                                      int window, float scale, float* __restrict__ out) {
    __shared__ float sm_m[PA_WARPS][G], sm_l[PA_WARPS][G], sm_acc[PA_WARPS][G][PA_MAX_HD];
    int t = blockIdx.x, kvh = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int p = token_pos[t];
    int lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
    size_t slot_stride = (size_t)n_kv_heads * hd;

    const float* qg = q + (size_t)t * q_stride + (size_t)kvh * G * hd;     // the group's G query heads
    float qr[G][PA_PER_LANE], acc[G][PA_PER_LANE], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < PA_PER_LANE; i++) {
            int d = lane + 32 * i;
            qr[g][i] = d < hd ? qg[g * hd + d] * scale : 0.0f;
            acc[g][i] = 0.0f;
        }
    }
    for (int j = lo + warp; j <= p; j += PA_WARPS) {
        size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const typename P::Elem* kj = k_pool + slot * slot_stride + (size_t)kvh * hd;
        const typename P::Elem* vj = v_pool + slot * slot_stride + (size_t)kvh * hd;
        float kr[PA_PER_LANE], vr[PA_PER_LANE];              // this key and value, loaded once for G heads
#pragma unroll
        for (int i = 0; i < PA_PER_LANE; i++) {
            int d = lane + 32 * i;
            kr[i] = d < hd ? P::at(kj, d) : 0.0f;
            vr[i] = d < hd ? P::at(vj, d) : 0.0f;
        }
        float ks = P::SCALED ? k_scale[slot * n_kv_heads + kvh] : 1.0f;
        float vs = P::SCALED ? v_scale[slot * n_kv_heads + kvh] : 1.0f;
#pragma unroll
        for (int g = 0; g < G; g++) {
            float sc = 0.0f;
#pragma unroll
            for (int i = 0; i < PA_PER_LANE; i++) sc += qr[g][i] * kr[i];
            sc = warp_sum(sc) * ks;
            float m_new = fmaxf(m[g], sc);
            float correction = expf(m[g] - m_new);
            float pj = expf(sc - m_new);
            l[g] = l[g] * correction + pj;
            float pv = pj * vs;
#pragma unroll
            for (int i = 0; i < PA_PER_LANE; i++) acc[g][i] = acc[g][i] * correction + pv * vr[i];
            m[g] = m_new;
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
#pragma unroll
        for (int i = 0; i < PA_PER_LANE; i++) {
            int d = lane + 32 * i;
            if (d < hd) sm_acc[warp][g][d] = acc[g][i];
        }
    }
    __syncthreads();
    float* o = out + (size_t)t * n_heads * hd + (size_t)kvh * G * hd;        // the group's heads are adjacent
    for (int e = threadIdx.x; e < G * hd; e += blockDim.x) {
        int g = e / hd, d = e % hd;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < PA_WARPS; w++) M = fmaxf(M, sm_m[w][g]);
        float L = 0.0f, s = 0.0f;
#pragma unroll
        for (int w = 0; w < PA_WARPS; w++) {
            float weight = expf(sm_m[w][g] - M);
            L += sm_l[w][g] * weight;
            s += sm_acc[w][g][d] * weight;
        }
        o[d + g * hd] = s / L;
    }
}

// The group kernels, for G = 1, 2, 4, 8 (the caller picks by n_heads / n_kv_heads); same arguments as v1.
#define PAGED_ATTENTION_GROUP_KERNEL(name, W, G)                                                               \
    extern "C" __global__ void name(const float* q, int q_stride, const u16* k_pool, const u16* v_pool,       \
                                    int block_size, int n_heads, int n_kv_heads, int hd,                       \
                                    const int* block_tables, int max_blocks, const int* token_seq,             \
                                    const int* token_pos, int window, float scale, float* out) {               \
        paged_attention_group<Pool16<W>, G>(q, q_stride, k_pool, v_pool, nullptr, nullptr, block_size, n_heads, \
                                            n_kv_heads, hd, block_tables, max_blocks, token_seq, token_pos,    \
                                            window, scale, out);                                               \
    }
#define PAGED_ATTENTION_GROUP_INT8_KERNEL(name, G)                                                             \
    extern "C" __global__ void name(const float* q, int q_stride, const signed char* k_pool,                  \
                                    const signed char* v_pool, const float* k_scale, const float* v_scale,     \
                                    int block_size, int n_heads, int n_kv_heads, int hd,                       \
                                    const int* block_tables, int max_blocks, const int* token_seq,             \
                                    const int* token_pos, int window, float scale, float* out) {               \
        paged_attention_group<Pool8, G>(q, q_stride, k_pool, v_pool, k_scale, v_scale, block_size, n_heads,    \
                                        n_kv_heads, hd, block_tables, max_blocks, token_seq, token_pos, window, \
                                        scale, out);                                                           \
    }
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g1_f16, F16, 1)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g2_f16, F16, 2)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g4_f16, F16, 4)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g8_f16, F16, 8)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g1_bf16, BF16, 1)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g2_bf16, BF16, 2)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g4_bf16, BF16, 4)
PAGED_ATTENTION_GROUP_KERNEL(paged_attention_g8_bf16, BF16, 8)
PAGED_ATTENTION_GROUP_INT8_KERNEL(paged_attention_g1_int8, 1)
PAGED_ATTENTION_GROUP_INT8_KERNEL(paged_attention_g2_int8, 2)
PAGED_ATTENTION_GROUP_INT8_KERNEL(paged_attention_g4_int8, 4)
PAGED_ATTENTION_GROUP_INT8_KERNEL(paged_attention_g8_int8, 8)


// The new keys and values of each qkv row into the pool: row t -> flat slot slots[t] (= block ·
// block_size + offset), one layer. Same job as kv_append.cu, but the destination comes from a slot list,
// not from pos[0] + t: a batch's rows belong to different sequences, each in its own blocks. A negative
// slot (a row that pads a decode graph's batch to its bucket) writes nothing.
// grid (N, n_kv_heads), block (min(hd, 256))
template <class W>
__device__ void paged_kv_write(const float* __restrict__ qkv, int row_stride, int n_heads, int n_kv_heads,
                               int hd, const int* __restrict__ slots, u16* __restrict__ k_pool,
                               u16* __restrict__ v_pool) {
    int t = blockIdx.x, kvh = blockIdx.y;
    if (slots[t] < 0) return;                              // a padded row
    const float* row = qkv + (size_t)t * row_stride;
    const float* k = row + (size_t)(n_heads + kvh) * hd;
    const float* v = row + (size_t)(n_heads + n_kv_heads + kvh) * hd;
    size_t dst = ((size_t)slots[t] * n_kv_heads + kvh) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        k_pool[dst + d] = W::from_float(k[d]);
        v_pool[dst + d] = W::from_float(v[d]);
    }
}

#define PAGED_KV_WRITE_KERNEL(name, W)                                                                         \
    extern "C" __global__ void name(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int hd,    \
                                    const int* slots, u16* k_pool, u16* v_pool) {                              \
        paged_kv_write<W>(qkv, row_stride, n_heads, n_kv_heads, hd, slots, k_pool, v_pool);                    \
    }
PAGED_KV_WRITE_KERNEL(paged_kv_write_f16, F16)
PAGED_KV_WRITE_KERNEL(paged_kv_write_bf16, BF16)

// The int8 pool's write: row t's key and value of KV head kvh quantized (common.cuh, as kv_append_int8) into
// slot slots[t] (none if negative): codes [num_blocks * block_size, n_kv_heads, hd] int8, scales [.., n_kv_heads] fp32.
// grid (N, n_kv_heads), block 64: warp 0 the key, warp 1 the value.
extern "C" __global__ void paged_kv_write_int8(const float* __restrict__ qkv, int row_stride, int n_heads,
                                               int n_kv_heads, int hd, const int* __restrict__ slots,
                                               signed char* __restrict__ k_pool, signed char* __restrict__ v_pool,
                                               float* __restrict__ k_scale, float* __restrict__ v_scale) {
    int t = blockIdx.x, kvh = blockIdx.y;
    if (slots[t] < 0) return;                              // a padded row (the whole block leaves together)
    int is_v = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* src = qkv + (size_t)t * row_stride + (size_t)(n_heads + is_v * n_kv_heads + kvh) * hd;
    size_t vec = (size_t)slots[t] * n_kv_heads + kvh;
    quantize_vector_int8(src, hd, lane, (is_v ? v_pool : k_pool) + vec * hd, (is_v ? v_scale : k_scale) + vec);
}


// RoPE (HF's half-split layout, as rope.cu) with each row's own position: rope.cu reads one start
// position for contiguous rows, but a batch's rows sit at unrelated positions.
// grid (N, n_heads + n_kv_heads), block (hd / 2); qkv [N, row_stride] fp32, in place
extern "C" __global__ void rope_at_positions(float* qkv, int row_stride, int hd, const int* token_pos,
                                             const float* inv_freq) {
    int t = blockIdx.x, head = blockIdx.y, i = threadIdx.x, half = hd / 2;
    if (i >= half) return;
    float angle = (float)token_pos[t] * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    float* v = qkv + (size_t)t * row_stride + (size_t)head * hd;
    float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
}
