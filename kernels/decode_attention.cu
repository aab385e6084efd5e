// decode_attention.cu: softmax(q·Kᵀ/√hd + mask)·V for new queries against the KV cache (flash-decoding).
//
// CPU reference: minillm.model.attention.attend (GQA: query head h reads KV head h / (n_heads / n_kv_heads)).
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
// v3 (attention_gqa{1,2,4}_*, the decode step's kernel): one block per (KV head, split) that serves the
// whole GQA group, the number of splits chosen at run time, the combine fused and parallel. See below.
// v2 (attention_fused_*): v1 with the combine folded into the split kernel's last block per (t, h)
// (threadfence + counter), one launch instead of two.
// v1 (attention_split, the device function below; its two-launch kernels, the splits and then a combine, are
// the laboratory's: minillm/cuda/dev/kernels/attention_v1.cu): block = 4 warps per (head, split, query); each
// warp takes every 4th key of the split,
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
    for (int i = 0; i < n_splits; i++) {                 // v1's separate combine's arithmetic, in its order
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


// ---- v3: a block per (KV head, split) for the whole GQA group; adaptive splits; a parallel combine ---------
//
// What v2 cost on the H200 (Mistral-7B, 144 keys, in a CUDA graph): 14.5 µs a layer for 0.6 MB of K/V
// (0.15 µs of HBM time). Three things made it slow, none of them bytes:
//  - 32 heads x 17 splits = 544 blocks of 4 warps, each for ~9 keys, and each of the 4 query heads of a
//    GQA group reading the same K/V rows again;
//  - the split count fixed by the capacity, not by the keys there are: at 144 keys most blocks did
//    almost nothing but still paid for q, the partials and a ticket;
//  - the fused combine read the n_splits partials with one serial L2 round trip after another
//    (volatile loads in three loops, ~50 dependent trips at 17 splits).
// v3 changes each:
//  - grid (n_kv_heads x ceil(group / GM), S, T): a block loads each K/V row of its split once and scores it
//    against up to GM = 4 query heads of the group (q of all of them in registers).
//  - The number of splits is decided in the kernel from the current length (a graph captured once stays
//    right as the sequence grows): n_splits = min(max_splits, ceil(n_keys / split_keys)), split_keys
//    defaulting to one tile (64 keys at hd 128). max_splits (the launcher) keeps the grid to one wave: a
//    block needs a whole SM's registers, and 17 splits x 8 KV heads = 136 blocks ran a second wave on 132
//    SMs (24.9 instead of 14.8 µs at 2048 keys, first version). Blocks past n_splits return at once. One
//    split: no partials, no ticket; the block writes the normalized output itself.
//  - The ticket: a barrier, then one thread's acquire-release atomic (a cooperative grid sync's pattern),
//    not a fence in every thread (measured the same: 7.6 vs 7.8 µs).
//    The combine loads every split's (m, l) at once (a warp per head: lanes over splits, warp max/sum),
//    then each output element sums the splits' acc with independent L2 loads (ld.global.cg, unrolled).
// Inside a block, thread = (slot, piece): a K/V row is hd/8 16-byte pieces (8 values), held by lpk lanes
// (hd/8 rounded up to a power of two), so a warp covers 32/lpk keys at once and the block 256/lpk. A
// tile is GQA_LOADS keys per slot; its K and V loads are issued a tile ahead (registers, double-buffered).
// A score is the slot's lpk partial dot products summed by xor shuffles, one stage at a time over all
// the tile's scores (every lane of the slot gets the same number). Each slot keeps its own online softmax
// (m, l, acc over its 8 dims) per head, in registers, in log2 units (exp2f): no barrier in the key loop.
// At the end the slots merge, first inside the warp (shuffles), then the 8 warps through shared memory.
// All arithmetic is fp32, as in v1/v2.
// Needs hd % 8 == 0 (16-byte pieces) and hd <= MAX_HD; the launcher falls back to v2 otherwise.
//
// Measured (H200, 2026-11-29; Mistral-7B: 32 query / 8 KV heads, hd 128; µs a layer, 32 launches in a CUDA
// graph, each layer its own K/V; a trivial kernel costs 0.93 µs there):
//     keys                       144    640   2048   4096
//     v2 (17 splits a head)     15.4   23.7   43.5   71.8
//     v3                         7.6    8.4    9.6   11.9
//     v3, first version         10.8   11.6   14.8   21.3   (a shuffle loop per score, accurate expf:
//                                                            the tile's math ran serially, ~3 µs a tile)
//     v3, split_keys 128 / 256   8.5 / 7.0   9.9 / 10.9   9.6 / 10.7   11.9 / 11.9
//     v3, one split (no combine) 7.0   14.7   38.0   71.5   (~1 µs a tile in sequence)
// Decode: 256.6 tok/s with v3, 244.4 with v2, same run (qbench). Still ~7 µs over the bytes: the chain
// pos -> K/V loads -> a tile's math (~1 µs: 4 heads x 4 keys x 8 dims x (K and V) FMAs a thread) -> merges
// -> partials -> ticket -> the combine's two L2 round trips, one block per SM.
#define GQA_THREADS 256
#define GQA_WARPS (GQA_THREADS / 32)
#define GQA_LOADS 4          // K (and V) 16-byte loads in flight per thread per tile
#define GQA_MAX_SPLITS 64    // the combine's lanes: two splits per lane

// A 16-byte load that skips L1 (K/V rows are read once per launch).
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// A load from L2, never from a possibly stale L1 line: the combine reads other blocks' partials with it.
// volatile keeps it after the fence that precedes it; the loads themselves still overlap.
__device__ __forceinline__ float ld_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// 4 int8 codes (one word, code 0 in the low byte) -> fp32, sign-extended by shifts. (Measured the same:
// gemv_quant.cu's byte-permute trick, which avoids the I2F conversion unit: 194.9 vs 193.0 tok/s at 32k keys.)
__device__ __forceinline__ void widen_codes(unsigned int w, float* f) {
#pragma unroll
    for (int k = 0; k < 4; k++) f[k] = (float)((int)(w << (24 - 8 * k)) >> 24);
}

// 8 16-bit values (one 16-byte piece) -> fp32
template <class W>
__device__ __forceinline__ void widen8(uint4 w, float* f) {
    f[0] = W::lo(w.x); f[1] = W::hi(w.x); f[2] = W::lo(w.y); f[3] = W::hi(w.y);
    f[4] = W::lo(w.z); f[5] = W::hi(w.z); f[6] = W::lo(w.w); f[7] = W::hi(w.w);
}

// How the cache holds a "piece" (VALS consecutive values of a K or V row, one lane's share of a key), how
// it becomes VALS floats, and how many pieces a lane keeps in flight (LOADS, for K and again for V).
// KV16<W>: the weight dtype, 8 values in 16 bytes. KV8: int8 codes, 8 values in 8 bytes, and one fp32 scale
// per (KV head, position) vector (kv_int8.cu writes them: value = code · scale). The scale is applied once
// per key, not per value: a score is (q·k8)·k_scale, and a probability p weighs v8 by p·v_scale.
// KV8x16: the same codes, 16 to a lane (16 bytes), for hd % 16 == 0. Why: a key's fixed work (the scores'
// shuffle stages, exp2, the mask, the scales) is done by each of its lanes, and with int8's half-size pieces
// that work, not the bytes, sets the pace. Measured (H200, Mistral-7B shape, fp16 weights, 32k keys, decode
// tok/s): 16-bit cache 192.7, KV8 184.8 (0.96x; twice KV8's loads in flight, or widening without I2F: the
// same), KV8x16 193.0 (1.00x). What is left is arithmetic: every cached value costs GM fp32 FMAs whatever
// its bytes, so at half the bytes a key the instructions, not the memory, set int8's time (at 32k keys it
// streams its cache at ~2.1 TB/s where the 16-bit cache reaches ~3.7). Next: the products on the tensor
// cores (f16x2 FMAs would give up the fp32 accuracy the tests hold attention to).
template <class W>
struct KV16 {
    using Elem = u16;
    using Piece = uint4;
    static constexpr bool SCALED = false;
    static constexpr int VALS = 8, LOADS = GQA_LOADS;
    static __device__ __forceinline__ Piece load(const Elem* p) { return ld_nc_v4(p); }
    static __device__ __forceinline__ Piece zero() { return make_uint4(0u, 0u, 0u, 0u); }
    static __device__ __forceinline__ void widen(Piece w, float* f) { widen8<W>(w, f); }
};

struct KV8 {
    using Elem = signed char;
    using Piece = uint2;
    static constexpr bool SCALED = true;
    static constexpr int VALS = 8, LOADS = GQA_LOADS;
    static __device__ __forceinline__ Piece load(const Elem* p) {
        uint2 v;
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
        return v;
    }
    static __device__ __forceinline__ Piece zero() { return make_uint2(0u, 0u); }
    static __device__ __forceinline__ void widen(Piece w, float* f) { widen_codes(w.x, f); widen_codes(w.y, f + 4); }
};

struct KV8x16 {
    using Elem = signed char;
    using Piece = uint4;
    static constexpr bool SCALED = true;
    static constexpr int VALS = 16, LOADS = GQA_LOADS / 2;   // KV8's bytes in flight (4 loads: the same speed)
    static __device__ __forceinline__ Piece load(const Elem* p) { return ld_nc_v4(p); }
    static __device__ __forceinline__ Piece zero() { return make_uint4(0u, 0u, 0u, 0u); }
    static __device__ __forceinline__ void widen(Piece w, float* f) {
        widen_codes(w.x, f); widen_codes(w.y, f + 4); widen_codes(w.z, f + 8); widen_codes(w.w, f + 12);
    }
};

// A tile's K and V rows for this thread (slot, piece): keys t0 + i * slots + slot, zeros past `end`; with
// KV8 also the keys' scales (ks, vs; 0 past `end`, unused for 16-bit caches).
template <class KV>
__device__ __forceinline__ void load_tile(const typename KV::Elem* K, const typename KV::Elem* V, const float* KS,
                                          const float* VS, int hd, int t0, int end, int slots, int slot, bool active,
                                          typename KV::Piece* kw, typename KV::Piece* vw, float* ks, float* vs) {
#pragma unroll
    for (int i = 0; i < KV::LOADS; i++) {
        int j = t0 + i * slots + slot;
        kw[i] = vw[i] = KV::zero();
        ks[i] = vs[i] = 0.0f;
        if (active && j < end) {
            kw[i] = KV::load(K + (size_t)j * hd);
            vw[i] = KV::load(V + (size_t)j * hd);
            if (KV::SCALED) {
                ks[i] = __ldg(KS + j);
                vs[i] = __ldg(VS + j);
            }
        }
    }
}

// Lanes a key's K (or V) row is spread over: its pieces (hd / KV::VALS) rounded up to a power of 2.
template <class KV>
__device__ __forceinline__ int lanes_per_key(int hd) {
    int pieces = hd / KV::VALS, lpk = 1;
    while (lpk < pieces) lpk <<= 1;
    return lpk;
}

// Split s of a query at position p whose keys start at lo: how many splits the length asks for (n_splits,
// at most max_splits and the scratch's part_splits), and split s's keys [start, end) (end <= start: an empty
// split, which adds nothing). false: split s does not run.
template <class KV>
__device__ __forceinline__ bool split_of(int hd, int p, int lo, int split_keys, int max_splits, int part_splits,
                                         int s, int& n_splits, int& start, int& end) {
    int tile = KV::LOADS * (GQA_THREADS / lanes_per_key<KV>(hd));
    int want = split_keys > 0 ? split_keys : tile, n_keys = p + 1 - lo;
    n_splits = min(min(max_splits, part_splits), (n_keys + want - 1) / want);
    if (s >= n_splits) return false;
    int chunk = (n_keys + n_splits - 1) / n_splits;
    start = lo + s * chunk;
    end = min(p + 1, start + chunk);
    return true;
}

template <class KV, int GM>
__device__ void attention_gqa(const float* __restrict__ q, int q_stride, const typename KV::Elem* __restrict__ k_cache,
                              const typename KV::Elem* __restrict__ v_cache, const float* __restrict__ k_scale,
                              const float* __restrict__ v_scale, int capacity, int n_heads, int n_kv_heads, int hd,
                              const int* pos, int window, float scale, int split_keys, int max_splits,
                              float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                              unsigned int* __restrict__ counters, float* __restrict__ out) {
    __shared__ float sm_m[GQA_WARPS][GM], sm_l[GQA_WARPS][GM];
    __shared__ float sm_acc[GQA_WARPS][GM][MAX_HD];
    __shared__ float sm_w[GM][GQA_MAX_SPLITS];
    __shared__ unsigned int ticket;

    // which heads, which keys
    int group = n_heads / n_kv_heads;
    int chunks = (group + GM - 1) / GM;                 // blocks per KV head (GM query heads each)
    int kvh = blockIdx.x / chunks, c = blockIdx.x - kvh * chunks;
    int h0 = kvh * group + c * GM;                      // first query head of this block
    int gn = min(GM, group - c * GM);                   // how many it serves
    int s = blockIdx.y, t = blockIdx.z, part_splits = gridDim.y;     // the scratch's split stride
    int p = pos[0] + t;
    int lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;

    constexpr int VALS = KV::VALS;
    int pieces = hd / VALS;                             // pieces per K/V row
    int lpk = lanes_per_key<KV>(hd);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int piece = tid & (lpk - 1), slot = tid / lpk, slots = GQA_THREADS / lpk;
    bool active = piece < pieces;
    int tile = KV::LOADS * slots;                       // keys per tile (64 at hd 128)

    int n_splits, start, end;
    if (!split_of<KV>(hd, p, lo, split_keys, max_splits, part_splits, s, n_splits, start, end))
        return;                                         // block-uniform: a short context needs fewer splits

    // Scores in log2 units: q times 1/√hd times log2(e), so that every e^x below is a plain 2^x (exp2f, one
    // MUFU.EX2; expf's accurate path adds range checks and branches). m and the partials are in log2 units too.
    float qs = scale * 1.4426950408889634f;
    float qr[GM][VALS], m[GM], l[GM], acc[GM][VALS];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        const float4* qp = reinterpret_cast<const float4*>(q + (size_t)t * q_stride + (size_t)(h0 + g) * hd + piece * VALS);
#pragma unroll
        for (int e = 0; e < VALS; e += 4) {
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (g < gn && active) a = qp[e / 4];
            qr[g][e] = a.x * qs; qr[g][e + 1] = a.y * qs; qr[g][e + 2] = a.z * qs; qr[g][e + 3] = a.w * qs;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < VALS; e++) acc[g][e] = 0.0f;
    }

    const typename KV::Elem* K = k_cache + (size_t)kvh * capacity * hd + piece * VALS;
    const typename KV::Elem* V = v_cache + (size_t)kvh * capacity * hd + piece * VALS;
    const float* KS = KV::SCALED ? k_scale + (size_t)kvh * capacity : nullptr;    // [capacity] of this KV head
    const float* VS = KV::SCALED ? v_scale + (size_t)kvh * capacity : nullptr;
    typename KV::Piece kw[KV::LOADS], vw[KV::LOADS];
    float ks[KV::LOADS], vs[KV::LOADS];
    load_tile<KV>(K, V, KS, VS, hd, start, end, slots, slot, active, kw, vw, ks, vs);
    for (int t0 = start; t0 < end; t0 += tile) {        // block-uniform
        typename KV::Piece kn[KV::LOADS], vn[KV::LOADS];   // the next tile's rows, in flight during this one's math
        float ksn[KV::LOADS], vsn[KV::LOADS];
        load_tile<KV>(K, V, KS, VS, hd, t0 + tile, end, slots, slot, active, kn, vn, ksn, vsn);
        float sc[KV::LOADS][GM];                        // scores, then probabilities
#pragma unroll
        for (int i = 0; i < KV::LOADS; i++) {
            float kf[VALS];
            KV::widen(kw[i], kf);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < VALS; e++) d = fmaf(qr[g][e], kf[e], d);
                sc[i][g] = KV::SCALED ? d * ks[i] : d;  // q·(k8·s) = (q·k8)·s: each lane's part, summed below
            }
        }
        // sum the slot's lpk partial dot products: one xor stage at a time over all KV::LOADS x GM scores, so
        // their shuffles are in flight together (a loop per score would wait on each shuffle in turn)
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            if (o < lpk) {                              // block-uniform
#pragma unroll
                for (int i = 0; i < KV::LOADS; i++)
#pragma unroll
                    for (int g = 0; g < GM; g++) sc[i][g] += __shfl_xor_sync(0xffffffffu, sc[i][g], o);
            }
        }
