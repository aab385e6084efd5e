// gemv_quant_tma.cu: v4 of the quantized decode GEMV (v2: gemv_quant.cu, v3: gemv_quant_mma.cu): the weights
// stream into shared memory by the Hopper bulk copy engine (TMA), several stages ahead of the arithmetic.
//
// Same weights, arguments (plus three: lanes a row, pairs a stage, stages) and epilogues as v2; the same
// arithmetic per 16-byte chunk (quant_dot.cuh: codes -> exact fp16 pairs, HFMA2 with x scaled by a power
// of two a chunk, one fp32 widening a chunk), so v2's precision argument holds as it is. What changes is
// where the bytes wait. v2 keeps its loads in registers: 4 KB a warp in flight, then the arithmetic, then
// the next loads, 4-7 such dependent steps a row pair on the large matrices, every block first staging x
// (ncu, H200: DRAM 36-57% busy on down, warps waiting on global loads 43-62% of the time). Here:
//
//  - One producer warp a block issues bulk copies (cp.async.bulk, global -> shared, completion counted in
//    bytes on an mbarrier) of whole rows into a ring of `n_stages` stages, each stage P row pairs (2P rows,
//    one copy a row by one lane; int4 also copies each row's fp16 scales and mins). It refills a stage as
//    soon as the consumers release it, so ~100 KB a block (two blocks an SM) is always on its way, with no
//    registers held and no instruction of the consumers spent on it. It starts before the kernel waits for
//    the previous one (programmatic dependent launch): weights never depend on an earlier kernel.
//  - Eight consumer warps hold x in registers, not shared memory: thread t owns chunks t % L, t % L + L, ...
//    (L = lanes a row, a power of two <= 256 chosen so a thread owns at most J_MAX chunks) of every row,
//    loaded and packed once at the start (no block-wide staging, no barrier before the first weight).
//    The 256 threads form 256 / L slots; slot s takes pairs s, s + S, ... of each stage.
//  - A thread's two partial sums (rows a and b) meet in one 5-shuffle butterfly (lanes 0-15 end with Σa,
//    16-31 with Σb), then the L / 32 warps of a slot add theirs in shared memory after one barrier of the
//    consumers a stage; thread j applies pair j's epilogue (v2's: plain, += residual, SwiGLU, RoPE + KV
//    append; the RMSNorm prologue's Σx² summed once by the consumers). Releasing each stage after its last
//    warp instead (a counter a stage, no barrier) measured slower on every matrix (lessons/BENCHMARKS.md).
//  - 16-bit weights (Wide16Tma) go through the same kernel: 8 weights a chunk, x in fp32 registers and
//    gemv.cu v4's fp32 FMAs (KernelSettings.wide_tma).
// The launcher (Kernels._quant, tma_plan in minillm/cuda/kernels.py) picks L, P and n_stages from the row's
// bytes, and falls back to v2 where this layout does not fit: rows wider than J_MAX chunks a thread at
// L = 256 (K > 16384), int4 groups whose per-row scales are not whole 16-byte copies (n_groups % 8).
#include "gemv_epilogue.cuh"
#include "quant_dot.cuh"

#define T_WARPS 8            // consumer warps a block; one more warp produces (block = 288 threads)
#define T_MAX_STAGES 16      // ring stages at most
#define T_MAX_PAIRS 16       // row pairs a stage at most (2 P rows: one producer lane each)
#define T_NAMED_BARRIER 1    // the consumers' own barrier (0 is __syncthreads')

