// mla_decode.cu: absorbed multi-head latent attention (DeepSeek's MLA) for one decode token.
//
// CPU reference: minillm.model.mla.mla_attention with mode "absorbed" (absorbed_attention), and the
// kernel-by-kernel NumPy references in minillm/cuda/dev/mla.py. Host side: minillm/cuda/gpu_mla.py.
//
// Every head attends to ONE shared cache row per position, the latent [c_kv (r) | k_rope (rope)] of width
// W = r + rope, so attention is MQA over W-wide keys whose first r values are also the values:
//   mla_kv_append   kv = [c | k_rope] (fp32, from the layer's input GEMV) -> RMSNorm(c) · gain, RoPE(k_rope),
//                   written in 16 bits at row pos of the layer's cache [capacity, W]
//   mla_q_absorb    q_cat[h] = [W_UK_hᵀ q_nope[h] (r) | RoPE(q_rope[h]) (rope)]: the query in latent space
//   mla_attention   o_lat[h] = softmax(scale · q_cat[h] · cacheᵀ) · cache[:, :r], split over the keys
//                   (flash-decoding); mla_combine merges the splits
//   mla_v_up        o[h, e] = W_UV_h[e] · o_lat[h]   (then the ordinary GEMV for o_proj, with the residual)
// W_UK_h and W_UV_h are the rows of kv_b_proj [H * (nope + v), r]: per head, nope rows of W_UK then v of W_UV.
//
// RoPE follows mla.py: inv_freq [rope/2] and a gain on cos and sin (YaRN's attention factor) come from the
// host; with `interleave` the pairs are adjacent dims (x[2i], x[2i+1]) and the output is in the half-split
// order (first halves, then second halves), the same for queries and keys, so their dot product is right.
// Positions are read from a device buffer (pos[0]): a captured graph replays for every position.
//
// Requirements (checked by gpu_mla.py): r % 8 == 0 and W % 8 == 0 (16-byte loads), W <= MLA_MAX_W,
// r <= MLA_MAX_R, rope even.
#include "common.cuh"

#define MLA_TK 32           // keys per shared-memory tile in mla_attention
#define MLA_HEADS 16        // query heads per attention block (one warp each): a cached row serves 16 heads
#define MLA_MAX_W 640       // widest cache row (DeepSeek-V3: 512 + 64 = 576)
#define MLA_MAX_R 512       // widest latent (registers per lane: MLA_MAX_R / 32 accumulators)
#define MLA_ABSORB_COLS 256 // latent columns per q-absorb block (32 lanes x 8)

// One RoPE pair i of a rope-wide vector x: (a, b) -> (a cos - b sin, b cos + a sin), written to out[i] and
// out[i + half]. Interleaved pairs are (x[2i], x[2i+1]); half-split ones (x[i], x[i + half]).
__device__ __forceinline__ void rope_pair(const float* x, float* out_lo, float* out_hi, int i, int half,
                                          int interleave, float angle, float gain) {
    float a = interleave ? x[2 * i] : x[i];
    float b = interleave ? x[2 * i + 1] : x[i + half];
    float c = cosf(angle) * gain, s = sinf(angle) * gain;     // fp32, precise, as the CPU's rope_tables
    *out_lo = a * c - b * s;
    *out_hi = b * c + a * s;
}

// grid (1), block (256). kv: [r + rope] fp32 (this token's W_DKV·x | W_KR·x); gain [r] fp32 or unused
// (has_norm 0: a linear latent); cache: one layer's [capacity, W] 16-bit; row pos[0] is written.
template <class F>
__device__ void mla_kv_append(const float* __restrict__ kv, const float* __restrict__ gain, int has_norm, float eps,
                              int r, int rope, const int* pos, const float* __restrict__ inv_freq, float rope_gain,
                              int interleave, u16* __restrict__ cache) {
    int W = r + rope, half = rope / 2;
    u16* row = cache + (size_t)pos[0] * W;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < r; i += blockDim.x) ss += kv[i] * kv[i];
    float inv_rms = has_norm ? rsqrtf(block_sum(ss) / (float)r + eps) : 1.0f;
    for (int i = threadIdx.x; i < r; i += blockDim.x)
        row[i] = F::from_float(has_norm ? kv[i] * inv_rms * gain[i] : kv[i]);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float lo, hi;
        rope_pair(kv + r, &lo, &hi, i, half, interleave, (float)pos[0] * inv_freq[i], rope_gain);
        row[r + i] = F::from_float(lo);
        row[r + i + half] = F::from_float(hi);
    }
}

