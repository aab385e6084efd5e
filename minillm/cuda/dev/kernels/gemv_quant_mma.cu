// gemv_quant_mma.cu: v3 of the quantized decode GEMV (gemv_quant.cu holds v1 and v2): the products on the
// tensor cores (mma.sync m16n8k16, fp16 x fp16 -> fp32) and each step's weight loads issued one step ahead.
//
// Same weights, same arguments, same epilogues as gemv_quant.cu v2 (one kernel signature; the layouts:
// int8 q [rows, in16] + fp32 row scales, int4 nibbles [rows, in/2] + fp16 scale/min per group of g). What
// it changes, and why (v2's comment says where v2 stands: 2.8-2.9 instructions a weight, issue-bound):
//
//  - A warp multiplies 16 rows at once: the mma's A (16 x 16, fp16) is 16 rows' codes widened by bit tricks
//    that cost 3 instructions per 4 int8 codes (XOR, two PRMT) or 5 per 8 int4 codes (four LOP3, a shift):
//    ~0.75 and ~0.6 a weight. B (16 x 8) holds x, the same x in all 8 columns (column 0 would do; the
//    copies are free and leave every lane holding its rows' sums). No per-weight FMA or widening at all.
//  - The codes are not centred: a byte under the fp16 exponent of 1024, its sign bit flipped, reads as
//    1152 + b; a low nibble reads 1024 + n, a high one 1024 + 16 n (x is staged divided by 16 there). The
//    offsets are Σ of x times constants, taken off in fp32 once a warp step (int8: 1152·Σx of the step's
//    chunks) or a 128-code quad (int4: Z = 1024·Σx_lo + 64·Σx_hi), sums of the very fp16 values the tensor
//    cores saw (in fp64 while staging), so they cancel to fp32 rounding. The subtraction v2 did per code
//    pair (HSUB2) is gone. int8's row scales are applied by each lane before the warps' sums are added.
//  - The k order inside an mma is free as long as x follows it. Lane l (group g = l / 4, t = l % 4) owns A
//    rows g and g + 8 and loads whole 16-byte chunks of those rows: chunk 4u + t of the step. Its 4 codes of
//    one mma are 4 consecutive bytes (int8) or 4 nibbles of one word (int4) of its own chunk, so B's rows
//    for lane t are x of that chunk, stored in shared memory in the matching order: conflict-free 16-byte
//    reads (int8 chunks of x are 32 bytes apart; int4's 64 bytes + 16 of padding).
//  - A tile is 8 row pairs (the v2 pairs of gemv_epilogue.cuh: rows ra of the 8 pairs are A rows 0-7, rows
//    rb A rows 8-15), so lane (g, t) ends holding both sums of pair g, and every v2 epilogue (plain,
//    += residual, SwiGLU, RoPE + KV append; RMSNorm prologue) is reused as it is.
//  - The 8 warps of a block split one tile's k range (warp w: steps w, w + 8, ...; a step is U sub-steps of
//    4 chunks, U = 2: 128 int8 or 256 int4 weights of each of the 16 rows), then add their sums in shared
//    memory (a fixed order: the result does not depend on the grid); the block loops over tiles (the grid:
//    a few blocks per SM), staging x once. A warp's loads of its next step, possibly in the next tile, are
//    issued before this step's mma (two register buffers): the load latency hides behind the arithmetic
//    and the block's barrier at each tile end.
//  - int4: one fresh accumulator per quad (4 chunks: 128 codes, a whole group for g % 128 == 0), folded in
//    fp32 as s·(D - Z) + m·Σx, by one lane per (row, quad): lane t takes row (t & 1 ? b : a) of quad t >> 1.
//    Groups of 32 or 64 would need a scale inside a quad: the launcher keeps v2 for those.
//  - x is scaled by one power of two per vector (its largest |value| to [2^14, 2^15)), not per chunk as v2:
//    the tensor cores accumulate in fp32, so there is no fp16 partial to keep in range, only x itself.
//
// Precision: the codes and products are exact; x is rounded to fp16 once (2^-11 relative, as v2); sums are
// fp32 (the tensor cores' accumulation, then fp32 adds once a step or a quad). v2 also rounded each HFMA2
// partial. The offsets make the fp32 sums larger than the result (~40x for int8, ~200x for int4's quad
// partials), which costs ~5-8 of fp32's 24 bits: still far under the fp16 rounding of x. The NumPy emulation
// with fp32 sums (minillm/cuda/dev/qmma.py) errs 1.3-2.5e-4 of the largest output at 4096 and 14336 wide
// (v2 measured 3-8e-4 on the H200; QUANT_TOL is 3e-3).
// Expected (not yet measured on a GPU): a warp step is 8 mma and, in the compiled PTX, 52 instructions
// (int8: 64 weights a lane) or 16 mma and 102 (int4: 128 codes a lane), ~0.8 a weight plus the loads and
// int4's fold, against v2's 2.8 / 2.9 in SASS; so the loads, not the issue slots, should set the time:
// gate_up/down near the copy roofline, qkv/o still with their launch + staging floor. minillm/cuda/dev/qmma.py
// checks and times it against v2, and holds the NumPy emulation of this data flow (the k order, the fragment
// placement, the bit tricks, the offsets, the fold), which tests/test_qmma_emulation.py runs on the CPU.
#include "gemv_epilogue.cuh"