#pragma unroll
        for (int i = 0; i < KV::LOADS; i++)
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (t0 + i * slots + slot >= end) sc[i][g] = NEG_INF;   // past the split's keys
        float corr[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) {                  // online softmax over this tile's keys of the slot
            float mt = sc[0][g];
#pragma unroll
            for (int i = 1; i < KV::LOADS; i++) mt = fmaxf(mt, sc[i][g]);
            float mn = fmaxf(m[g], mt);
            bool none = mn == NEG_INF;                  // no key seen yet by this slot
            corr[g] = none ? 1.0f : exp2f(m[g] - mn);   // m = -inf before the first key: 2^-inf = 0
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < KV::LOADS; i++) {
                sc[i][g] = none ? 0.0f : exp2f(sc[i][g] - mn);  // a masked key: 2^-inf = 0
                sum += sc[i][g];
            }
            m[g] = mn;
            l[g] = l[g] * corr[g] + sum;
#pragma unroll
            for (int e = 0; e < VALS; e++) acc[g][e] *= corr[g];
        }
#pragma unroll
        for (int i = 0; i < KV::LOADS; i++) {
            float vf[VALS];
            KV::widen(vw[i], vf);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                float p = KV::SCALED ? sc[i][g] * vs[i] : sc[i][g];    // p·(v8·s): the scale once per key
#pragma unroll
                for (int e = 0; e < VALS; e++) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
            kw[i] = kn[i];
            vw[i] = vn[i];
            ks[i] = ksn[i];
            vs[i] = vsn[i];
        }
    }

    // merge the slots of a warp (lane and lane ^ o hold the same piece of different keys) ...
    for (int o = lpk; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GM; g++) {
            float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            float lo_ = __shfl_xor_sync(0xffffffffu, l[g], o);
            float M = fmaxf(m[g], mo);
            float wa = m[g] == NEG_INF ? 0.0f : exp2f(m[g] - M);
            float wb = mo == NEG_INF ? 0.0f : exp2f(mo - M);
            l[g] = l[g] * wa + lo_ * wb;
#pragma unroll
            for (int e = 0; e < VALS; e++) acc[g][e] = acc[g][e] * wa + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * wb;
            m[g] = M;
        }
    }
    // ... then the warps, through shared memory
    if (lane < lpk && active) {
#pragma unroll
        for (int g = 0; g < GM; g++) {
#pragma unroll
            for (int e = 0; e < VALS; e++) sm_acc[warp][g][piece * VALS + e] = acc[g][e];
            if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
        }
    }
    __syncthreads();

    bool one = n_splits == 1;
    for (int idx = tid; idx < gn * hd; idx += GQA_THREADS) {
        int g = idx / hd, d = idx - g * hd;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; w++) M = fmaxf(M, sm_m[w][g]);
        float L = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < GQA_WARPS; w++) {
            float wt = sm_m[w][g] == NEG_INF ? 0.0f : exp2f(sm_m[w][g] - M);  // an empty warp adds nothing
            L += sm_l[w][g] * wt;
            a += sm_acc[w][g][d] * wt;
        }
        size_t row = (size_t)t * n_heads + h0 + g;
        if (one) {
            out[row * hd + d] = a / L;                  // the only split: done, nothing to combine
        } else {
            size_t slot_ = row * part_splits + s;
            part_acc[slot_ * hd + d] = a;
            if (d == 0) { part_m[slot_] = M; part_l[slot_] = L; }
        }
    }
    if (one) return;

    // Fused combine: the last of the n_splits blocks of (t, KV head, chunk) merges them. The barrier orders
    // the block's partial writes before thread 0's ticket, a release (and acquire) at GPU scope: the
    // pattern of a cooperative grid sync, one fence for the block instead of v2's fence in every thread.
    unsigned int* counter = counters + (size_t)t * n_heads + blockIdx.x;
    __syncthreads();
    if (tid == 0)
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    __syncthreads();
    if (ticket != (unsigned int)(n_splits - 1)) return;
    if (warp < gn) {                                    // a warp per head: the splits' weights 2^(m_i - M) / L
        size_t base = ((size_t)t * n_heads + h0 + warp) * part_splits;
        float mi[2], li[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int i = lane + 32 * r;
            mi[r] = i < n_splits ? ld_l2(part_m + base + i) : NEG_INF;
            li[r] = i < n_splits ? ld_l2(part_l + base + i) : 0.0f;
        }
        float M = warp_max(fmaxf(mi[0], mi[1]));
        float wi[2];
#pragma unroll
        for (int r = 0; r < 2; r++) wi[r] = mi[r] == NEG_INF ? 0.0f : exp2f(mi[r] - M);
        float L = warp_sum(li[0] * wi[0] + li[1] * wi[1]);
#pragma unroll
        for (int r = 0; r < 2; r++) sm_w[warp][lane + 32 * r] = wi[r] / L;
    }
    __syncthreads();
    for (int idx = tid; idx < gn * hd; idx += GQA_THREADS) {
        int g = idx / hd, d = idx - g * hd;
        size_t row = (size_t)t * n_heads + h0 + g;
        const float* pa = part_acc + row * part_splits * hd + d;
        float a = 0.0f;
#pragma unroll 8
        for (int i = 0; i < n_splits; i++) a += sm_w[g][i] * ld_l2(pa + (size_t)i * hd);   // independent loads
        out[row * hd + d] = a;
    }
    if (tid == 0) *counter = 0u;                        // ready for the next launch (graph replay)
}

