// gemv_quant_versions.cu: kernels/gemv_quant.cu's rivals that share its code and arguments (minillm/cuda/dev/lab.py
// launches them): the first version, v1 (x staged as fp32, fp32 FMAs a weight; plain y (+)= W·x only), kept to
// compare with the shipped v2 (x as fp16, HFMA2 products) and to teach (lesson 14); and int8's q|k|v on v2's
// 2-blocks-an-SM build, the rival of the shipped _3b kernels (LabSettings.qkv_one_round=False).
//
// v1 (gemv_int8_v1_*, gemv_int4_v1_*: plain y = W·x only, kept to compare) is gemv.cu v4's structure with
// a dequantizing inner loop: one warp per row pair, 16-byte streaming loads (several in flight per lane
// before any arithmetic), fp32 accumulation, one warp-shuffle reduction, and the same prologue/epilogues
// (RMSNorm fused in; plain / + residual, SwiGLU, RoPE + KV append: gemv_epilogue.cuh). What is new:
//  - Dequantization by bit tricks on fp16 (no <cuda_fp16.h>: common.cuh): a byte or a nibble OR-ed under
//    the fp16 exponent of 1024 (0x6400) reads as 1024 + code; one f16x2 subtraction (or fused
//    multiply-add, for a high nibble, which reads as 1024 + 16·code) leaves the code as an exact small
//    float, two at a time. Per weight that is ~1 integer/half instruction, one fp16->fp32 widening and
//    one FMA, all exact: the only rounding is fp32 accumulation, as in the fp16 kernel.
//  - int4: Σ_k (q·s + m)·x_k over a chunk = s·Σ q·x + m·Σ x, so the min costs one FMA per chunk and row,
//    given Σ x of the chunk, which the block computes once (x is shared by all rows).
//  - x (times the norm gain when fused) is staged in shared memory once per block. A lane's chunk needs
//    64 (int8) or 128 (int4) bytes of x; read from global memory, one such float4 load across a warp would
//    touch 16 or 32 cache lines. In shared memory, padding each chunk of x by 4 floats makes the same
//    reads conflict-free (32 consecutive chunks start in 32 different 4-bank groups... eight per phase).
//  - Blocks loop over row pairs (the launcher sizes the grid to ~2 blocks per SM), so x is staged a few
//    hundred times per matrix instead of once per 16 rows. The first 128 chunks (2 KB) of the first pair's
//    rows are prefetched into L2 before the staging (Q_PREFETCH_CHUNKS: int4's first step of a 4096-wide
//    row; whole rows, the first round of int8 down's pairs was 60 MB, more than the 50 MB L2, and H200
//    decode measured 1-6% slower for int8, the same for int4: lessons/BENCHMARKS.md). Optionally (flags:
//    Q_LOOKAHEAD) each warp also prefetches its next pair while it computes this one
//    (cp.async.bulk.prefetch: no registers held). Measured on the H200 that was 1-3% slower
//    (lessons/BENCHMARKS.md), so the launcher leaves it off.
//
// Where v1 stood (H200, Mistral-7B shapes, in a CUDA graph): int8 2.3-2.8 TB/s on gate_up/down but
// 1.6-1.7 on qkv/o; int4 1.0-1.8 TB/s. The compiled loop spends ~4.2 (int8) and ~5.2 (int4) instructions
// per weight against the ~4 that 4 TB/s leaves at int4 (lesson 14), and all warps of an SM load, then
// compute, in step. What would close the gap: the products on tensor cores (mma.sync with the codes
// widened to fp16 in the A fragment, x as B: no per-weight widening or FMA), and loads of the next step
// issued before the current step's arithmetic (register double-buffering).
//
#include "gemv_quant.cu"