#define M_WARPS 8            // warps a block, all on one tile's k range
// A warp step: U sub-steps (u) of 4 lanes (t) a row, 4 U chunks of each row (U = 2: the decode kernels;
// U = 4, plain y = W·x only, to measure whether more bytes in flight a warp pay for the registers)
#define M_X_TOP 14           // x scaled so that its largest |value| lies in [2^M_X_TOP, 2^(M_X_TOP + 1))

// ---- the tensor-core product and the code widening ------------------------------------------------------
// d += A·B, A 16 x 16 fp16 (a0: row g, k 2t..2t+1; a1: row g+8; a2: row g, k 2t+8..2t+9; a3: row g+8, k 2t+8..),
// B 16 x 8 fp16 (b0: k 2t..2t+1 of column g; b1: k 2t+8..2t+9), d 16 x 8 fp32 (d0, d1: row g, columns 2t,
// 2t+1; d2, d3: row g+8). The low half of each f16x2 is the lower k.
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (w & MASK) | (1024, 1024) in one LOP3 (gemv_quant.cu's and_or_1024, repeated: each .cu stands alone)
template <unsigned int MASK>
__device__ __forceinline__ unsigned int lop_1024(unsigned int w) {
    unsigned int d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "n"(MASK), "n"(0x64006400u));   // (a & b) | c
    return d;
}

__device__ __forceinline__ unsigned int pack_half2(float lo, float hi) {
    unsigned int d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));    // d.hi = first source
    return d;
}

__device__ __forceinline__ unsigned int word(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;              // j is a compile-time constant
}

// ---- staging x ------------------------------------------------------------------------------------------
// Largest |value| and Σ of squares over the block (every thread gets both)
__device__ __forceinline__ void block_max_sum(float& mx, float& ss) {
    __shared__ float part_mx[32], part_ss[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    if (lane == 0) { part_mx[warp] = mx; part_ss[warp] = ss; }
    __syncthreads();
    mx = 0.0f;
    ss = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) { mx = fmaxf(mx, part_mx[w]); ss += part_ss[w]; }
    __syncthreads();                                     // the parts may be reused by a later call
}

// Values i0 .. i0+7 of x (times gain when NORM) times `up`, zeros past `in` (float4 loads when whole: vec)
template <bool NORM>
__device__ __forceinline__ void load8(const float* __restrict__ x, const float* __restrict__ gain, int i0, int in,
                                      bool vec, float up, float (&v)[8]) {
    if (vec && i0 + 8 <= in) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float4 a = reinterpret_cast<const float4*>(x + i0)[h];
            if (NORM) {
                float4 g = reinterpret_cast<const float4*>(gain + i0)[h];
                a.x *= g.x; a.y *= g.y; a.z *= g.z; a.w *= g.w;
            }
            v[4 * h] = a.x * up; v[4 * h + 1] = a.y * up; v[4 * h + 2] = a.z * up; v[4 * h + 3] = a.w * up;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = i0 + k < in ? (NORM ? x[i0 + k] * gain[i0 + k] : x[i0 + k]) * up : 0.0f;
    }
}

struct Staged {
    float mean_sq;       // Σ x² / in (NORM)
    float down;          // 2^-e: undoes x's scaling
};

