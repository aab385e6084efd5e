// prefill_attention.cu: softmax(q·Kᵀ/√hd + mask)·V for the T queries of a prefill chunk, tiled
// (FlashAttention-2 style: online softmax, K/V tiles in shared memory shared by many queries).
//
// CPU reference: minillm.model.attention.attend, the same contract as decode_attention.cu: query t of this
// call sits at absolute position p = pos[0] + t and sees keys [lo, p], lo = 0, or p - window + 1 with
// a sliding window (window = 0: none); the cache is contiguous (slot = position); query head h reads
// KV head h / (n_heads / n_kv_heads). pos comes from a device buffer, as in the decode kernels.
//
// What it changes: prefill used decode_attention.cu with one query per (token, head) block, so every
// query re-read its whole K/V range from L2: a 512-token Mistral-7B prefill read ~131k (query, key)
// pairs x 32 heads x 2 x 256 B per layer, 574 µs a layer on an H200 (57% of TTFT). Here a block takes
// a tile of ROWS = 32 query rows, a row being one (token, query head) of ONE KV head's GQA group
// (row r -> token r / group, head r % group: Mistral's 4 query heads per KV head share the tile, so a
// tile is 8 tokens x 4 heads; MHA: 32 tokens), stages each KV_TILE = 32 keys of that KV head's K and V
// in shared memory once, and all 32 rows use them: K/V traffic drops by ~32x and the kernel becomes
// FMA-bound (plain fp32 FMAs, no tensor cores).
//
// Block = 4 warps, each owning 8 rows. Per key tile:
//   scores: lane j computes the 8 dot products q_r · k_j (q from shared memory as float4 broadcasts,
//           k_j as 4 halves per 8-byte load, each widened once and used for the 8 rows); causal /
//           window / tile-end masking per row gives -inf;
//   online softmax per row: tile max and sum by warp shuffles, running (m, l), acc rescaled by e^(m-m');
//   P·V: p to shared memory (per warp), then lane d accumulates acc[r][d] += p[r][j] · v_j[d] for its
//        hd/32 dimensions (p as float4 broadcasts, v one widened 16-bit value used for 8 rows).
// fp32 q (pre-scaled by 1/√hd) and fp32 accumulation throughout; K/V stay 16-bit in shared memory
// (37 KB static for HD = 128, under the 48 KB static limit: no opt-in attribute needed).
// HD is a compile-time bound (32, 64 or 128; hd ≤ HD, hd % 4 == 0, the padding is zero); larger heads
// keep the decode kernel. Tiles are walked heaviest-first (the last tokens see the most keys).
// Estimated cost (Mistral-7B, T = 512): ~2.1 GFLOP a layer, ~50-100 µs instead of 574 µs.
#include "common.cuh"

#define PF_ROWS 32            // query rows (token, head of the group) per block
#define PF_WARPS 4            // 8 rows per warp
#define PF_RPW (PF_ROWS / PF_WARPS)
#define PF_KT 32              // keys per tile = lanes