// ---- v1's products: fp32 FMAs (the codes' bit tricks: quant_dot.cuh) ----------------------------------
// acc + Σ of 4 int8 weights (one 32-bit word, element 0 in the low byte) times x.x .. x.w.
// Flipping each byte's sign bit gives b + 128 in 0..255; under the exponent of 1024 that reads 1152 + b.
__device__ __forceinline__ float dot4_i8(unsigned int w, float4 x, float acc) {
    unsigned int u = w ^ 0x80808080u;
    unsigned int b02 = hsub2(__byte_perm(u, 0x64646464u, 0x4240), F16X2_1152);   // (b0, b2)
    unsigned int b13 = hsub2(__byte_perm(u, 0x64646464u, 0x4341), F16X2_1152);   // (b1, b3)
    acc = fmaf(F16::lo(b02), x.x, acc);
    acc = fmaf(F16::lo(b13), x.y, acc);
    acc = fmaf(F16::hi(b02), x.z, acc);
    acc = fmaf(F16::hi(b13), x.w, acc);
    return acc;
}

// acc + Σ of 8 int4 codes (one 32-bit word: nibble i, bits 4i..4i+3, is element i) times xa (elements
// 0..3) and xb (4..7). Masking nibbles 0 and 4 into the two halves gives (1024 + n0, 1024 + n4); nibbles
// 1 and 5 sit 4 bits higher and read (1024 + 16·n1, 1024 + 16·n5): /16 - 64 gives n1, n5 exactly.
__device__ __forceinline__ float dot8_i4(unsigned int w, float4 xa, float4 xb, float acc) {
    unsigned int n04 = hsub2((w & 0x000F000Fu) | F16X2_1024, F16X2_1024);
    unsigned int n15 = hfma2((w & 0x00F000F0u) | F16X2_1024, F16X2_SIXTEENTH, F16X2_MINUS_64);
    w >>= 8;
    unsigned int n26 = hsub2((w & 0x000F000Fu) | F16X2_1024, F16X2_1024);
    unsigned int n37 = hfma2((w & 0x00F000F0u) | F16X2_1024, F16X2_SIXTEENTH, F16X2_MINUS_64);
    acc = fmaf(F16::lo(n04), xa.x, acc);
    acc = fmaf(F16::lo(n15), xa.y, acc);
    acc = fmaf(F16::lo(n26), xa.z, acc);
    acc = fmaf(F16::lo(n37), xa.w, acc);
    acc = fmaf(F16::hi(n04), xb.x, acc);
    acc = fmaf(F16::hi(n15), xb.y, acc);
    acc = fmaf(F16::hi(n26), xb.z, acc);
    acc = fmaf(F16::hi(n37), xb.w, acc);
    return acc;
}

// ---- staging x in shared memory ------------------------------------------------------------------------
// x (times gain when NORM) -> xs, chunk c of C floats at xs[c * (C + 4)], zeros from `in` up to the padded
// width n_chunks · C. Returns Σ x² (NORM; every thread must call: block barriers inside).
template <int C, bool NORM>
__device__ __forceinline__ float stage_x(const float* __restrict__ x, const float* __restrict__ gain, int in,
                                         int n_chunks, float* __restrict__ xs) {
    int n4 = n_chunks * (C / 4);
    bool vec = (in & 3) == 0;              // whole float4s (x itself is 16-byte aligned: a CuPy allocation)
    float ss = 0.0f;
#pragma unroll 4
    for (int i4 = threadIdx.x; i4 < n4; i4 += blockDim.x) {
        int i = 4 * i4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f), g = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        if (vec) {
            if (i < in) {
                v = reinterpret_cast<const float4*>(x)[i4];
                if (NORM) g = reinterpret_cast<const float4*>(gain)[i4];
            }
        } else {
            if (i < in) { v.x = x[i]; if (NORM) g.x = gain[i]; }
            if (i + 1 < in) { v.y = x[i + 1]; if (NORM) g.y = gain[i + 1]; }
            if (i + 2 < in) { v.z = x[i + 2]; if (NORM) g.z = gain[i + 2]; }
            if (i + 3 < in) { v.w = x[i + 3]; if (NORM) g.w = gain[i + 3]; }
        }
        if (NORM) {
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            v.x *= g.x; v.y *= g.y; v.z *= g.z; v.w *= g.w;
        }
        *reinterpret_cast<float4*>(xs + (i / C) * (C + 4) + (i % C)) = v;
    }
    if (NORM) ss = block_sum(ss);
    __syncthreads();
    return ss;
}