// x -> shared memory in fp16, scaled by 2^e, n_pad chunks (zeros past `in`), a warp step = STEP chunks:
//   int8: chunk c at xs + 32 c: its 16 values in order (8 f16x2 words: word 2j, 2j+1 are mma j's b0, b1);
//         after the n_pad chunks, per warp step: float 1152·Σ of its stored values (the codes' offset);
//   int4: chunk c at xs + 80 c: per code word w (8 values v0..v7), 4 words (v0, v4), (v1/16, v5/16),
//         (v2, v6), (v3/16, v7/16) = b0, b1 of the word's two mmas; then 16 bytes of padding;
//         after the n_pad chunks, per quad of 4 chunks: float2 (Z, X), Z = 1024·Σ of the quad's stored values
//         (the codes' offset: 1024·x against a low code, 1024·x/16 against a high one), X = Σ x (the min's).
// Every thread must call (block barriers inside).
template <bool INT4, bool NORM, int STEP>
__device__ Staged stage_x_mma(const float* __restrict__ x, const float* __restrict__ gain, int in, int n_pad,
                              unsigned char* __restrict__ xs) {
    constexpr int C = INT4 ? 32 : 16;
    // pass 1: the largest |x·gain| (the scale) and Σ x² (the norm)
    // (float4 loads when in % 4 == 0: x and gain are CuPy allocations, 16-byte aligned)
    const bool vec = (in & 3) == 0;
    float mx = 0.0f, ss = 0.0f;
    if (vec) {
#pragma unroll 2
        for (int i4 = threadIdx.x; i4 < (in >> 2); i4 += blockDim.x) {
            float4 v = reinterpret_cast<const float4*>(x)[i4], g = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
            if (NORM) {
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                g = reinterpret_cast<const float4*>(gain)[i4];
            }
            mx = fmaxf(fmaxf(mx, fmaxf(fabsf(v.x * g.x), fabsf(v.y * g.y))),
                       fmaxf(fabsf(v.z * g.z), fabsf(v.w * g.w)));
        }
    } else {
        for (int i = threadIdx.x; i < in; i += blockDim.x) {
            float v = x[i];
            if (NORM) ss += v * v;
            mx = fmaxf(mx, fabsf(NORM ? v * gain[i] : v));
        }
    }
    block_max_sum(mx, ss);
    int ex = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127;
    int e = mx > 0.0f ? min(max(M_X_TOP - ex, -100), 100) : 0;
    float up = __uint_as_float((unsigned int)(127 + e) << 23);
    Staged st;
    st.down = __uint_as_float((unsigned int)(127 - e) << 23);
    st.mean_sq = ss / (float)in;
    // pass 2 (x is in L1 now): convert, store, and sum what was stored
    for (int c0 = 0; c0 < n_pad; c0 += blockDim.x) {             // uniform trip count: the quad shuffles below
        int c = c0 + threadIdx.x;
        bool on = c < n_pad;
        double lo = 0.0, hi = 0.0;                               // Σ of the stored values (int4: low, high nibbles)
        if (on) {
#pragma unroll
            for (int w = 0; w < C / 8; w++) {                   // 8 values (an int4 code word) at a time
                float e8[8];
                load8<NORM>(x, gain, c * C + 8 * w, in, vec, up, e8);
                uint4 q;
                if (INT4) {                                      // (v0, v4), (v1/16, v5/16), (v2, v6), (v3/16, v7/16)
                    q.x = pack_half2(e8[0], e8[4]);
                    q.y = pack_half2(e8[1] * 0.0625f, e8[5] * 0.0625f);
                    q.z = pack_half2(e8[2], e8[6]);
                    q.w = pack_half2(e8[3] * 0.0625f, e8[7] * 0.0625f);
                    reinterpret_cast<uint4*>(xs + (size_t)c * 80)[w] = q;
                    lo += (double)F16::lo(q.x) + (double)F16::hi(q.x) + (double)F16::lo(q.z) + (double)F16::hi(q.z);
                    hi += (double)F16::lo(q.y) + (double)F16::hi(q.y) + (double)F16::lo(q.w) + (double)F16::hi(q.w);
                } else {                                         // in order
                    q.x = pack_half2(e8[0], e8[1]);
                    q.y = pack_half2(e8[2], e8[3]);
                    q.z = pack_half2(e8[4], e8[5]);
                    q.w = pack_half2(e8[6], e8[7]);
                    reinterpret_cast<uint4*>(xs + (size_t)c * 32)[w] = q;
                    lo += (double)F16::lo(q.x) + (double)F16::hi(q.x) + (double)F16::lo(q.y) + (double)F16::hi(q.y)
                        + (double)F16::lo(q.z) + (double)F16::hi(q.z) + (double)F16::lo(q.w) + (double)F16::hi(q.w);
                }
            }
        }
        // the sums of 4 (int4: a quad) or STEP (int8: a warp step) chunks: consecutive chunks, consecutive lanes
        if (INT4) {
            for (int o = 1; o < 4; o <<= 1) {
                lo += __shfl_xor_sync(0xffffffffu, lo, o);
                hi += __shfl_xor_sync(0xffffffffu, hi, o);
            }
            // hi sums the stored x/16: a high code reads 1024 + 16 n, so (1024 + 16 n)·x/16 = n·x + 1024·x/16
            if (on && (c & 3) == 0) {
                float2* quad = reinterpret_cast<float2*>(xs + (size_t)n_pad * 80);
                quad[c >> 2] = make_float2((float)(1024.0 * (lo + hi)), (float)(lo + 16.0 * hi));
            }
        } else {
            for (int o = 1; o < STEP; o <<= 1) lo += __shfl_xor_sync(0xffffffffu, lo, o);
            float* offsets = reinterpret_cast<float*>(xs + (size_t)n_pad * 32);
            if (on && c % STEP == 0) offsets[c / STEP] = (float)(1152.0 * lo);
        }
    }
    __syncthreads();
    return st;
}

