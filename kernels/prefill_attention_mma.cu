// prefill_attention_mma.cu: prefill_attention.cu's contract on the tensor cores (mma.sync m16n8k16, fp16 or
// bf16 inputs, fp32 accumulators): softmax(q·Kᵀ/√hd + mask)·V for the T queries of a prefill chunk.
//
// Contract (as prefill_attention.cu; CPU reference minillm.model.attention.attend): query t of this call sits
// at absolute position p = pos[0] + t and sees keys [lo, p], lo = 0, or p - window + 1 with a sliding window
// (window = 0: none); the cache is contiguous (slot = position); query head h reads KV head
// h / (n_heads / n_kv_heads). q is fp32 inside the qkv rows (q_stride floats apart), out fp32.
//
// Why: prefill_attention.cu does its ~2 GFLOP a layer (Mistral-7B, T = 512) on fp32 FMAs: ~190 µs a layer,
// 6.1 ms of a 19 ms TTFT. The same FLOPs on the tensor cores are a few µs; what remains is loading K/V
// tiles and the softmax, an estimated 10-30 µs a layer (≤ 1 ms of TTFT). NOT YET MEASURED.
//
// Design (FlashAttention-2):
//   rows: as prefill_attention.cu, a row is one (token, query head) of ONE KV head's GQA group, row r ->
//         token r / group, head r % group (Mistral: 4 heads a token), so the group's heads share the K/V tiles.
//   block: MM_WARPS = 4 warps x 16 rows = 64 rows of one KV head; grid (row tiles, n_kv_heads), heaviest
//         (latest tokens) first.
//   Q:    each warp loads its 16 x HD query rows once from global memory straight into mma A fragments,
//         multiplied by scale·log2(e) (the softmax then uses exp2) and rounded to 16 bits.
//   K/V:  tiles of MM_KT = 32 keys x HD in shared memory, two stages: cp.async brings tile i + 1 while the
//         warps work on tile i. Rows are HD + 8 halves apart (272 B at HD = 128) so that the 8 row addresses
//         of one ldmatrix phase fall in 8 different 16-byte bank groups (no conflicts). Keys past the range
//         are zero-filled (a cache slot past the end may hold anything, NaN included: 0 · NaN = NaN).
//   S = Q·Kᵀ: per tile a warp's S is 16 x 32 = 4 n-tiles of 8 keys; K is the B operand ("col": B[d][key] =
//         K[key][d], d contiguous), which is exactly what a plain ldmatrix of the row-major K tile gives.
//   softmax: each lane holds 2 rows (g = lane / 4 and g + 8) x 8 keys of S; masking (causal / window / range
//         end) per element, the row max over the 4 lanes of a quad by shuffles, running max m and per-lane
//         partial sums l (summed over the quad once at the end), accumulators rescaled by exp2(m - m').
//   O += P·V: the S accumulator fragment of two adjacent n-tiles is, element for element, the A fragment of
//         one 16-key k-step (no shuffles): P is packed to 16 bits in registers. V is the B operand with keys
//         as k: ldmatrix.trans of the row-major V tile. O is 16 x HD fp32 per warp (HD / 8 n-tiles x 4).
//   A warp skips the math of a tile that none of its rows can see (before every row's window or after every
//   row's position), but still helps load every tile.
// HD = 64 or 128 exactly (hd % 16 == 0 and the mma k-steps cover it); other head sizes keep
// prefill_attention.cu. Static shared memory: 2 stages x 2 (K, V) x 32 x (HD + 8) x 2 B = 34 KB at HD = 128.
// The lane <-> (row, col) mapping of every fragment is emulated in NumPy by minillm/cuda/dev/prefill_mma.py
// and checked on the CPU (tests/test_prefill_mma.py).
#include "common.cuh"
#include "mma.cuh"

#define MM_WARPS 4                       // warps per block
#define MM_ROWS (16 * MM_WARPS)          // query rows per block (16 per warp: the mma's M)
#define MM_KT 32                         // keys per K/V tile (4 n-tiles of S, 2 k-steps of P·V)