// ---- the two formats: a row pair's dot products --------------------------------------------------------
struct Int8Rows {
    static constexpr int C = 16;           // weights (and floats of x) per 16-byte chunk
    static constexpr int U = 8;            // chunks in flight per lane per row (x 2 rows: 4 KB a warp)
    static constexpr bool CHUNK_SUMS = false;

    // x -> shared memory (returns Σ x² for the norm): v1 keeps it fp32, C + 4 floats a chunk
    template <bool NORM>
    static __device__ __forceinline__ float stage(const float* x, const float* gain, int in, int n_chunks, float* smem) {
        return stage_x<C, NORM>(x, gain, in, n_chunks, smem);
    }

    // acc_a, acc_b = Σ_k W[r, k]·xs[k] for r = ra, rb (every lane gets them)
    static __device__ __forceinline__ void dot(const uint4* __restrict__ qw, const void* scales, const u16* mins,
                                               int n_chunks, int n_groups, int cpg, int cpg_shift,
                                               const float* xs, int ra, int rb, float& acc_a, float& acc_b) {
        int lane = threadIdx.x & 31;
        float s_a = static_cast<const float*>(scales)[ra], s_b = static_cast<const float*>(scales)[rb];
        const uint4* wa = qw + (size_t)ra * n_chunks;
        const uint4* wb = qw + (size_t)rb * n_chunks;
        float a0 = 0.0f, a1 = 0.0f, b0 = 0.0f, b1 = 0.0f;            // two chains a row: more in flight
        for (int base = 0; base < n_chunks; base += 32 * U) {
            uint4 va[U], vb[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = base + 32 * u + lane;
                if (i < n_chunks) { va[u] = ld_stream(wa + i); vb[u] = ld_stream(wb + i); }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = base + 32 * u + lane;
                if (i < n_chunks) {
                    const float4* x4 = reinterpret_cast<const float4*>(xs + i * (C + 4));
                    float4 x0 = x4[0], x1 = x4[1], x2 = x4[2], x3 = x4[3];
                    a0 = dot4_i8(va[u].x, x0, a0); b0 = dot4_i8(vb[u].x, x0, b0);
                    a1 = dot4_i8(va[u].y, x1, a1); b1 = dot4_i8(vb[u].y, x1, b1);
                    a0 = dot4_i8(va[u].z, x2, a0); b0 = dot4_i8(vb[u].z, x2, b0);
                    a1 = dot4_i8(va[u].w, x3, a1); b1 = dot4_i8(vb[u].w, x3, b1);
                }
            }
        }
        acc_a = warp_sum(a0 + a1) * s_a;
        acc_b = warp_sum(b0 + b1) * s_b;
    }
};

struct Int4Rows {
    static constexpr int C = 32;
    static constexpr int U = 4;            // x 2 rows x 16 bytes: 4 KB a warp; a 4096-wide row is one step
    static constexpr bool CHUNK_SUMS = true;