// ---- one warp's steps ------------------------------------------------------------------------------------
// A step's loads for one lane: chunks 4u + t (u < U) of its two rows; int4 also the scales and mins of its
// (row, quad) pairs: row a for even t, b for odd; quads u = t >> 1, t >> 1 + 2, ...
template <int U>
struct StepLoads {
    uint4 a[U], b[U];
    u16 s[U / 2], m[U / 2];
};

// The lane's rows for a tile: pair 8·tile + g (rows ra -> A row g, rb -> A row g + 8)
struct LaneRows {
    const uint4* a;
    const uint4* b;
    unsigned int ga, gb;     // int4: the rows' first scale/min element
    float sa, sb;            // int8: the rows' scales
};

template <int EPI, bool INT4>
__device__ __forceinline__ LaneRows lane_rows(int tile, int pairs, int rows, int hd, const uint4* qw, int n_chunks,
                                              int n_groups, const void* scales) {
    int g = (threadIdx.x & 31) >> 2;
    RowPair r;
    int p = tile * 8 + g;
    if (p >= pairs || !row_pair<EPI>(p, rows, hd, r)) { r.ra = 0; r.rb = 0; }   // loads something valid, unused
    LaneRows lr;
    lr.a = qw + (size_t)r.ra * n_chunks;
    lr.b = qw + (size_t)r.rb * n_chunks;
    lr.ga = (unsigned int)r.ra * n_groups;
    lr.gb = (unsigned int)r.rb * n_groups;
    lr.sa = lr.sb = 0.0f;
    if (!INT4 && (threadIdx.x & 3) == 0) {                      // a tile ahead: the latency hides
        lr.sa = static_cast<const float*>(scales)[r.ra];
        lr.sb = static_cast<const float*>(scales)[r.rb];
    }
    return lr;
}

template <bool INT4, int U>
__device__ __forceinline__ void load_step(const LaneRows& lr, int s, int n_chunks, const u16* S, const u16* M,
                                          int cpg, int cpg_shift, StepLoads<U>& L) {
    int t = threadIdx.x & 3;
#pragma unroll
    for (int u = 0; u < U; u++) {
        int c = s * 4 * U + 4 * u + t;
        if (c < n_chunks) {
            L.a[u] = ld_stream(lr.a + c);
            L.b[u] = ld_stream(lr.b + c);
        } else {
            L.a[u] = make_uint4(0u, 0u, 0u, 0u);
            L.b[u] = L.a[u];
        }
    }
    if (INT4) {
#pragma unroll
        for (int i = 0; i < U / 2; i++) {
            int cq = s * 4 * U + 4 * ((t >> 1) + 2 * i);          // the first chunk of this lane's quad
            L.s[i] = 0;
            L.m[i] = 0;
            if (cq < n_chunks) {
                unsigned int grp = cpg_shift >= 0 ? (unsigned int)cq >> cpg_shift : (unsigned int)(cq / cpg);
                unsigned int off = ((t & 1) ? lr.gb : lr.ga) + grp;
                L.s[i] = S[off];
                L.m[i] = M[off];
            }
        }
    }
}