// grid (H, ceil(r / 256)), block (256 = 8 warps). q: [H, nope + rope] fp32; wkv_b: [H * (nope + v), r];
// q_cat: [H, W] fp32. Warps split head h's nope rows of W_UK, each lane 8 adjacent latent columns (one
// 16-byte load per row, coalesced across the warp); the 8 warps' partial sums meet in shared memory.
// Blocks with blockIdx.y == 0 also rotate the head's rope part into q_cat[h, r:].
template <class F>
__device__ void mla_q_absorb(const float* __restrict__ q, const u16* __restrict__ wkv_b, int nope, int rope, int v,
                             int r, const int* pos, const float* __restrict__ inv_freq, float rope_gain,
                             int interleave, float* __restrict__ q_cat) {
    __shared__ float partial[8][MLA_ABSORB_COLS];
    int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, W = r + rope;
    int c0 = blockIdx.y * MLA_ABSORB_COLS + lane * 8;
    const float* qh = q + (size_t)h * (nope + rope);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (c0 < r) {
        #pragma unroll 4
        for (int d = warp; d < nope; d += 8) {
            uint4 w8 = *reinterpret_cast<const uint4*>(wkv_b + ((size_t)h * (nope + v) + d) * r + c0);
            float qd = qh[d];
            acc[0] += qd * F::lo(w8.x); acc[1] += qd * F::hi(w8.x);
            acc[2] += qd * F::lo(w8.y); acc[3] += qd * F::hi(w8.y);
            acc[4] += qd * F::lo(w8.z); acc[5] += qd * F::hi(w8.z);
            acc[6] += qd * F::lo(w8.w); acc[7] += qd * F::hi(w8.w);
        }
    }
    for (int j = 0; j < 8; j++) partial[warp][lane * 8 + j] = acc[j];
    __syncthreads();
    int c = blockIdx.y * MLA_ABSORB_COLS + threadIdx.x;
    if (c < r) {
        float sum = 0.0f;
        for (int w = 0; w < 8; w++) sum += partial[w][threadIdx.x];
        q_cat[(size_t)h * W + c] = sum;
    }
    int half = rope / 2;
    if (blockIdx.y == 0 && threadIdx.x < half) {
        float lo, hi;
        int i = threadIdx.x;
        rope_pair(qh + nope, &lo, &hi, i, half, interleave, (float)pos[0] * inv_freq[i], rope_gain);
        q_cat[(size_t)h * W + r + i] = lo;
        q_cat[(size_t)h * W + r + i + half] = hi;
    }
}

// How the L = pos[0] + 1 keys split: tiles of MLA_TK keys, at most `most` splits, each a whole number of tiles.
// Both mla_attention and mla_combine derive it from the same length, so a captured graph stays right.
__device__ __forceinline__ void mla_splits(int L, int most, int* used, int* tiles_per_split) {
    int tiles = (L + MLA_TK - 1) / MLA_TK;
    int s = min(most, tiles);
    int per = (tiles + s - 1) / s;
    *tiles_per_split = per;
    *used = (tiles + per - 1) / per;
}