// ---- sm_90 asynchronous copies and their barriers (PTX) -----------------------------------------------------
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// the producer's arrival, announcing the bytes its copies will complete on this phase
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// returns once the phase with this parity (0, 1, 0, ... for the barrier's 1st, 2nd, 3rd use) has completed
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned int parity) {
    asm volatile("{\n"
                 " .reg .pred done;\n"
                 "WAIT:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n"
                 "}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared, counted on bar when they land
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned int bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync %0, %1;" :: "n"(T_NAMED_BARRIER), "n"(32 * T_WARPS) : "memory");
}

// Σa over the warp to lanes 0-15 and Σb to lanes 16-31, in 5 shuffles (two warp_sums would take 10): the
// first exchange swaps halves, so each half goes on with one value
__device__ __forceinline__ float pair_sum(float a, float b) {
    bool upper = threadIdx.x & 16;
    float v = (upper ? b : a) + __shfl_xor_sync(0xffffffffu, upper ? a : b, 16);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- one stage in shared memory -------------------------------------------------------------------------
// rows 2j (pair j's row a) and 2j + 1 (row b), j < P: weights [2P][n_chunks] 16-byte chunks, then (int4)
// scales [2P][n_groups] fp16, then mins [2P][n_groups] fp16. A partial last stage keeps the same offsets.
struct Stage {
    const uint4* w;
    const u16* s;
    const u16* m;
};

__device__ __forceinline__ Stage stage_at(const unsigned char* base, int P, int n_chunks, int n_groups) {
    const u16* s = reinterpret_cast<const u16*>(base + (size_t)2 * P * n_chunks * 16);
    return Stage{reinterpret_cast<const uint4*>(base), s, s + 2 * P * n_groups};
}

// Pair j's two rows in a stage, a thread's share of them: f(u, c, ra, rb) for each chunk c = c_t + L·u of the
// row (u < J, c < n_chunks; ra, rb: the two rows' chunk c in the stage), the format's sums a and b zeroed first.
template <int J, class F>
__device__ __forceinline__ void each_chunk_of_pair(const Stage& st, int j, int n_chunks, int c_t, int L, float& a,
                                                   float& b, F f) {
    const uint4* wa = st.w + (size_t)(2 * j) * n_chunks;
    const uint4* wb = wa + n_chunks;
    a = 0.0f;
    b = 0.0f;
#pragma unroll
    for (int u = 0; u < J; u++) {
        int c = c_t + L * u;
        if (c < n_chunks) f(u, c, wa + c, wb + c);
    }
}

// ---- the formats: x as a thread holds it, and its share of one row pair -------------------------------------------
// Each format F has C (weights a 16-byte chunk), J_MAX (chunks of x a thread holds), X (those chunks in
// registers), load_x (fills X: chunk u of the thread is chunk c_t + L·u of x, zeros past the row; Σx² of
// them added to ss when count, NORM), dot (Σ over the thread's chunks of a stage's pair j, rows a and b) and
// row_scale (a factor of a whole row, applied after the sums: int8's scale).

// chunk c of x (times gain when NORM) -> v[C], zeros for a chunk past the row (c >= n_chunks); its Σx² added
// to ss when count: every format's load_x, for each chunk the thread owns
template <int C, bool NORM>
__device__ __forceinline__ void owned_x_chunk(const float* __restrict__ x, const float* __restrict__ gain, int in,
                                              int n_chunks, int c, bool count, float (&v)[C], float& ss) {
    float sq = 0.0f;
    if (c < n_chunks) load_x_chunk<C, NORM>(x, gain, in, c, (in & 3) == 0, v, sq);
    else {
#pragma unroll
        for (int i = 0; i < C; i++) v[i] = 0.0f;
    }
    if (count) ss += sq;
}

// the quantized formats: chunk u of x as C/8 uint4 of f16x2 words (quant_dot.cuh's order and scaling), 2^-e of
// it, and (int4) Σx of it in fp32
template <int C_, int J_, bool INT4_>
struct PackedTma {
    static constexpr int C = C_, J_MAX = J_;
    static constexpr bool INT4 = INT4_;
    struct X {
        uint4 w[J_MAX][C / 8];
        float down[J_MAX];
        float sum[J_MAX];
    };

    template <bool NORM>
    static __device__ __forceinline__ void load_x(const float* x, const float* gain, int in, int n_chunks, int c_t,
                                                  int L, bool count, X& xr, float& ss) {
#pragma unroll
        for (int u = 0; u < J_MAX; u++) {
            float v[C];
            owned_x_chunk<C, NORM>(x, gain, in, n_chunks, c_t + L * u, count, v, ss);
            xr.down[u] = pack_x_chunk<C, INT4>(v, xr.w[u]);
            xr.sum[u] = INT4 ? chunk_sum(v) : 0.0f;
        }
    }
};

struct Int8Tma : PackedTma<16, 4, false> {
    // Σ over the thread's chunks of pair j's two rows (row scales applied after the reductions)
    static __device__ __forceinline__ void dot(const Stage& st, int j, int n_chunks, int n_groups, int cpg,
                                               int cpg_shift, int c_t, int L, const X& x,
                                               float& a, float& b) {
        each_chunk_of_pair<J_MAX>(st, j, n_chunks, c_t, L, a, b, [&](int u, int, const uint4* ra, const uint4* rb) {
            uint4 va = *ra, vb = *rb, x0 = x.w[u][0], x1 = x.w[u][1];           // 16 values of x: 8 pairs
            unsigned int pa = 0u, pb = 0u;
            pa = dot4_i8_h2(va.x, x0.x, x0.y, pa); pb = dot4_i8_h2(vb.x, x0.x, x0.y, pb);
            pa = dot4_i8_h2(va.y, x0.z, x0.w, pa); pb = dot4_i8_h2(vb.y, x0.z, x0.w, pb);
            pa = dot4_i8_h2(va.z, x1.x, x1.y, pa); pb = dot4_i8_h2(vb.z, x1.x, x1.y, pb);
            pa = dot4_i8_h2(va.w, x1.z, x1.w, pa); pb = dot4_i8_h2(vb.w, x1.z, x1.w, pb);
            a = fmaf(f16x2_sum(pa), x.down[u], a);
            b = fmaf(f16x2_sum(pb), x.down[u], b);
        });
    }

    // the row scale (int8: one fp32 a row), read by the epilogue thread
    static __device__ __forceinline__ float row_scale(const void* scales, int r) {
        return static_cast<const float*>(scales)[r];
    }
};

struct Int4Tma : PackedTma<32, 2, true> {
    static __device__ __forceinline__ void dot(const Stage& st, int j, int n_chunks, int n_groups, int cpg,
                                               int cpg_shift, int c_t, int L, const X& x,
                                               float& a, float& b) {
        const u16* sa = st.s + (size_t)(2 * j) * n_groups;
        const u16* ma = st.m + (size_t)(2 * j) * n_groups;
        each_chunk_of_pair<J_MAX>(st, j, n_chunks, c_t, L, a, b, [&](int u, int c, const uint4* ra, const uint4* rb) {
            uint4 va = *ra, vb = *rb;
            int g = cpg_shift >= 0 ? c >> cpg_shift : c / cpg;              // the chunk's group
            float s_a = F16::to_float(sa[g]), m_a = F16::to_float(ma[g]);
            float s_b = F16::to_float(sa[n_groups + g]), m_b = F16::to_float(ma[n_groups + g]);
            unsigned int pa = 0u, pb = 0u;
            pa = dot8_i4_h2(va.x, x.w[u][0], pa); pb = dot8_i4_h2(vb.x, x.w[u][0], pb);
            pa = dot8_i4_h2(va.y, x.w[u][1], pa); pb = dot8_i4_h2(vb.y, x.w[u][1], pb);
            pa = dot8_i4_h2(va.z, x.w[u][2], pa); pb = dot8_i4_h2(vb.z, x.w[u][2], pb);
            pa = dot8_i4_h2(va.w, x.w[u][3], pa); pb = dot8_i4_h2(vb.w, x.w[u][3], pb);
            float X = x.sum[u], X8 = 8.0f * X;
            // s·(Σ(n - 8)·x + 8·Σx) + m·Σx, as v2
            a = fmaf(s_a, fmaf(f16x2_sum(pa), x.down[u], X8), fmaf(m_a, X, a));
            b = fmaf(s_b, fmaf(f16x2_sum(pb), x.down[u], X8), fmaf(m_b, X, b));
        });
    }

    static __device__ __forceinline__ float row_scale(const void*, int) { return 1.0f; }   // in the groups
};

// 16-bit weights (W: F16 or BF16, as gemv.cu v4): 8 a chunk, x in fp32 registers, fp32 FMAs (v4's arithmetic)
template <class W>
struct Wide16Tma {
    static constexpr int C = 8, J_MAX = 7;
    static constexpr bool INT4 = false;
    struct X { float4 v[J_MAX][2]; };

    template <bool NORM>
    static __device__ __forceinline__ void load_x(const float* x, const float* gain, int in, int n_chunks, int c_t,
                                                  int L, bool count, X& xr, float& ss) {
#pragma unroll
        for (int u = 0; u < J_MAX; u++) {
            float v[C];
            owned_x_chunk<C, NORM>(x, gain, in, n_chunks, c_t + L * u, count, v, ss);
            xr.v[u][0] = make_float4(v[0], v[1], v[2], v[3]);
            xr.v[u][1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    }

    static __device__ __forceinline__ float dot8(uint4 w, const float4 (&x)[2], float acc) {
        acc = fmaf(W::lo(w.x), x[0].x, acc); acc = fmaf(W::hi(w.x), x[0].y, acc);
        acc = fmaf(W::lo(w.y), x[0].z, acc); acc = fmaf(W::hi(w.y), x[0].w, acc);
        acc = fmaf(W::lo(w.z), x[1].x, acc); acc = fmaf(W::hi(w.z), x[1].y, acc);
        acc = fmaf(W::lo(w.w), x[1].z, acc); return fmaf(W::hi(w.w), x[1].w, acc);
    }

    static __device__ __forceinline__ void dot(const Stage& st, int j, int n_chunks, int n_groups, int cpg,
                                               int cpg_shift, int c_t, int L, const X& x, float& a, float& b) {
        each_chunk_of_pair<J_MAX>(st, j, n_chunks, c_t, L, a, b, [&](int u, int, const uint4* ra, const uint4* rb) {
            a = dot8(*ra, x.v[u], a);
            b = dot8(*rb, x.v[u], b);
        });
    }

    static __device__ __forceinline__ float row_scale(const void*, int) { return 1.0f; }
};

// ---- the producer: whole rows into the ring ---------------------------------------------------------------
template <class F, int EPI>
__device__ __forceinline__ void produce(const uint4* __restrict__ qw, const void* __restrict__ scales,
                                        const u16* __restrict__ mins, int n_chunks, int n_groups, int pairs,
                                        int rows, int hd, int P, int n_stages, unsigned char* ring,
                                        unsigned long long* full, unsigned long long* empty) {
    int lane = threadIdx.x & 31;
    unsigned int row_bytes = n_chunks * 16u, sm_bytes = F::INT4 ? n_groups * 2u : 0u;
    size_t stage_bytes = (size_t)2 * P * (row_bytes + 2 * sm_bytes);
    int tiles = (pairs + P - 1) / P;
    int k = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, k++) {
        int s = k % n_stages;
        if (k >= n_stages) mbar_wait(&empty[s], (unsigned int)(k / n_stages - 1) & 1u);   // released by all 8
        int p0 = tile * P, np = min(P, pairs - p0);
        if (lane == 0) mbar_arrive_expect_tx(&full[s], 2u * np * (row_bytes + 2 * sm_bytes));
        __syncwarp();
        RowPair r;
        if (lane < 2 * np && row_pair<EPI>(p0 + (lane >> 1), rows, hd, r)) {
            int row = (lane & 1) ? r.rb : r.ra;              // a PLAIN matrix's odd last row: its a row twice
            unsigned char* base = ring + s * stage_bytes;
            bulk_copy(base + (size_t)lane * row_bytes, qw + (size_t)row * n_chunks, row_bytes, &full[s]);
            if (F::INT4) {
                unsigned char* sc = base + (size_t)2 * P * row_bytes;
                bulk_copy(sc + (size_t)lane * sm_bytes, static_cast<const u16*>(scales) + (size_t)row * n_groups,
                          sm_bytes, &full[s]);
                bulk_copy(sc + (size_t)(2 * P + lane) * sm_bytes, mins + (size_t)row * n_groups, sm_bytes, &full[s]);
            }
        }
    }
}

// ---- the consumers: x into registers, then each stage's row pairs ---------------------------------------------
template <class F, class W, bool NORM, int EPI>
__device__ __forceinline__ void consume(const void* __restrict__ scales, int n_chunks, int n_groups, int cpg,
                                        int cpg_shift, const float* __restrict__ x, const float* __restrict__ gain,
                                        float eps, int in, int pairs, int rows, const Epilogue<W>& ep, int L, int P,
                                        int n_stages, const unsigned char* ring, unsigned long long* full,
                                        unsigned long long* empty) {
    __shared__ float red[2][T_MAX_PAIRS][T_WARPS][2];   // the warps' sums of a stage's pairs (two stages' worth)
    __shared__ float ss_part[T_WARPS];
    int t = threadIdx.x, lane = t & 31;
    int slot = t / L, c_t = t % L, S = (32 * T_WARPS) / L, ws = c_t >> 5, W_s = L >> 5;
    pdl_wait_then_trigger();                            // x is the previous kernel's output

    typename F::X xr;
    float ss = 0.0f;                                    // Σx² of slot 0's chunks: each chunk once
    F::template load_x<NORM>(x, gain, in, n_chunks, c_t, L, slot == 0, xr, ss);
    float inv_rms = 1.0f;
    if (NORM) {
        ss = warp_sum(ss);
        if (lane == 0) ss_part[t >> 5] = ss;
        consumers_sync();
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < T_WARPS; w++) total += ss_part[w];
        inv_rms = rsqrtf(total / (float)in + eps);
    }

    size_t stage_bytes = (size_t)2 * P * (n_chunks * 16 + (F::INT4 ? 4 * n_groups : 0));
    int tiles = (pairs + P - 1) / P;
    int k = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, k++) {
        int s = k % n_stages, p0 = tile * P, np = min(P, pairs - p0);
        RowPair r;                                      // thread t < np: the epilogue of pair t
        bool mine = t < np && row_pair<EPI>(p0 + t, rows, ep.hd, r);
        float scale_a = 1.0f, scale_b = 1.0f;
        if (mine) {                                     // loaded while the stage may still be landing
            scale_a = F::row_scale(scales, r.ra);
            scale_b = F::row_scale(scales, r.rb);
        }
        mbar_wait(&full[s], (unsigned int)(k / n_stages) & 1u);
        Stage st = stage_at(ring + s * stage_bytes, P, n_chunks, n_groups);
        for (int j = slot; j < np; j += S) {            // slot-uniform: whole warps
            float a, b;
            F::dot(st, j, n_chunks, n_groups, cpg, cpg_shift, c_t, L, xr, a, b);
            float v = pair_sum(a, b);
            if ((lane & 15) == 0) red[k & 1][j][ws][lane >> 4] = v;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);          // this warp is done reading the stage
        consumers_sync();                               // every warp's sums are in red
        if (mine) {
            float acc_a = 0.0f, acc_b = 0.0f;
            for (int w = 0; w < W_s; w++) {
                acc_a += red[k & 1][t][w][0];
                acc_b += red[k & 1][t][w][1];
            }
            ep.template store<EPI>(r, p0 + t, acc_a * scale_a * inv_rms, acc_b * scale_b * inv_rms);
        }
    }
}

template <class F, class W, bool NORM, int EPI>
__device__ __forceinline__ void gemv_quant_tma(const uint4* __restrict__ qw, const void* __restrict__ scales,
                                               const u16* __restrict__ mins, int n_chunks, int n_groups, int cpg,
                                               int cpg_shift, const float* __restrict__ x,
                                               const float* __restrict__ gain, float eps, int in, int pairs, int rows,
                                               const Epilogue<W>& ep, int L, int P,
                                               int n_stages) {
    extern __shared__ uint4 ring4[];                    // n_stages stages (Stage's layout)
    __shared__ unsigned long long full[T_MAX_STAGES], empty[T_MAX_STAGES];
    unsigned char* ring = reinterpret_cast<unsigned char*>(ring4);
    if (threadIdx.x == 0) {
        for (int s = 0; s < n_stages; s++) {
            mbar_init(&full[s], 1);                     // the producer's arrive.expect_tx (+ the copies' bytes)
            mbar_init(&empty[s], T_WARPS);              // one arrival a consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= 32 * T_WARPS)
        produce<F, EPI>(qw, scales, mins, n_chunks, n_groups, pairs, rows, ep.hd, P, n_stages, ring, full, empty);
    else
        consume<F, W, NORM, EPI>(scales, n_chunks, n_groups, cpg, cpg_shift, x, gain, eps, in, pairs, rows, ep, L, P,
                                 n_stages, ring, full, empty);
}

// grid (any; the launcher: ~2 blocks an SM), block 32 * (T_WARPS + 1) = 288, dynamic shared memory n_stages ·
// 2P · (n_chunks · 16 + (int4) 4 · n_groups) bytes. v2's arguments (gemv_quant.cu), then
//   L: lanes a row (32, 64, 128 or 256; n_chunks <= J_MAX · L), P: row pairs a stage (<= T_MAX_PAIRS),
//   n_stages: the ring's stages (2 .. T_MAX_STAGES). int4: n_groups % 8 == 0 (16-byte copies of scales).
#define GEMV_QUANT_TMA_KERNEL(NAME, F, W, NORM, EPI)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * (T_WARPS + 1), 2) NAME(                                    \
        const uint4* qw, const void* scales, const u16* mins, int n_chunks, int n_groups, int cpg, int cpg_shift,\
        const float* x, const float* gain, float eps, int in, int pairs, float* y, int rows, int accumulate,     \
        u16* k_cache, u16* v_cache, int capacity, const int* pos, const float* inv_freq, int n_heads,            \
        int n_kv_heads, int hd, int L, int P, int n_stages) {                                                   \
        Epilogue<W> ep{y, accumulate, k_cache, v_cache, capacity, pos, inv_freq, n_heads, n_kv_heads, hd};       \
        gemv_quant_tma<F, W, NORM, EPI>(qw, scales, mins, n_chunks, n_groups, cpg, cpg_shift, x, gain, eps, in, \
                                        pairs, rows, ep, L, P, n_stages);                                       \
    }
// 16-bit weights: the same signature (qw = the matrix as 16-byte chunks, n_chunks = in / 8, in % 8 == 0;
// scales, mins, n_groups, cpg unused), named after gemv.cu v4's variants with "tma" for "v4"
GEMV_QUANT_TMA_KERNEL(gemv_tma_f16, Wide16Tma<F16>, F16, false, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_tma_bf16, Wide16Tma<BF16>, BF16, false, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_tma_f16, Wide16Tma<F16>, F16, true, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_tma_bf16, Wide16Tma<BF16>, BF16, true, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_swiglu_tma_f16, Wide16Tma<F16>, F16, false, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_swiglu_tma_bf16, Wide16Tma<BF16>, BF16, false, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_swiglu_tma_f16, Wide16Tma<F16>, F16, true, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_swiglu_tma_bf16, Wide16Tma<BF16>, BF16, true, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_qkv_tma_f16, Wide16Tma<F16>, F16, false, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_qkv_tma_bf16, Wide16Tma<BF16>, BF16, false, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_qkv_tma_f16, Wide16Tma<F16>, F16, true, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_qkv_tma_bf16, Wide16Tma<BF16>, BF16, true, EPI_QKV)
// int8 / int4
GEMV_QUANT_TMA_KERNEL(gemv_int8_v4_f16, Int8Tma, F16, false, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_int8_v4_bf16, Int8Tma, BF16, false, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_int8_v4_f16, Int8Tma, F16, true, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_int8_v4_bf16, Int8Tma, BF16, true, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_swiglu_int8_v4_f16, Int8Tma, F16, false, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_swiglu_int8_v4_bf16, Int8Tma, BF16, false, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_swiglu_int8_v4_f16, Int8Tma, F16, true, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_swiglu_int8_v4_bf16, Int8Tma, BF16, true, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_qkv_int8_v4_f16, Int8Tma, F16, false, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_qkv_int8_v4_bf16, Int8Tma, BF16, false, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_qkv_int8_v4_f16, Int8Tma, F16, true, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_qkv_int8_v4_bf16, Int8Tma, BF16, true, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_int4_v4_f16, Int4Tma, F16, false, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_int4_v4_bf16, Int4Tma, BF16, false, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_int4_v4_f16, Int4Tma, F16, true, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_int4_v4_bf16, Int4Tma, BF16, true, EPI_PLAIN)
GEMV_QUANT_TMA_KERNEL(gemv_swiglu_int4_v4_f16, Int4Tma, F16, false, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_swiglu_int4_v4_bf16, Int4Tma, BF16, false, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_swiglu_int4_v4_f16, Int4Tma, F16, true, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_swiglu_int4_v4_bf16, Int4Tma, BF16, true, EPI_SWIGLU)
GEMV_QUANT_TMA_KERNEL(gemv_qkv_int4_v4_f16, Int4Tma, F16, false, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_qkv_int4_v4_bf16, Int4Tma, BF16, false, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_qkv_int4_v4_f16, Int4Tma, F16, true, EPI_QKV)
GEMV_QUANT_TMA_KERNEL(gemv_rmsnorm_qkv_int4_v4_bf16, Int4Tma, BF16, true, EPI_QKV)