// int8: acc_a, acc_b += Σ b·x_h over the step's 64 U codes of rows a and b: the mma's Σ (1152 + b)·x_h, less
// the step's offset
template <int U>
__device__ __forceinline__ void step_int8(const StepLoads<U>& L, int s, const unsigned char* xs,
                                          const float* offsets, float& acc_a, float& acc_b) {
    int t = threadIdx.x & 3;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int u = 0; u < U; u++) {
        const uint4* xp = reinterpret_cast<const uint4*>(xs + (size_t)(s * 4 * U + 4 * u + t) * 32);
        uint4 x0 = xp[0], x1 = xp[1];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned int ua = word(L.a[u], j) ^ 0x80808080u, ub = word(L.b[u], j) ^ 0x80808080u;
            unsigned int b0 = word(j < 2 ? x0 : x1, 2 * (j & 1)), b1 = word(j < 2 ? x0 : x1, 2 * (j & 1) + 1);
            mma16816(d, __byte_perm(ua, 0x64646464u, 0x4140), __byte_perm(ub, 0x64646464u, 0x4140),   // bytes 0, 1
                     __byte_perm(ua, 0x64646464u, 0x4342), __byte_perm(ub, 0x64646464u, 0x4342),       // bytes 2, 3
                     b0, b1);
        }
    }
    float off = offsets[s];
    acc_a += d[0] - off;       // column 2t of row g (every column holds the same sums)
    acc_b += d[2] - off;       // row g + 8
}

// int4: acc += s·(D - Z) + m·X for this lane's (row, quad) pairs; D = Σ codes·x_h of a quad's 128 codes
template <int U>
__device__ __forceinline__ void step_int4(const StepLoads<U>& L, int s, const unsigned char* xs, const float2* quad,
                                          float& acc) {
    int t = threadIdx.x & 3;
    float d[U][4];
#pragma unroll
    for (int u = 0; u < U; u++) {
        d[u][0] = d[u][1] = d[u][2] = d[u][3] = 0.0f;
        const uint4* xp = reinterpret_cast<const uint4*>(xs + (size_t)(s * 4 * U + 4 * u + t) * 80);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            uint4 xq = xp[w];
            unsigned int la = word(L.a[u], w), lb = word(L.b[u], w);
            // nibbles (0, 4) as 1024 + n against (x0, x4); (1, 5) as 1024 + 16 n against (x1/16, x5/16)
            mma16816(d[u], lop_1024<0x000F000Fu>(la), lop_1024<0x000F000Fu>(lb), lop_1024<0x00F000F0u>(la),
                     lop_1024<0x00F000F0u>(lb), xq.x, xq.y);
            la >>= 8;
            lb >>= 8;
            mma16816(d[u], lop_1024<0x000F000Fu>(la), lop_1024<0x000F000Fu>(lb), lop_1024<0x00F000F0u>(la),
                     lop_1024<0x00F000F0u>(lb), xq.z, xq.w);
        }
    }
#pragma unroll
    for (int i = 0; i < U / 2; i++) {                           // quads 2i and 2i + 1: this lane takes one
        float v0 = (t & 1) ? d[2 * i][2] : d[2 * i][0];           // rows a, b: D rows g, g + 8
        float v1 = (t & 1) ? d[2 * i + 1][2] : d[2 * i + 1][0];
        float v = (t >> 1) ? v1 : v0;
        float2 zx = quad[s * U + 2 * i + (t >> 1)];
        acc = fmaf(F16::to_float(L.s[i]), v - zx.x, fmaf(F16::to_float(L.m[i]), zx.y, acc));
    }
}