    // x -> shared memory as fp32, then Σ x of each chunk after it (the min's term)
    template <bool NORM>
    static __device__ __forceinline__ float stage(const float* x, const float* gain, int in, int n_chunks, float* smem) {
        float ss = stage_x<C, NORM>(x, gain, in, n_chunks, smem);
        float* xsum = smem + (size_t)n_chunks * (C + 4);
        for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) {
            const float4* x4 = reinterpret_cast<const float4*>(smem + c * (C + 4));
            float s = 0.0f;
#pragma unroll
            for (int k = 0; k < C / 4; k++) {
                float4 v = x4[k];
                s += (v.x + v.y) + (v.z + v.w);
            }
            xsum[c] = s;
        }
        __syncthreads();
        return ss;
    }

    static __device__ __forceinline__ void dot(const uint4* __restrict__ qw, const void* scales,
                                               const u16* __restrict__ mins, int n_chunks, int n_groups, int cpg,
                                               int cpg_shift, const float* xs, int ra, int rb,
                                               float& acc_a, float& acc_b) {
        int lane = threadIdx.x & 31;
        const float* xsum = xs + (size_t)n_chunks * (C + 4);
        const u16* sa = static_cast<const u16*>(scales) + (size_t)ra * n_groups;
        const u16* sb = static_cast<const u16*>(scales) + (size_t)rb * n_groups;
        const u16* ma = mins + (size_t)ra * n_groups;
        const u16* mb = mins + (size_t)rb * n_groups;
        const uint4* wa = qw + (size_t)ra * n_chunks;
        const uint4* wb = qw + (size_t)rb * n_chunks;
        acc_a = 0.0f;
        acc_b = 0.0f;
        for (int base = 0; base < n_chunks; base += 32 * U) {
            uint4 va[U], vb[U];
            u16 s_a[U], m_a[U], s_b[U], m_b[U];
#pragma unroll
            for (int u = 0; u < U; u++) {                              // weights, scales and mins all in flight
                int i = base + 32 * u + lane;
                if (i < n_chunks) {
                    va[u] = ld_stream(wa + i);
                    vb[u] = ld_stream(wb + i);
                    int g = cpg_shift >= 0 ? i >> cpg_shift : i / cpg;   // the chunk's group
                    s_a[u] = sa[g]; m_a[u] = ma[g]; s_b[u] = sb[g]; m_b[u] = mb[g];
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = base + 32 * u + lane;
                if (i < n_chunks) {
                    const float4* x4 = reinterpret_cast<const float4*>(xs + i * (C + 4));
                    float pa0 = 0.0f, pa1 = 0.0f, pb0 = 0.0f, pb1 = 0.0f;   // Σ q·x over the chunk
                    float4 xa = x4[0], xb = x4[1];
                    pa0 = dot8_i4(va[u].x, xa, xb, pa0); pb0 = dot8_i4(vb[u].x, xa, xb, pb0);
                    xa = x4[2]; xb = x4[3];
                    pa1 = dot8_i4(va[u].y, xa, xb, pa1); pb1 = dot8_i4(vb[u].y, xa, xb, pb1);
                    xa = x4[4]; xb = x4[5];
                    pa0 = dot8_i4(va[u].z, xa, xb, pa0); pb0 = dot8_i4(vb[u].z, xa, xb, pb0);
                    xa = x4[6]; xb = x4[7];
                    pa1 = dot8_i4(va[u].w, xa, xb, pa1); pb1 = dot8_i4(vb[u].w, xa, xb, pb1);
                    float X = xsum[i];                                      // Σ x over the chunk
                    acc_a = fmaf(F16::to_float(s_a[u]), pa0 + pa1, fmaf(F16::to_float(m_a[u]), X, acc_a));
                    acc_b = fmaf(F16::to_float(s_b[u]), pb0 + pb1, fmaf(F16::to_float(m_b[u]), X, acc_b));
                }
            }
        }
        acc_a = warp_sum(acc_a);
        acc_b = warp_sum(acc_b);
    }
};

// v1, plain y (+)= W·x only: kept to compare (minillm.cuda.qbench times both)
GEMV_QUANT_KERNEL(gemv_int8_v1_f16, Int8Rows, F16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_int8_v1_bf16, Int8Rows, BF16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_int4_v1_f16, Int4Rows, F16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_int4_v1_bf16, Int4Rows, BF16, false, EPI_PLAIN)


// int8's q|k|v GEMV on the build every other GEMV uses (2 blocks an SM): two rounds of Mistral-7B's 3072 row pairs
GEMV_QUANT_KERNEL(gemv_qkv_int8_f16, Int8RowsH, F16, false, EPI_QKV)
GEMV_QUANT_KERNEL(gemv_qkv_int8_bf16, Int8RowsH, BF16, false, EPI_QKV)
GEMV_QUANT_KERNEL(gemv_rmsnorm_qkv_int8_f16, Int8RowsH, F16, true, EPI_QKV)
GEMV_QUANT_KERNEL(gemv_rmsnorm_qkv_int8_bf16, Int8RowsH, BF16, true, EPI_QKV)
