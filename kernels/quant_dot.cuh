// quant_dot.cuh: the arithmetic the quantized decode GEMVs share (gemv_quant.cu v2, gemv_quant_tma.cu v4):
// int8 / int4 codes turned into exact fp16 pairs by bit tricks, their products with x two at a time (HFMA2),
// and x's chunks scaled by a power of two each and packed as fp16 pairs in the order the dequantizer makes
// its code pairs. gemv_quant.cu's header comment says why each step is exact or how much it rounds.
#pragma once
#include "common.cuh"

// ---- dequantization: codes -> exact small floats ---------------------------------------------------------
__device__ __forceinline__ unsigned int hsub2(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ unsigned int hfma2(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

#define F16X2_1024 0x64006400u       // (1024, 1024)
#define F16X2_1152 0x64806480u       // (1152, 1152) = 1024 + 128
#define F16X2_SIXTEENTH 0x2C002C00u  // (1/16, 1/16)
#define F16X2_MINUS_64 0xD400D400u   // (-64, -64)

// ---- products two at a time in fp16 (HFMA2) ---------------------------------------------------------------
// f16x2 helpers (the codes' bit tricks above give exact f16x2 pairs)
__device__ __forceinline__ unsigned int pack_f16x2(float lo, float hi) {
    unsigned int d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));   // d.hi = first source, d.lo = second
    return d;
}

// the f16x2 partial's two halves, widened and added in fp32
__device__ __forceinline__ float f16x2_sum(unsigned int p) { return F16::lo(p) + F16::hi(p); }

// acc + (b0, b2)·(x0, x2) + (b1, b3)·(x1, x3), in f16x2: 4 int8 weights (one word) against their x pairs
__device__ __forceinline__ unsigned int dot4_i8_h2(unsigned int w, unsigned int x02, unsigned int x13,
                                                   unsigned int acc) {
    unsigned int u = w ^ 0x80808080u;
    unsigned int b02 = hsub2(__byte_perm(u, 0x64646464u, 0x4240), F16X2_1152);
    unsigned int b13 = hsub2(__byte_perm(u, 0x64646464u, 0x4341), F16X2_1152);
    return hfma2(b13, x13, hfma2(b02, x02, acc));
}

// (w & MASK) | F16X2_1024 in one LOP3: written as C, the compiler emits an AND and an OR (SASS takes one
// immediate per instruction), one more instruction per two weights
template <unsigned int MASK>
__device__ __forceinline__ unsigned int and_or_1024(unsigned int w) {
    unsigned int d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "n"(MASK), "n"(F16X2_1024));   // (a & b) | c
    return d;
}

#define F16X2_1032 0x64086408u       // (1032, 1032) = 1024 + 8
#define F16X2_MINUS_72 0xD480D480u   // (-72, -72) = -64 - 8

// acc + Σ of 8 int4 codes, centred (n - 8, in -8..7), times their x pairs (x0, x4), (x1, x5), (x2, x6),
// (x3, x7) = x.x .. x.w. Centring costs nothing here (other constants in the same two instructions) and
// keeps the fp16 partial small: Σ n·x over a chunk carries 7.5·Σx, a large term that the min cancels
// again later, and fp16 rounds relative to the partial's size (the error of the int4 GEMV drops ~3x).
// The 8 comes back in fp32: s·Σ(n - 8)·x + (m + 8·s)·Σx.
__device__ __forceinline__ unsigned int dot8_i4_h2(unsigned int w, uint4 x, unsigned int acc) {
    unsigned int n04 = hsub2(and_or_1024<0x000F000Fu>(w), F16X2_1032);
    unsigned int n15 = hfma2(and_or_1024<0x00F000F0u>(w), F16X2_SIXTEENTH, F16X2_MINUS_72);
    w >>= 8;
    unsigned int n26 = hsub2(and_or_1024<0x000F000Fu>(w), F16X2_1032);
    unsigned int n37 = hfma2(and_or_1024<0x00F000F0u>(w), F16X2_SIXTEENTH, F16X2_MINUS_72);
    acc = hfma2(n04, x.x, acc);
    acc = hfma2(n15, x.y, acc);
    acc = hfma2(n26, x.z, acc);
    return hfma2(n37, x.w, acc);
}