// ---- the kernel -----------------------------------------------------------------------------------------
template <class W, bool INT4, bool NORM, int EPI, int U>
__device__ __forceinline__ void gemv_mma(const uint4* __restrict__ qw, const void* __restrict__ scales,
                                         const u16* __restrict__ mins, int n_chunks, int n_groups, int cpg,
                                         int cpg_shift, const float* __restrict__ x, const float* __restrict__ gain,
                                         float eps, int in, int pairs, int rows, const Epilogue<W>& ep) {
    extern __shared__ uint4 smem_mma[];
    unsigned char* xs = reinterpret_cast<unsigned char*>(smem_mma);
    __shared__ float red[2][M_WARPS][16];                      // per tile parity: each warp's 16 row sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int n_steps = (n_chunks + 4 * U - 1) / (4 * U);        // of each row
    const int n_pad = n_steps * 4 * U;                           // chunks of x staged (zeros past in)
    const int spw = (n_steps + M_WARPS - 1) / M_WARPS;          // step slots a warp takes in each tile
    const int n_tiles = (pairs + 7) >> 3;
    const u16* S = static_cast<const u16*>(scales);
    const float2* quad = reinterpret_cast<const float2*>(xs + (size_t)n_pad * 80);    // int4
    const float* offsets = reinterpret_cast<const float*>(xs + (size_t)n_pad * 32);    // int8

    // this warp's items: (tile, slot j) -> step warp + 8 j of the tile; the first one's loads go out now
    int tile = blockIdx.x, j = 0;
    LaneRows lr = lane_rows<EPI, INT4>(tile, pairs, rows, ep.hd, qw, n_chunks, n_groups, scales);
    StepLoads<U> buf0, buf1;                                     // two register buffers, used in turn
    if (tile < n_tiles && warp < n_steps) load_step<INT4, U>(lr, warp, n_chunks, S, mins, cpg, cpg_shift, buf0);
    pdl_wait_then_trigger();                // x is the last kernel's output; the weights above are not (PDL)

    Staged st = stage_x_mma<INT4, NORM, 4 * U>(x, gain, in, n_pad, xs);
    float inv_rms = NORM ? rsqrtf(st.mean_sq + eps) : 1.0f;
    float acc_a = 0.0f, acc_b = 0.0f;                            // int4: acc_a only (this lane's row and quads)
    int parity = 0;

    // one item: the next item's loads into `nxt` first, then this step's mma from `cur`
    auto item = [&](const StepLoads<U>& cur, StepLoads<U>& nxt) {
        int ntile = tile, nj = j + 1;
        LaneRows nlr = lr;
        if (nj == spw) {
            nj = 0;
            ntile += gridDim.x;
            nlr = lane_rows<EPI, INT4>(ntile, pairs, rows, ep.hd, qw, n_chunks, n_groups, scales);
        }
        int ns = warp + M_WARPS * nj;
        if (ntile < n_tiles && ns < n_steps) load_step<INT4, U>(nlr, ns, n_chunks, S, mins, cpg, cpg_shift, nxt);

        int s = warp + M_WARPS * j;
        if (s < n_steps) {
            if (INT4) step_int4<U>(cur, s, xs, quad, acc_a);
            else step_int8<U>(cur, s, xs, offsets, acc_a, acc_b);
        }
        if (j == spw - 1) {                                      // this tile's last slot: add up the warps
            if (INT4) {
                acc_a += __shfl_xor_sync(0xffffffffu, acc_a, 2);  // quads 0 and 1 of the same row
                if (t < 2) red[parity][warp][g + 8 * t] = acc_a;
            } else if (t == 0) {                                 // the row scales now (linear: fewer loads later)
                red[parity][warp][g] = acc_a * lr.sa;
                red[parity][warp][g + 8] = acc_b * lr.sb;
            }
            __syncthreads();
            if (warp == 0 && lane < 8) {
                float sa = 0.0f, sb = 0.0f;
#pragma unroll
                for (int w = 0; w < M_WARPS; w++) { sa += red[parity][w][lane]; sb += red[parity][w][lane + 8]; }
                RowPair r;
                int p = tile * 8 + lane;
                if (p < pairs && row_pair<EPI>(p, rows, ep.hd, r)) {
                    float k = st.down * inv_rms;
                    ep.template store<EPI>(r, p, sa * k, sb * k);
                }
            }
            acc_a = 0.0f;
            acc_b = 0.0f;
            parity ^= 1;            // the next tile writes the other half of red: one barrier a tile suffices
        }
        tile = ntile;
        j = nj;
        lr = nlr;
    };
    while (tile < n_tiles) {        // unrolled by two so that the buffers swap roles without copies
        item(buf0, buf1);
        if (tile >= n_tiles) break;
        item(buf1, buf0);
    }
}