// grid (n_kv_heads * ceil(group / GM), max_splits, T), block (GQA_THREADS = 256); group = n_heads / n_kv_heads.
// v2's arguments with, before the scratch, split_keys (fewest keys per split; 0: one tile), max_splits (the
// most splits to use, <= gridDim.y: the launcher keeps the grid to one wave);
// part_m, part_l [T, n_heads, S], part_acc [T, n_heads, S, hd] fp32, S = gridDim.y <= 64,
// counters [T, n_heads] uint32 (0 before, 0 after), out [T, n_heads * hd] fp32. hd % 8 == 0, hd <= 256.
#define ATTENTION_GQA_KERNEL(NAME, W, GM)                                                                        \
    extern "C" __global__ void __launch_bounds__(GQA_THREADS, 1) NAME(                                           \
        const float* q, int q_stride, const u16* k_cache, const u16* v_cache, int capacity, int n_heads,         \
        int n_kv_heads, int hd, const int* pos, int window, float scale, int split_keys, int max_splits,         \
        float* part_m, float* part_l, float* part_acc, unsigned int* counters, float* out) {                    \
        pdl_wait_then_trigger();                                                                                 \
        attention_gqa<KV16<W>, GM>(q, q_stride, k_cache, v_cache, nullptr, nullptr, capacity, n_heads,          \
                                   n_kv_heads, hd, pos, window, scale, split_keys, max_splits, part_m,           \
                                   part_l, part_acc, counters, out);                                            \
    }