// ---- x in chunks: loaded, scaled, packed --------------------------------------------------------------------
#define X_TOP 5              // each chunk of x is scaled so that its largest |value| lies in [2^(X_TOP-1), 2^X_TOP)

// x's loads (through the read-only path)
__device__ __forceinline__ float4 ld_x4(const float* __restrict__ base, int k) {     // float4 k from base
    return reinterpret_cast<const float4*>(base)[k];
}

__device__ __forceinline__ float ld_x(const float* __restrict__ base, int i) {
    return base[i];
}

// chunk c of x (times gain when NORM) -> v[C] (zeros past `in`); Σ x² of it added to ss in x's order (NORM)
template <int C, bool NORM>
__device__ __forceinline__ void load_x_chunk(const float* __restrict__ x, const float* __restrict__ gain, int in,
                                             int c, bool vec, float (&v)[C], float& ss) {
    int i0 = c * C;
    if (vec && i0 + C <= in) {
#pragma unroll
        for (int k = 0; k < C / 4; k++) {
            float4 a = ld_x4(x + i0, k);
            v[4 * k] = a.x; v[4 * k + 1] = a.y; v[4 * k + 2] = a.z; v[4 * k + 3] = a.w;
            if (NORM) {
                ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
                float4 g = reinterpret_cast<const float4*>(gain + i0)[k];
                v[4 * k] *= g.x; v[4 * k + 1] *= g.y; v[4 * k + 2] *= g.z; v[4 * k + 3] *= g.w;
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < C; k++) {
            float a = i0 + k < in ? ld_x(x, i0 + k) : 0.0f;
            if (NORM) {
                ss += a * a;
                a *= i0 + k < in ? gain[i0 + k] : 0.0f;
            }
            v[k] = a;
        }
    }
}

// Σ of a chunk's values (int4's min term), in x's order
template <int C>
__device__ __forceinline__ float chunk_sum(const float (&v)[C]) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < C; k++) sum += v[k];
    return sum;
}

// v[C] (one chunk of x) -> its C/2 f16x2 words in the dequantizer's order, scaled by 2^e so that the chunk's
// largest |value| lies in [2^(X_TOP-1), 2^X_TOP); returns 2^-e, the factor that undoes it.
template <int C, bool INT4>
__device__ __forceinline__ float pack_x_chunk(const float (&v)[C], uint4 (&w)[C / 8]) {
    float mx = 0.0f;
#pragma unroll
    for (int k = 0; k < C; k++) mx = fmaxf(mx, fabsf(v[k]));
    // mx in [2^ex, 2^(ex+1)): scale by 2^e, e = X_TOP - 1 - ex (clamped: both 2^e and 2^-e stay normal)
    int ex = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127;
    int e = mx > 0.0f ? min(max(X_TOP - 1 - ex, -120), 120) : 0;
    float up = __uint_as_float((unsigned int)(127 + e) << 23);
#pragma unroll
    for (int k = 0; k < C / 8; k++) {              // 8 values -> 4 words
        const float* g8 = v + 8 * k;
        if (INT4) {                                 // (x0, x4), (x1, x5), (x2, x6), (x3, x7)
            w[k].x = pack_f16x2(g8[0] * up, g8[4] * up);
            w[k].y = pack_f16x2(g8[1] * up, g8[5] * up);
            w[k].z = pack_f16x2(g8[2] * up, g8[6] * up);
            w[k].w = pack_f16x2(g8[3] * up, g8[7] * up);
        } else {                                    // (x0, x2), (x1, x3), (x4, x6), (x5, x7)
            w[k].x = pack_f16x2(g8[0] * up, g8[2] * up);
            w[k].y = pack_f16x2(g8[1] * up, g8[3] * up);
            w[k].z = pack_f16x2(g8[4] * up, g8[6] * up);
            w[k].w = pack_f16x2(g8[5] * up, g8[7] * up);
        }
    }
    return __uint_as_float((unsigned int)(127 - e) << 23);
}