// grid (any; the launcher: 3 blocks per SM (U = 2), each looping over tiles of 8 row pairs), block 32 * M_WARPS,
// dynamic shared memory n_pad * 32 + n_pad / U bytes (int8) or n_pad * 82 (int4), n_pad = n_chunks rounded
// up to 4 U.
// The arguments are gemv_quant.cu's (GEMV_QUANT_KERNEL), so one launcher serves v2 and v3. int4 needs
// cpg % 4 == 0 (g % 128 == 0).
#define GEMV_MMA_KERNEL(NAME, W, INT4, NORM, EPI, U)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * M_WARPS, (U) == 2 ? 3 : 2) NAME(                          \
        const uint4* qw, const void* scales, const u16* mins, int n_chunks, int n_groups, int cpg, int cpg_shift,\
        const float* x, const float* gain, float eps, int in, int pairs, float* y, int rows, int accumulate,     \
        u16* k_cache, u16* v_cache, int capacity, const int* pos, const float* inv_freq, int n_heads,            \
        int n_kv_heads, int hd) {                                                                               \
        Epilogue<W> ep{y, accumulate, k_cache, v_cache, capacity, pos, inv_freq, n_heads, n_kv_heads, hd};       \
        gemv_mma<W, INT4, NORM, EPI, U>(qw, scales, mins, n_chunks, n_groups, cpg, cpg_shift, x, gain, eps, in,   \
                                     pairs, rows, ep);                                                           \
    }
GEMV_MMA_KERNEL(gemv_int8_v3_f16, F16, false, false, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_int8_v3_bf16, BF16, false, false, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_int8_v3_f16, F16, false, true, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_int8_v3_bf16, BF16, false, true, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_swiglu_int8_v3_f16, F16, false, false, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_swiglu_int8_v3_bf16, BF16, false, false, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_swiglu_int8_v3_f16, F16, false, true, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_swiglu_int8_v3_bf16, BF16, false, true, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_qkv_int8_v3_f16, F16, false, false, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_qkv_int8_v3_bf16, BF16, false, false, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_qkv_int8_v3_f16, F16, false, true, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_qkv_int8_v3_bf16, BF16, false, true, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_int4_v3_f16, F16, true, false, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_int4_v3_bf16, BF16, true, false, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_int4_v3_f16, F16, true, true, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_int4_v3_bf16, BF16, true, true, EPI_PLAIN, 2)
GEMV_MMA_KERNEL(gemv_swiglu_int4_v3_f16, F16, true, false, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_swiglu_int4_v3_bf16, BF16, true, false, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_swiglu_int4_v3_f16, F16, true, true, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_swiglu_int4_v3_bf16, BF16, true, true, EPI_SWIGLU, 2)
GEMV_MMA_KERNEL(gemv_qkv_int4_v3_f16, F16, true, false, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_qkv_int4_v3_bf16, BF16, true, false, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_qkv_int4_v3_f16, F16, true, true, EPI_QKV, 2)
GEMV_MMA_KERNEL(gemv_rmsnorm_qkv_int4_v3_bf16, BF16, true, true, EPI_QKV, 2)
// U = 4 (two sub-steps more a warp step: 128 bytes of each row a lane in flight instead of 64; ~100 registers,
// 2 blocks an SM), plain y (+)= W·x only: an experiment (KernelSettings.quant_mma_substeps)
GEMV_MMA_KERNEL(gemv_int8_v3u4_f16, F16, false, false, EPI_PLAIN, 4)
GEMV_MMA_KERNEL(gemv_int8_v3u4_bf16, BF16, false, false, EPI_PLAIN, 4)
GEMV_MMA_KERNEL(gemv_int4_v3u4_f16, F16, true, false, EPI_PLAIN, 4)
GEMV_MMA_KERNEL(gemv_int4_v3u4_bf16, BF16, true, false, EPI_PLAIN, 4)
