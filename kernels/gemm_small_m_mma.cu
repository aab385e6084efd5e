// gemm_small_m_mma.cu: Y[t, r] = (accumulate ? Y[t, r] : 0) + sum_k W[r, k] · X[t, k] for t < T <= 64 rows,
// on the tensor cores. W: [rows, in] fp16/bf16 (HF layout), X: [T, in] of the same 16-bit type, Y: [T, rows] fp32.
//
// The serving engine's decode step multiplies each weight by the B <= 64 new tokens of the batch. At 64 rows a
// weight byte still serves only 64 multiply-adds, so the product is a weight stream, as at batch 1: the measure
// is the fraction of copy bandwidth it reaches. cuBLAS (and torch, the same library) stream Mistral-7B's four
// matrices at 2.0-2.5 TB/s for 8-64 rows on the H200 (50-60% of copy): its tiles are shaped for large
// products. gemm_small_m.cu (v1) does it with fp32 FMAs and is issue-bound from 3 rows on. Here:
//
//   block:   GM_WARPS = 4 warps, GM_ROWS = 128 rows of W (32 a warp: two m16 tiles) x every row of X (up to
//            8 n8 tiles) x a slice of the k range. W is mma's A (16 rows x 16 k, row-major as stored); X is B
//            ("col" layout: B[k][t] = X[t][k], k contiguous: X's own rows), so both come from shared memory by
//            plain ldmatrix. A warp's step of 16 k: 2 A + 4 B ldmatrix.x4, 16 mma; accumulators 2 x 8 x 4 fp32.
//   stream:  the k range goes through shared memory in stages of GM_BK = 64 columns (W 16 KB + X 8 KB a
//            stage), GM_STAGES = 4 stages by cp.async.cg (global -> shared, past L1): three stages (48 KB of
//            W) in flight while the warps work on the fourth; two blocks fit on an SM (96 KB each), ~96 KB
//            in flight an SM, what HBM's latency needs to run near its peak. Rows of a stage are 128 bytes,
//            their 16-byte chunks XOR-swizzled by row (chunk c of row r at c ^ (r & 7)), so the 8 rows an
//            ldmatrix phase reads sit in 8 different bank groups.
//   split-k: a matrix with few rows (Mistral's o: 4096 rows, 32 row tiles) would fill a quarter of the 132
//            SMs; S blocks then share a row tile, each a contiguous slice of the k range, as one thread block
//            cluster (sm_90, S a compile-time cluster size: gemm_mma_s{S}). Their partial sums meet in
//            shared memory: after a cluster barrier, block q of the cluster adds the S partials of its
//            1/S of the tile, reading its peers' shared memory (DSMEM) in rank order 0..S-1, so the sum's
//            order is fixed: deterministic, graph replays bit-identical, no atomics, no workspace, no extra
//            launch. A second barrier keeps every block alive until its peers have read it.
//   epilogue: partials [T][GM_ROWS + 4] fp32 in shared memory (the pipeline's space, reused; + 4: conflict-
//            free stores), then coalesced stores along r, added to Y when accumulating (the residual).
// Rows of X past T and of W past `rows`, and columns past `in`, are zero-filled in shared memory (never
// read from global memory). Requires in % 8 == 0 and T <= 64 (the launcher checks, gemm_rows.py).
// Precision: the products of 16-bit values are exact, the sums fp32 (the tensor cores' accumulation, then
// the cluster's S partials), as cuBLAS's fp32-accumulating GEMM the engine uses otherwise.
#include "common.cuh"
#include "mma.cuh"

// GM_WARPS, GM_BK and GM_STAGES may be given at compile time (gemm_mma.py's variants, to measure others)
#ifndef GM_WARPS
#define GM_WARPS 4
#endif
#ifndef GM_BK
#define GM_BK 64                              // k columns a stage (a multiple of 64)
#endif
#ifndef GM_STAGES
#define GM_STAGES 4
#endif
#ifndef GM_TW
#define GM_TW 1                               // warps along X's rows: each takes 8 / GM_TW of the n8 tiles
#endif
#define GM_ROWS (32 * GM_WARPS)               // W rows a block (GM_WARPS warps along W's rows)
#define GM_THREADS (32 * GM_WARPS * GM_TW)
#define GM_NJ (8 / GM_TW)                     // n8 tiles a warp
#define GM_CHUNKS (GM_BK / 8)                 // 16-byte chunks in a row of a stage
#define GM_MAX_T 64                           // X rows: 8 n8 tiles
#define GM_W_STAGE (GM_ROWS * GM_BK)          // 16-bit values
#define GM_X_STAGE (GM_MAX_T * GM_BK)
#define GM_RED_STRIDE (GM_ROWS + 4)           // floats between the partials' rows
// dynamic shared memory: GM_STAGES x (W + X) stages = 96 KB (the partials, 64 x 132 x 4 B = 33 KB, reuse it)
#define GM_SMEM_BYTES (GM_STAGES * (GM_W_STAGE + GM_X_STAGE) * 2)