ATTENTION_GQA_KERNEL(attention_gqa1_f16, F16, 1)
ATTENTION_GQA_KERNEL(attention_gqa1_bf16, BF16, 1)
ATTENTION_GQA_KERNEL(attention_gqa2_f16, F16, 2)
ATTENTION_GQA_KERNEL(attention_gqa2_bf16, BF16, 2)
ATTENTION_GQA_KERNEL(attention_gqa4_f16, F16, 4)
ATTENTION_GQA_KERNEL(attention_gqa4_bf16, BF16, 4)

// The same over an int8 KV cache: k_cache, v_cache int8 [n_kv_heads, capacity, hd] (one layer), k_scale,
// v_scale fp32 [n_kv_heads, capacity]. Half the bytes a key of the 16-bit kernels, whatever the weights.
#define ATTENTION_GQA_INT8_KERNEL(NAME, KV, GM)                                                                  \
    extern "C" __global__ void __launch_bounds__(GQA_THREADS, 1) NAME(                                           \
        const float* q, int q_stride, const signed char* k_cache, const signed char* v_cache,                    \
        const float* k_scale, const float* v_scale, int capacity, int n_heads, int n_kv_heads, int hd,           \
        const int* pos, int window, float scale, int split_keys, int max_splits, float* part_m,                 \
        float* part_l, float* part_acc, unsigned int* counters, float* out) {                                   \
        pdl_wait_then_trigger();                                                                                 \
        attention_gqa<KV, GM>(q, q_stride, k_cache, v_cache, k_scale, v_scale, capacity, n_heads, n_kv_heads,  \
                               hd, pos, window, scale, split_keys, max_splits, part_m, part_l, part_acc,         \
                               counters, out);                                                                   \
    }
ATTENTION_GQA_INT8_KERNEL(attention_gqa1_int8, KV8, 1)
ATTENTION_GQA_INT8_KERNEL(attention_gqa2_int8, KV8, 2)
ATTENTION_GQA_INT8_KERNEL(attention_gqa4_int8, KV8, 4)
ATTENTION_GQA_INT8_KERNEL(attention_gqa1_int8x16, KV8x16, 1)     // hd % 16 == 0: 16 codes a lane
ATTENTION_GQA_INT8_KERNEL(attention_gqa2_int8x16, KV8x16, 2)
ATTENTION_GQA_INT8_KERNEL(attention_gqa4_int8x16, KV8x16, 4)