template <class W, int HD>
__device__ void prefill_attention(const float* __restrict__ q, int q_stride, const u16* __restrict__ k_cache,
                                  const u16* __restrict__ v_cache, int capacity, int T, int n_heads, int n_kv_heads,
                                  int hd, const int* pos, int window, float scale, float* __restrict__ out) {
    constexpr int KS = HD + 4;                  // K row stride in halves: 8-byte lanes hit distinct banks
    constexpr int DPL = HD / 32;                // output dims per lane
    __shared__ __align__(16) float Qs[PF_ROWS][HD];
    __shared__ __align__(16) u16 Ks[PF_KT][KS];
    __shared__ __align__(16) u16 Vs[PF_KT][HD];
    __shared__ __align__(16) float Ps[PF_WARPS][PF_RPW][PF_KT];

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int tile = gridDim.x - 1 - blockIdx.x;      // heaviest (latest tokens) first
    int kvh = blockIdx.y;
    int group = n_heads / n_kv_heads;
    int n_rows = T * group;
    int row0 = tile * PF_ROWS;
    int p0 = pos[0];

    // q tile -> shared memory, scaled; rows past the end and dims past hd are 0
    for (int i = threadIdx.x; i < PF_ROWS * HD; i += blockDim.x) {
        int r = i / HD, d = i % HD, row = row0 + r;
        float v = 0.0f;
        if (row < n_rows && d < hd) {
            int t = row / group, h = kvh * group + row % group;
            v = q[(size_t)t * q_stride + (size_t)h * hd + d] * scale;
        }
        Qs[r][d] = v;
    }

    // this warp's rows: absolute position and first visible key (an invalid row sees nothing)
    int my_p[PF_RPW], my_lo[PF_RPW];
    float m[PF_RPW], l[PF_RPW], acc[PF_RPW][DPL];
#pragma unroll
    for (int r = 0; r < PF_RPW; r++) {
        int row = row0 + warp * PF_RPW + r;
        int p = row < n_rows ? p0 + row / group : -1;
        my_p[r] = p;
        my_lo[r] = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[r][i] = 0.0f;
    }

    // the tile's key range: from the first row's lo to the last valid row's position
    int t_first = row0 / group;
    int t_last = min(n_rows - 1, row0 + PF_ROWS - 1) / group;
    int p_first = p0 + t_first, p_last = p0 + t_last;
    int k_begin = (window > 0 && p_first - window + 1 > 0) ? p_first - window + 1 : 0;
    int k_end = p_last + 1;

    const u16* K = k_cache + (size_t)kvh * capacity * hd;
    const u16* V = v_cache + (size_t)kvh * capacity * hd;
    constexpr int C4 = HD / 4;                  // 4-half (8-byte) chunks per row

    for (int kb = k_begin; kb < k_end; kb += PF_KT) {
        __syncthreads();                        // previous tile's K/V (and, first time, Qs writes) done
        for (int i = threadIdx.x; i < PF_KT * C4; i += blockDim.x) {
            int j = i / C4, c = i % C4, key = kb + j;
            uint2 kw = {0u, 0u}, vw = {0u, 0u};
            if (key < k_end && c * 4 < hd) {
                kw = *reinterpret_cast<const uint2*>(K + (size_t)key * hd + c * 4);
                vw = *reinterpret_cast<const uint2*>(V + (size_t)key * hd + c * 4);
            }
            *reinterpret_cast<uint2*>(&Ks[j][c * 4]) = kw;
            *reinterpret_cast<uint2*>(&Vs[j][c * 4]) = vw;
        }
        __syncthreads();

        // scores: lane = key
        float s[PF_RPW];
#pragma unroll
        for (int r = 0; r < PF_RPW; r++) s[r] = 0.0f;
#pragma unroll 4
        for (int c = 0; c < C4; c++) {
            uint2 kw = *reinterpret_cast<const uint2*>(&Ks[lane][c * 4]);
            float k0 = W::lo(kw.x), k1 = W::hi(kw.x), k2 = W::lo(kw.y), k3 = W::hi(kw.y);
#pragma unroll
            for (int r = 0; r < PF_RPW; r++) {
                float4 qv = *reinterpret_cast<const float4*>(&Qs[warp * PF_RPW + r][c * 4]);
                s[r] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
            }
        }
        int key = kb + lane;
#pragma unroll
        for (int r = 0; r < PF_RPW; r++) {
            bool ok = key >= my_lo[r] && key <= my_p[r];         // key <= p < k_end: inside the tile range
            float sc = ok ? s[r] : NEG_INF;
            float m_new = fmaxf(m[r], warp_max(sc));
            float corr = m[r] == NEG_INF ? 0.0f : expf(m[r] - m_new);   // nothing accumulated yet: 0
            float pj = ok ? expf(sc - m_new) : 0.0f;
            l[r] = l[r] * corr + warp_sum(pj);
            m[r] = m_new;
            Ps[warp][r][lane] = pj;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[r][i] *= corr;
        }
        __syncwarp();

        // P·V: lane holds dims lane + 32 i
        int n_keys = min(PF_KT, k_end - kb);
        for (int j4 = 0; j4 < PF_KT / 4; j4++) {
            if (j4 * 4 >= n_keys) break;
            float4 pr[PF_RPW];
#pragma unroll
            for (int r = 0; r < PF_RPW; r++) pr[r] = *reinterpret_cast<const float4*>(&Ps[warp][r][j4 * 4]);
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                float vj[DPL];
#pragma unroll
                for (int i = 0; i < DPL; i++) vj[i] = W::to_float(Vs[j4 * 4 + jj][lane + 32 * i]);
#pragma unroll
                for (int r = 0; r < PF_RPW; r++) {
                    float pv = jj == 0 ? pr[r].x : jj == 1 ? pr[r].y : jj == 2 ? pr[r].z : pr[r].w;
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[r][i] += pv * vj[i];
                }
            }
        }
        __syncwarp();                            // Ps is rewritten by the next tile
    }

#pragma unroll
    for (int r = 0; r < PF_RPW; r++) {
        int row = row0 + warp * PF_RPW + r;
        if (row >= n_rows) continue;
        int t = row / group, h = kvh * group + row % group;
        float inv_l = 1.0f / l[r];
        float* o = out + ((size_t)t * n_heads + h) * hd;
#pragma unroll
        for (int i = 0; i < DPL; i++) {
            int d = lane + 32 * i;
            if (d < hd) o[d] = acc[r][i] * inv_l;
        }
    }
}

// grid ((T * group + 31) / 32, n_kv_heads), block (128). q: fp32, query head h of token t at
// q[t * q_stride + h * hd]; k_cache, v_cache: one layer, [n_kv_heads, capacity, hd] 16-bit, with the
// chunk's own keys already appended; out [T, n_heads * hd] fp32. Needs hd ≤ HD and hd % 4 == 0.
#define PREFILL_ATTENTION_KERNEL(name, W, HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) name(                                                     \
        const float* q, int q_stride, const u16* k_cache, const u16* v_cache, int capacity, int T, int n_heads, \
        int n_kv_heads, int hd, const int* pos, int window, float scale, float* out) {                          \
        prefill_attention<W, HD>(q, q_stride, k_cache, v_cache, capacity, T, n_heads, n_kv_heads, hd, pos,      \
                                 window, scale, out);                                                           \
    }
PREFILL_ATTENTION_KERNEL(prefill_attention_hd32_f16, F16, 32)
PREFILL_ATTENTION_KERNEL(prefill_attention_hd64_f16, F16, 64)
PREFILL_ATTENTION_KERNEL(prefill_attention_hd128_f16, F16, 128)
PREFILL_ATTENTION_KERNEL(prefill_attention_hd32_bf16, BF16, 32)
PREFILL_ATTENTION_KERNEL(prefill_attention_hd64_bf16, BF16, 64)
PREFILL_ATTENTION_KERNEL(prefill_attention_hd128_bf16, BF16, 128)