// grid (ceil(H / MLA_HEADS), S), block (32 * MLA_HEADS). q_cat [H, W] fp32; cache: one layer's [capacity, W]
// 16-bit; part_m, part_l [H, S], part_acc [H, S, r] fp32 (split s's running max, sum and unnormalized output).
// Each warp is one query head: its slice of q lives in registers (lane + 32 i), and per key a warp-wide dot
// product gives the score; lane j keeps key j's. A key tile is loaded once per block into shared memory and
// serves all MLA_HEADS heads, for scores and values alike.
template <class F>
__device__ void mla_attention(const float* __restrict__ q_cat, const u16* __restrict__ cache, int H, int r, int W,
                              const int* pos, float scale, float* __restrict__ part_m, float* __restrict__ part_l,
                              float* __restrict__ part_acc) {
    __shared__ __align__(16) u16 tile[MLA_TK * MLA_MAX_W];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, S = gridDim.y, s = blockIdx.y;
    int h = blockIdx.x * MLA_HEADS + warp;
    bool active = h < H;                              // the last block may have fewer heads (no early return:
    int L = pos[0] + 1, used, per;                    //  every warp takes part in the tile loads and barriers)
    mla_splits(L, S, &used, &per);
    int start = s * per * MLA_TK, stop = min(L, start + per * MLA_TK);
    float qr[MLA_MAX_W / 32], acc[MLA_MAX_R / 32];
    #pragma unroll
    for (int i = 0; i < MLA_MAX_W / 32; i++) {
        int d = lane + 32 * i;
        qr[i] = (active && d < W) ? q_cat[(size_t)h * W + d] * scale : 0.0f;
    }
    #pragma unroll
    for (int i = 0; i < MLA_MAX_R / 32; i++) acc[i] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int t0 = start; t0 < stop; t0 += MLA_TK) {
        int n = min(MLA_TK, stop - t0);
        const uint4* src = reinterpret_cast<const uint4*>(cache + (size_t)t0 * W);   // n rows are contiguous
        uint4* dst = reinterpret_cast<uint4*>(tile);
        for (int k = threadIdx.x; k < n * W / 8; k += blockDim.x) dst[k] = src[k];
        __syncthreads();
        float mine = NEG_INF;                         // lane j: the score of key t0 + j
        for (int j = 0; j < n; j++) {
            const u16* key = tile + j * W;
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < MLA_MAX_W / 32; i++) {
                int d = lane + 32 * i;
                if (d < W) dot += qr[i] * F::to_float(key[d]);
            }
            dot = warp_sum(dot);
            if (lane == j) mine = dot;
        }
        float m_new = fmaxf(m, warp_max(mine));
        float alpha = __expf(m - m_new);              // 0 on the first tile (m = -inf)
        float p = lane < n ? __expf(mine - m_new) : 0.0f;
        l = l * alpha + warp_sum(p);
        m = m_new;
        #pragma unroll
        for (int i = 0; i < MLA_MAX_R / 32; i++) acc[i] *= alpha;
        for (int j = 0; j < n; j++) {
            float pj = __shfl_sync(0xffffffffu, p, j);
            const u16* value = tile + j * W;          // the latent c_kv is the value
            #pragma unroll
            for (int i = 0; i < MLA_MAX_R / 32; i++) {
                int c = lane + 32 * i;
                if (c < r) acc[i] += pj * F::to_float(value[c]);
            }
        }
        __syncthreads();                              // the tile is overwritten next
    }
    if (!active) return;
    size_t hs = (size_t)h * S + s;
    if (lane == 0) { part_m[hs] = s < used ? m : NEG_INF; part_l[hs] = s < used ? l : 0.0f; }
    #pragma unroll
    for (int i = 0; i < MLA_MAX_R / 32; i++) {
        int c = lane + 32 * i;
        if (c < r) part_acc[hs * r + c] = acc[i];
    }
}

// grid (H), block (128). The used splits' partials -> o_lat [H, r] fp32 (the softmax-weighted latent).
extern "C" __global__ void mla_combine(const float* part_m, const float* part_l, const float* part_acc, int r, int S,
                                       const int* pos, float* o_lat) {
    int h = blockIdx.x, used, per;
    mla_splits(pos[0] + 1, S, &used, &per);
    const float* m = part_m + (size_t)h * S;
    const float* l = part_l + (size_t)h * S;
    float top = NEG_INF;
    for (int s = 0; s < used; s++) top = fmaxf(top, m[s]);
    float denom = 0.0f;
    for (int s = 0; s < used; s++) denom += __expf(m[s] - top) * l[s];
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < used; s++) sum += __expf(m[s] - top) * part_acc[((size_t)h * S + s) * r + c];
        o_lat[(size_t)h * r + c] = sum / denom;
    }
}