__device__ __forceinline__ float fast_exp2(float x) {          // ex2.approx: exp2(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// first key a query at absolute position p may see
__device__ __forceinline__ int first_key(int p, int window) { return (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0; }

// Where key `key` of KV head kvh sits, as an offset in values from the start of k (and of v: the same layout).
// ContiguousKV: one sequence's cache [n_kv_heads, capacity, HD] (prefill_attention_mma_*). PagedKV: the
// serving engine's pool [num_blocks, block_size, n_kv_heads, HD] through one chunk's block table
// (paged_prefill_attention_mma_*). Only keys the chunk may see are asked for (key < k_end: table entries in use).
template <int HD>
struct ContiguousKV {
    const u16* k;
    const u16* v;
    int capacity;
    __device__ __forceinline__ size_t row(int key, int kvh) const { return ((size_t)kvh * capacity + key) * HD; }
};
template <int HD>
struct PagedKV {
    const u16* k;
    const u16* v;
    const int* table;                            // this chunk's block table row
    int block_size, n_kv_heads;
    __device__ __forceinline__ size_t row(int key, int kvh) const {
        size_t slot = (size_t)table[key / block_size] * block_size + key % block_size;
        return (slot * n_kv_heads + kvh) * HD;
    }
};

// One block: MM_ROWS rows (row tile `tile` of the chunk) of one KV head's group (blockIdx.y). q, out: the
// chunk's first row; p0: the chunk's first position.
template <class W, int HD, class KV>
__device__ void prefill_attention_mma(const float* __restrict__ q, int q_stride, KV kv, int T, int n_heads,
                                      int n_kv_heads, int p0, int window, float scale, float* __restrict__ out,
                                      int tile) {
    constexpr int KS = HD + 8;                   // tile row stride in halves (272 B at HD = 128: see the top)
    constexpr int KSTEPS = HD / 16;              // mma k-steps of Q·Kᵀ
    constexpr int ONT = HD / 8;                  // n-tiles of O
    constexpr int CHUNKS = HD / 8;               // 16-byte chunks in a K or V row
    __shared__ __align__(16) u16 Ks[2][MM_KT][KS];
    __shared__ __align__(16) u16 Vs[2][MM_KT][KS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;      // the fragments' groupID (row / key) and thread-in-group (col pair)
    const int kvh = blockIdx.y, group = n_heads / n_kv_heads, n_rows = T * group;
    const int row0 = tile * MM_ROWS;

    // This lane's two rows, g and g + 8 of the warp's 16: position and first visible key (invalid: sees nothing).
    const int wrow0 = row0 + warp * 16;
    int my_p[2], my_lo[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = wrow0 + g + 8 * r;
        my_p[r] = row < n_rows ? p0 + row / group : -1;
        my_lo[r] = first_key(my_p[r], window);
    }

    // Q -> A fragments, once: qa[kk] covers dims 16 kk .. 16 kk + 15; a[0] (row g, dims 2tq, +1), a[1] (row g+8,
    // same dims), a[2] (row g, dims 2tq + 8, +1), a[3] (row g+8, those). Pre-scaled for exp2. Invalid rows: 0.
    const float qscale = scale * 1.4426950408889634f;            // 1/√hd · log2(e)
    u32 qa[KSTEPS][4];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = wrow0 + g + 8 * r;
        const float* qrow = nullptr;
        if (row < n_rows) qrow = q + (size_t)(row / group) * q_stride + (size_t)(kvh * group + row % group) * HD;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                float2 v = make_float2(0.0f, 0.0f);
                if (qrow) v = *reinterpret_cast<const float2*>(qrow + 16 * kk + 8 * half + 2 * tq);
                qa[kk][r + 2 * half] = Mma<W>::pack(v.x * qscale, v.y * qscale);
            }
        }
    }

    float o[ONT][4];                             // O fragments: o[j] = (row g, dims 8j + 2tq, +1), (row g+8, same)
#pragma unroll
    for (int j = 0; j < ONT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};        // running max (log2 units), this lane's partial sums

    // The block's key range: from its first row's lo to its last valid row's position. The warp's own range
    // (for skipping tiles) likewise from its first and last valid rows.
    const int last_row = min(n_rows, row0 + MM_ROWS) - 1;
    const int k_begin = first_key(p0 + row0 / group, window), k_end = p0 + last_row / group + 1;
    const int w_last = min(n_rows, wrow0 + 16) - 1;
    const bool w_any = wrow0 < n_rows;
    const int w_lo = w_any ? first_key(p0 + wrow0 / group, window) : 0;
    const int w_hi = w_any ? p0 + w_last / group : -1;           // no valid row: every tile skipped

    // tile kb -> stage: every thread copies its share of 16-byte chunks of K and V (keys past k_end: zeros)
    auto load_tile = [&](int kb, int stage) {
        for (int i = threadIdx.x; i < MM_KT * CHUNKS; i += 32 * MM_WARPS) {
            int j = i / CHUNKS, c = i % CHUNKS, key = kb + j;
            bool ok = key < k_end;
            size_t off = ok ? kv.row(key, kvh) + c * 8 : 0;
            cp_async16(smem_u32(&Ks[stage][j][c * 8]), kv.k + off, ok);
            cp_async16(smem_u32(&Vs[stage][j][c * 8]), kv.v + off, ok);
        }
    };

    const int n_tiles = (k_end - k_begin + MM_KT - 1) / MM_KT;
    load_tile(k_begin, 0);
    cp_async_commit();
    for (int it = 0; it < n_tiles; it++) {
        const int kb = k_begin + it * MM_KT, stage = it & 1;
        if (it + 1 < n_tiles) load_tile(kb + MM_KT, stage ^ 1);  // stage ^ 1 was released by the last barrier
        cp_async_commit();                                       // (an empty group when there is no next tile)
        cp_async_wait_one();                                     // this tile's group has landed ...
        __syncthreads();                                         // ... for every thread's copies

        if (kb <= w_hi && kb + MM_KT - 1 >= w_lo) {
            // S = Q·Kᵀ: s[n] = keys kb + 8n + 2tq, +1 for rows g (s[n][0..1]) and g + 8 (s[n][2..3]).
            // Per pair of k-steps, the 4 n-tiles' B fragments first, then 4 independent mma in a row (not one
            // n-tile's chain of dependent ones).
            float s[4][4];
#pragma unroll
            for (int n = 0; n < 4; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                // matrices: keys 8n..8n+7 x dims 16kk + {0, 8, 16, 24} .. +7 -> b0, b1 of step kk, of kk + 1
                u32 b[4][4];
#pragma unroll
                for (int n = 0; n < 4; n++)
                    ldmatrix_x4(b[n], smem_u32(&Ks[stage][8 * n + (lane & 7)][16 * kk + 8 * (lane >> 3)]));
#pragma unroll
                for (int n = 0; n < 4; n++) Mma<W>::mma(s[n], qa[kk], b[n][0], b[n][1]);
#pragma unroll
                for (int n = 0; n < 4; n++) Mma<W>::mma(s[n], qa[kk + 1], b[n][2], b[n][3]);
            }

            // mask, new running max (over the quad: the 4 lanes that share a row), exponentials, partial sums
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int key = kb + 8 * n + 2 * tq + (e & 1), r = e >> 1;
                    if (key < my_lo[r] || key > my_p[r]) s[n][e] = NEG_INF;   // key <= p < k_end: never a zero pad
                    mx[r] = fmaxf(mx[r], s[n][e]);
                }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                float m_new = fmaxf(m[r], mx[r]);
                float base = m_new == NEG_INF ? 0.0f : m_new;    // a row that has seen nothing yet: exps are 0
                float corr = fast_exp2(m[r] - base);             // m = -inf: 0 (nothing accumulated)
                m[r] = m_new;
                l[r] *= corr;
#pragma unroll
                for (int j = 0; j < ONT; j++) {
                    o[j][2 * r] *= corr;
                    o[j][2 * r + 1] *= corr;
                }
#pragma unroll
                for (int n = 0; n < 4; n++)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; e++) {
                        s[n][e] = fast_exp2(s[n][e] - base);     // masked: exp2(-inf) = 0
                        l[r] += s[n][e];
                    }
            }

            // O += P·V, k-step ks = keys kb + 16ks .. +15. P's A fragment is S's C fragments of n-tiles 2ks, 2ks+1.
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                u32 pa[4] = {Mma<W>::pack(s[2 * ks][0], s[2 * ks][1]), Mma<W>::pack(s[2 * ks][2], s[2 * ks][3]),
                             Mma<W>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             Mma<W>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
                for (int j = 0; j < ONT; j += 2) {
                    // matrices (transposed): keys 16ks + {0, 8} .. +7 x dims 8j .. 8j+7, then x dims 8j+8 .. +15
                    u32 b[4];
                    ldmatrix_x4_trans(b, smem_u32(&Vs[stage][16 * ks + (lane & 7) + 8 * ((lane >> 3) & 1)]
                                                        [8 * j + 8 * (lane >> 4)]));
                    Mma<W>::mma(o[j], pa, b[0], b[1]);
                    Mma<W>::mma(o[j + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();                                         // everyone is done with this stage
    }

    // l over the quad, then out = O / l for the valid rows: (row g, dims 8j + 2tq, +1) as one float2
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = wrow0 + g + 8 * r;
        if (row >= n_rows) continue;
        float inv_l = 1.0f / l[r];
        float* orow = out + ((size_t)(row / group) * n_heads + kvh * group + row % group) * HD;
#pragma unroll
        for (int j = 0; j < ONT; j++)
            *reinterpret_cast<float2*>(orow + 8 * j + 2 * tq) = make_float2(o[j][2 * r] * inv_l, o[j][2 * r + 1] * inv_l);
    }
}

// grid ((T * group + 63) / 64, n_kv_heads), block (128). q: fp32, query head h of token t at
// q[t * q_stride + h * HD] (q_stride even); k_cache, v_cache: one layer, [n_kv_heads, capacity, HD] 16-bit,
// with the chunk's own keys already appended; out [T, n_heads * HD] fp32. head_dim must equal HD.
#define PREFILL_ATTENTION_MMA_KERNEL(name, W, HD)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * MM_WARPS) name(                                           \
        const float* q, int q_stride, const u16* k_cache, const u16* v_cache, int capacity, int T, int n_heads, \
        int n_kv_heads, const int* pos, int window, float scale, float* out) {                                  \
        prefill_attention_mma<W, HD>(q, q_stride, ContiguousKV<HD>{k_cache, v_cache, capacity}, T, n_heads,     \
                                     n_kv_heads, pos[0], window, scale, out,                                    \
                                     gridDim.x - 1 - blockIdx.x);        /* heaviest (latest tokens) first */    \
    }