// ---- thread block clusters (sm_90) ----------------------------------------------------------------------
__device__ __forceinline__ void cluster_sync() {      // every thread of every block of the cluster; orders memory
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 peer_address(u32 own, u32 rank) {   // the same shared variable in block `rank`
    u32 r;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(own), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_peer(u32 address) {   // not volatile: after the barrier the data stays put,
    float v;                                              // so the S loads of a sum may be issued together
    asm("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(address));
    return v;
}

// where chunk c (16 bytes) of row r of a stage lives: rows are GM_BK values, chunks swizzled by row
__device__ __forceinline__ int swizzled(int r, int c) { return r * GM_BK + ((c ^ (r & 7)) << 3); }

// One stage: W rows [r0, r0 + GM_ROWS) and X rows [0, 8 nt) at columns [k0, k0 + GM_BK), zero past the edges.
__device__ __forceinline__ void load_stage(u16* ws, u16* xs, const u16* __restrict__ w, const u16* __restrict__ x,
                                           int r0, int k0, int rows, int in, int T, int nt) {
    for (int i = threadIdx.x; i < GM_ROWS * GM_CHUNKS; i += GM_THREADS) {
        int r = i / GM_CHUNKS, c = i % GM_CHUNKS, gr = r0 + r, gk = k0 + 8 * c;
        bool ok = gr < rows && gk < in;
        cp_async16(smem_u32(ws + swizzled(r, c)), w + (ok ? (size_t)gr * in + gk : 0), ok);
    }
    for (int i = threadIdx.x; i < 8 * nt * GM_CHUNKS; i += GM_THREADS) {
        int t = i / GM_CHUNKS, c = i % GM_CHUNKS, gk = k0 + 8 * c;
        bool ok = t < T && gk < in;
        cp_async16(smem_u32(xs + swizzled(t, c)), x + (ok ? (size_t)t * in + gk : 0), ok);
    }
}

// A warp's product of one stage: its 32 W rows x its n8 tiles of X (j0 .. j0 + GM_NJ - 1, those < nt), 4 k-steps of 16.
template <class W>
__device__ __forceinline__ void mma_stage(float (&acc)[2][GM_NJ][4], const u16* ws, const u16* xs, int warp, int lane,
                                          int j0, int nt) {
#pragma unroll
    for (int kk = 0; kk < GM_BK / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m) {       // lanes 0-15: rows 0-15 at k 0-7; lanes 16-31: the same rows at k 8-15
            int r = 32 * warp + 16 * m + (lane & 15);
            ldmatrix_x4(a[m], smem_u32(ws + swizzled(r, 2 * kk + (lane >> 4))));
        }
#pragma unroll
        for (int jp = 0; jp < GM_NJ / 2; ++jp) {   // n tiles 2jp, 2jp + 1: matrices (2jp, k 0-7), (2jp, k 8-15), (2jp+1, ...)
            if (j0 + 2 * jp < nt) {
                u32 b[4];
                int t = 8 * (j0 + 2 * jp) + (lane & 7) + 8 * (lane >> 4);
                ldmatrix_x4(b, smem_u32(xs + swizzled(t, 2 * kk + ((lane >> 3) & 1))));
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    Mma<W>::mma(acc[m][2 * jp], a[m], b[0], b[1]);
                    if (j0 + 2 * jp + 1 < nt) Mma<W>::mma(acc[m][2 * jp + 1], a[m], b[2], b[3]);
                }
            }
        }
    }
}

template <class W, int S>
__device__ void gemm_small_m_mma(const u16* __restrict__ w, const u16* __restrict__ x, float* __restrict__ y,
                                 int rows, int in, int T, int accumulate) {
    extern __shared__ uint4 smem4[];
    u16* smem = reinterpret_cast<u16*>(smem4);
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % GM_WARPS, j0 = (threadIdx.x >> 5) / GM_WARPS * GM_NJ;
    const int split = S > 1 ? (int)cluster_rank() : 0;            // = blockIdx.x % S: a cluster is S blocks in x
    const int r0 = (blockIdx.x / S) * GM_ROWS;
    const int k_tiles = (in + GM_BK - 1) / GM_BK;
    const int kt0 = split * k_tiles / S, n_kt = (split + 1) * k_tiles / S - kt0;
    const int nt = (T + 7) >> 3;

    float acc[2][GM_NJ][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < GM_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.0f;

    auto stage_w = [&](int s) { return smem + s * (GM_W_STAGE + GM_X_STAGE); };
#pragma unroll
    for (int s = 0; s < GM_STAGES - 1; ++s) {                    // the first stages in flight
        if (s < n_kt) load_stage(stage_w(s), stage_w(s) + GM_W_STAGE, w, x, r0, (kt0 + s) * GM_BK, rows, in, T, nt);
        cp_async_commit();
    }
    for (int i = 0; i < n_kt; ++i) {
        cp_async_wait<GM_STAGES - 2>();         // stage i has landed (for this thread's copies) ...
        __syncthreads();                        // ... and everyone's; and everyone is done with stage i - 1
        int next = i + GM_STAGES - 1;           // refill the stage consumed in step i - 1
        if (next < n_kt) {
            u16* ws = stage_w(next % GM_STAGES);
            load_stage(ws, ws + GM_W_STAGE, w, x, r0, (kt0 + next) * GM_BK, rows, in, T, nt);
        }
        cp_async_commit();
        const u16* ws = stage_w(i % GM_STAGES);
        mma_stage<W>(acc, ws, ws + GM_W_STAGE, warp, lane, j0, nt);
    }
    cp_async_wait<0>();
    __syncthreads();                            // the stages are free: the partials take their place

    // partials [8 nt][GM_RED_STRIDE]: d0, d1 are W row g, X rows 2q, 2q + 1 of the n tile; d2, d3 row g + 8
    float* red = reinterpret_cast<float*>(smem);
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < GM_NJ; ++j) {
            if (j0 + j < nt) {
                int r = 32 * warp + 16 * m + g, t = 8 * (j0 + j) + 2 * q;
                red[t * GM_RED_STRIDE + r] = acc[m][j][0];
                red[(t + 1) * GM_RED_STRIDE + r] = acc[m][j][1];
                red[t * GM_RED_STRIDE + r + 8] = acc[m][j][2];
                red[(t + 1) * GM_RED_STRIDE + r + 8] = acc[m][j][3];
            }
        }
    if (S > 1) cluster_sync(); else __syncthreads();

    // block `split` finishes X rows [split T / S, (split + 1) T / S) of the tile, summing the S partials in rank order
    const int t_lo = split * T / S, t_hi = (split + 1) * T / S;
    for (int i = threadIdx.x; i < (t_hi - t_lo) * GM_ROWS; i += GM_THREADS) {
        int t = t_lo + i / GM_ROWS, r = i % GM_ROWS;
        float* own = red + t * GM_RED_STRIDE + r;
        float sum;
        if (S > 1) {
            u32 a = smem_u32(own);
            sum = ld_peer(peer_address(a, 0));
            for (int p = 1; p < S; ++p) sum += ld_peer(peer_address(a, p));
        } else {
            sum = *own;
        }
        if (r0 + r < rows) {
            float* out = y + (size_t)t * rows + r0 + r;
            *out = accumulate ? *out + sum : sum;
        }
    }
    if (S > 1) cluster_sync();                  // no block leaves while a peer may still read its partials
}

#define GEMM_MMA_KERNEL(name, W, S)                                                                            \
    extern "C" __global__ void __cluster_dims__(S, 1, 1) __launch_bounds__(GM_THREADS)                     \
    name(const u16* w, const u16* x, float* y, int rows, int in, int T, int accumulate) {                      \
        gemm_small_m_mma<W, S>(w, x, y, rows, in, T, accumulate);                                              \
    }
GEMM_MMA_KERNEL(gemm_mma_s1_f16, F16, 1)
GEMM_MMA_KERNEL(gemm_mma_s2_f16, F16, 2)
GEMM_MMA_KERNEL(gemm_mma_s4_f16, F16, 4)
GEMM_MMA_KERNEL(gemm_mma_s8_f16, F16, 8)
GEMM_MMA_KERNEL(gemm_mma_s1_bf16, BF16, 1)
GEMM_MMA_KERNEL(gemm_mma_s2_bf16, BF16, 2)
GEMM_MMA_KERNEL(gemm_mma_s4_bf16, BF16, 4)
GEMM_MMA_KERNEL(gemm_mma_s8_bf16, BF16, 8)