// grid (ceil(H * v / 8)), block (256): a warp per output row. o_lat [H, r] fp32; wkv_b [H * (nope + v), r];
// o [H * v] fp32, row h * v + e = W_UV_h[e] · o_lat[h] (W_UV_h[e] is kv_b_proj's row h * (nope + v) + nope + e).
template <class F>
__device__ void mla_v_up(const float* __restrict__ o_lat, const u16* __restrict__ wkv_b, int H, int nope, int v, int r,
                         float* __restrict__ o) {
    int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= H * v) return;
    int h = row / v, e = row % v;
    const uint4* w = reinterpret_cast<const uint4*>(wkv_b + ((size_t)h * (nope + v) + nope + e) * r);
    const float* x = o_lat + (size_t)h * r;
    float sum = 0.0f;
    for (int k = lane; k < r / 8; k += 32) {
        uint4 w8 = w[k];
        const float* x8 = x + 8 * k;
        sum += F::lo(w8.x) * x8[0] + F::hi(w8.x) * x8[1] + F::lo(w8.y) * x8[2] + F::hi(w8.y) * x8[3]
             + F::lo(w8.z) * x8[4] + F::hi(w8.z) * x8[5] + F::lo(w8.w) * x8[6] + F::hi(w8.w) * x8[7];
    }
    sum = warp_sum(sum);
    if (lane == 0) o[row] = sum;
}

// The entry points, one per weight dtype (F16: fp16 bits, BF16: bf16 bits); mla_combine has no weights.
// grid (1), block (256)
extern "C" __global__ void mla_kv_append_f16(const float* kv, const float* gain, int has_norm, float eps, int r, int rope,
        const int* pos, const float* inv_freq, float rope_gain, int interleave, u16* cache) {
    mla_kv_append<F16>(kv, gain, has_norm, eps, r, rope, pos, inv_freq, rope_gain, interleave, cache);
}
extern "C" __global__ void mla_kv_append_bf16(const float* kv, const float* gain, int has_norm, float eps, int r, int rope,
        const int* pos, const float* inv_freq, float rope_gain, int interleave, u16* cache) {
    mla_kv_append<BF16>(kv, gain, has_norm, eps, r, rope, pos, inv_freq, rope_gain, interleave, cache);
}
// grid (H, ceil(r / 256)), block (256)
extern "C" __global__ void mla_q_absorb_f16(const float* q, const u16* wkv_b, int nope, int rope, int v, int r,
        const int* pos, const float* inv_freq, float rope_gain, int interleave, float* q_cat) {
    mla_q_absorb<F16>(q, wkv_b, nope, rope, v, r, pos, inv_freq, rope_gain, interleave, q_cat);
}
extern "C" __global__ void mla_q_absorb_bf16(const float* q, const u16* wkv_b, int nope, int rope, int v, int r,
        const int* pos, const float* inv_freq, float rope_gain, int interleave, float* q_cat) {
    mla_q_absorb<BF16>(q, wkv_b, nope, rope, v, r, pos, inv_freq, rope_gain, interleave, q_cat);
}
// grid (ceil(H / MLA_HEADS), S), block (32 * MLA_HEADS): 512 threads, so at most 128 registers (nvcc sm_90: 90)
extern "C" __global__ void mla_attention_f16(const float* q_cat, const u16* cache, int H, int r, int W, const int* pos,
        float scale, float* part_m, float* part_l, float* part_acc) {
    mla_attention<F16>(q_cat, cache, H, r, W, pos, scale, part_m, part_l, part_acc);
}
extern "C" __global__ void mla_attention_bf16(const float* q_cat, const u16* cache, int H, int r, int W, const int* pos,
        float scale, float* part_m, float* part_l, float* part_acc) {
    mla_attention<BF16>(q_cat, cache, H, r, W, pos, scale, part_m, part_l, part_acc);
}
// grid (ceil(H * v / 8)), block (256)
extern "C" __global__ void mla_v_up_f16(const float* o_lat, const u16* wkv_b, int H, int nope, int v, int r, float* o) {
    mla_v_up<F16>(o_lat, wkv_b, H, nope, v, r, o);
}
extern "C" __global__ void mla_v_up_bf16(const float* o_lat, const u16* wkv_b, int H, int nope, int v, int r, float* o) {
    mla_v_up<BF16>(o_lat, wkv_b, H, nope, v, r, o);
}