PREFILL_ATTENTION_MMA_KERNEL(prefill_attention_mma_hd64_f16, F16, 64)
PREFILL_ATTENTION_MMA_KERNEL(prefill_attention_mma_hd128_f16, F16, 128)
PREFILL_ATTENTION_MMA_KERNEL(prefill_attention_mma_hd64_bf16, BF16, 64)
PREFILL_ATTENTION_MMA_KERNEL(prefill_attention_mma_hd128_bf16, BF16, 128)

// The serving engine's prefill steps: every chunk of a batch in one launch, K/V read from the paged pool through
// each chunk's block table (batch_meta.py's layout; paged_attention.cu's contract: row r at position
// token_pos[r] sees its sequence's keys [lo, token_pos[r]], its own key already written). Chunk c (blockIdx.z)
// is rows last_rows[c - 1] + 1 .. last_rows[c] (from 0 for c = 0), consecutive positions, table row c.
// grid (row tiles of the longest chunk, n_kv_heads, chunks), block (128); a block past its chunk's tiles exits.
// q: the qkv rows (q_stride floats apart); out [N, n_heads * HD] fp32; a 16-bit pool with head_dim == HD.
#define PAGED_PREFILL_ATTENTION_MMA_KERNEL(name, W, HD)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * MM_WARPS) name(                                           \
        const float* q, int q_stride, const u16* k_pool, const u16* v_pool, int block_size, int n_heads,        \
        int n_kv_heads, const int* block_tables, int max_blocks, const int* last_rows, const int* token_pos,    \
        int window, float scale, float* out) {                                                                  \
        const int c = blockIdx.z, r0 = c ? last_rows[c - 1] + 1 : 0, T = last_rows[c] + 1 - r0;                 \
        const int tiles = (T * (n_heads / n_kv_heads) + MM_ROWS - 1) / MM_ROWS;                                 \
        if ((int)blockIdx.x >= tiles) return;                          /* the whole block: before any barrier */ \
        PagedKV<HD> kv{k_pool, v_pool, block_tables + (size_t)c * max_blocks, block_size, n_kv_heads};          \
        prefill_attention_mma<W, HD>(q + (size_t)r0 * q_stride, q_stride, kv, T, n_heads, n_kv_heads,           \
                                     token_pos[r0], window, scale, out + (size_t)r0 * n_heads * HD,             \
                                     tiles - 1 - blockIdx.x);                                                   \
    }
PAGED_PREFILL_ATTENTION_MMA_KERNEL(paged_prefill_attention_mma_hd64_f16, F16, 64)
PAGED_PREFILL_ATTENTION_MMA_KERNEL(paged_prefill_attention_mma_hd128_f16, F16, 128)
PAGED_PREFILL_ATTENTION_MMA_KERNEL(paged_prefill_attention_mma_hd64_bf16, BF16, 64)
PAGED_PREFILL_ATTENTION_MMA_KERNEL(paged_prefill_attention_mma_hd128_bf16, BF16, 128)
