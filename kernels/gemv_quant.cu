// gemv_quant.cu: y = W·x for weight-only quantized W (int8 per row, int4 in groups), dequantized in registers.
//
// CPU reference: minillm.model.quant (Int8Weight / Int4Weight .dequantize(), then the matmul in
// QuantizedWeight.matmul). Decode at batch 1 reads every weight byte once per token, so the bytes are the
// time: int8 reads half of fp16's bytes, int4 in groups of 128 a little over a quarter. The catch is the
// arithmetic: at 4 TB/s, int4 is 8·10¹² weights a second, a quarter of the H200's fp32 issue rate, so
// turning a code into a float must cost one or two instructions, not a conversion unit's eight.
//
// The layouts are minillm/model/quant.py's, uploaded as they are:
//   int8: q int8 [rows, in16] (in16 = in rounded up to 16 by the uploader; the extra columns meet x = 0),
//         scales fp32 [rows]:                  W[r, k] = q[r, k] · scale[r]
//   int4: q uint8 [rows, in_padded / 2], byte j = element 2j (low nibble) | element 2j+1 (high nibble) << 4,
//         scales, mins fp16 [rows, in_padded / g] (g a multiple of 32):
//                                              W[r, k] = q[r, k] · scale[r, k / g] + min[r, k / g]
//   A 16-byte load is 16 int8 or 32 int4 weights of one row ("a chunk"); with g % 32 == 0 an int4 chunk
//   never straddles two groups, so it needs one scale and one min.
//
// The first version (v1: x staged as fp32, fp32 FMAs a weight) is in
// minillm/cuda/dev/kernels/gemv_quant_versions.cu, with its story; this is v2. What both share with gemv.cu v4: one warp per row pair, 16-byte streaming loads
// (several in flight per lane before any arithmetic), fp32 accumulation, one warp-shuffle reduction, the same
// prologue/epilogues (RMSNorm fused in; plain / + residual, SwiGLU, RoPE + KV append: gemv_epilogue.cuh), x
// (times the norm gain when fused) staged in shared memory once per block, and blocks that loop over row pairs
// (the launcher sizes the grid to ~2 blocks per SM). The first Q_PREFETCH_CHUNKS (2 KB) of a warp's first pair's
// rows are prefetched into L2 before the staging (whole rows measured slower: lessons/BENCHMARKS.md).
//
// v2 (every GEMV kernel here: the decode step's) keeps v1's structure and cuts the instructions per weight:
// the products are done two at a time in fp16 (HFMA2) and only a chunk's sum is widened to fp32.
//  - x is staged in shared memory as fp16 (half of v1's bytes: shared-memory bandwidth was near its limit at
//    int4 rates), each chunk of C values scaled by its own power of two 2^e_c and stored in the order the
//    dequantizer produces code pairs: (x0, x2), (x1, x3) per 4 for int8; (x0, x4) .. (x3, x7) per 8 for int4;
//    then 16 bytes of padding a chunk (conflict-free 16-byte reads, as in v1).
//  - Per 16-byte chunk and row: the codes become exact f16x2 pairs (quant_dot.cuh's bit tricks; int4 centred, n - 8),
//    HFMA2 with the x pairs into one f16x2 partial (8 instructions for 16 int8 weights, 16 for 32 int4),
//    then the two halves are widened, added and multiplied by 2^-e_c into the fp32 accumulator; the row's
//    scale (int8), or the group's scale and (min + 8·scale)·Σx (int4, Σx of the chunk in fp32 from the
//    unrounded x), are applied in fp32.
//  - int4's (w & mask) | 0x6400 is one LOP3 (inline PTX; as C it compiled to two), and its scale/min
//    addresses are 32-bit offsets from the arrays' bases.
// Per weight (the compiled inner loop, sm_90 SASS, counted statically over one step of the loop):
// int8 4.0 -> 2.8 instructions, int4 5.1 -> 2.9.
// Precision (why fp16 products are honest here). A chunk's partial is Σ code·x over 16 (int8) or 32 (int4)
// weights, each half of the f16x2 summing 8 or 16 of them. The codes are exact; x·2^e_c is rounded to fp16
// once (relative error <= 2^-11) and each HFMA2 rounds the running half-sum (by <= 2^-11 of it). The scaling
// (largest |x| of the chunk in [16, 32)) is exact, keeps every partial below 2^15 (<= 8·128·32 for int8,
// 16·8·32 for int4): no overflow whatever the activations' range, and x's smaller elements stay normal
// fp16 numbers down to 2^-18 of the chunk's largest. Centring int4's codes matters: Σ n·x carries 7.5·Σx,
// which the min cancels later, and fp16 rounds relative to the partial's size (3x the error uncentred).
// Measured against the same quantized weights with exact x (an emulation of this arithmetic over the tests'
// shapes, and the H200): at most ~1.4e-3 of the output's largest |value| (tests/test_cuda_quant.py QUANT_TOL
// = 3e-3); on the H200, 3-8e-4 (v1: 2e-7). The quantization itself moves a 257x4096 GEMV's output by 1.4e-2
// (int8) and 1.1e-1 (int4) of that scale: 26x and 160x what the fp16 products add. Whole small models,
// GPU vs CPU, stay within the fp16 model tolerance (5e-3; emulated: 1.0-1.6e-3 from this alone).
//
// Where v2 stands, and the versions tried after it (tensor-core products, weights streamed by the TMA; both
// slower, both in minillm/cuda/dev/kernels/): lessons/BENCHMARKS.md.
#include "gemv_epilogue.cuh"
#include "quant_dot.cuh"

#ifndef Q_WARPS              // dev/qfloor.py compiles other values (with Q_MIN_BLOCKS) to measure them
#define Q_WARPS 8           // row pairs in flight per block (block = 256 threads)
#endif
#ifndef Q_MIN_BLOCKS
#define Q_MIN_BLOCKS 2      // blocks an SM the registers must allow (__launch_bounds__)
#endif
#ifndef Q_PREFETCH_CHUNKS   // chunks of a row prefetched into L2 ahead of its loads (prefetch_pair); 0: all
#define Q_PREFETCH_CHUNKS 128
#endif
#ifndef Q_U8                // chunks in flight a lane and row in one step of the dot product: int8, int4
#define Q_U8 8              // (more: fewer dependent steps a row, more registers)
#endif
#ifndef Q_U4
#define Q_U4 4
#endif
// The int8 q|k|v GEMV's own build (the _3b kernels): 3 blocks an SM with int8's steps halved (74 registers a
// thread instead of 110). Mistral-7B's 3072 row pairs are then 384 blocks in one round of the 396 slots, where 2
// an SM give 192 blocks two rounds (a quarter of the warps idle). Decode int8 1.032x; int4 lost (0.986x) and
// keeps the 2-block build (H200, 2026-12-02, lessons/BENCHMARKS.md).
#define Q_QKV_MIN_BLOCKS 3
#define Q_QKV_U8 4

// Row pair p's weights into L2 (one bulk prefetch a row, by lane 0) and, for int4, its rows' scales and mins
// (lanes 1-4, a 128-byte line at a time): issued before the staging, the first loads of pair p then hit L2.
template <int EPI, bool INT4>
__device__ __forceinline__ void prefetch_pair(int p, int pairs, int rows, int hd, const uint4* qw, int n_chunks,
                                              const void* scales, const u16* mins, int n_groups) {
    RowPair r;
    if (p >= pairs || !row_pair<EPI>(p, rows, hd, r)) return;
    int lane = threadIdx.x & 31;
    if (lane == 0) {
        unsigned int chunks = Q_PREFETCH_CHUNKS > 0 && n_chunks > Q_PREFETCH_CHUNKS ? Q_PREFETCH_CHUNKS : n_chunks;
        prefetch_l2(qw + (size_t)r.ra * n_chunks, chunks * 16u);
        if (r.rb != r.ra) prefetch_l2(qw + (size_t)r.rb * n_chunks, chunks * 16u);
    } else if (INT4 && lane <= 4) {
        const u16* base = lane <= 2 ? static_cast<const u16*>(scales) : mins;
        const char* row = reinterpret_cast<const char*>(base + (size_t)((lane & 1) ? r.ra : r.rb) * n_groups);
        for (int off = 0; off < 2 * n_groups; off += 128)
            asm volatile("prefetch.global.L2 [%0];" :: "l"(row + off));
        asm volatile("prefetch.global.L2 [%0];" :: "l"(row + 2 * n_groups - 1));   // the last line
    }
}

// ---- v2: x in fp16, two products per instruction (HFMA2, quant_dot.cuh), one fp32 widening per chunk -------
#ifndef Q_STAGE_BATCH
#define Q_STAGE_BATCH 1      // see stage_x_f16 (dev/qfloor.py compiles other values to measure them)
#endif

// v[C] (chunk c) -> its f16x2 words in the dequantizer's order, 2^-e and Σ x (INT4), into shared memory
template <int C, bool INT4>
__device__ __forceinline__ void store_x_chunk(const float (&v)[C], int c, unsigned int* __restrict__ xh,
                                              float* __restrict__ xscale, float* __restrict__ xsum) {
    uint4 w[C / 8];
    float down = pack_x_chunk<C, INT4>(v, w);
    uint4* dst = reinterpret_cast<uint4*>(xh + (size_t)c * (C / 2 + 4));
#pragma unroll
    for (int k = 0; k < C / 8; k++) dst[k] = w[k];     // 16-byte stores
    xscale[c] = down;
    if (INT4) xsum[c] = chunk_sum(v);
}

// x (times gain when NORM) -> shared memory in fp16, chunks of C values per thread (see the loop):
//   xh: [n_chunks][C/2 + 4] 32-bit words, the chunk's f16x2 pairs (in the dequantizer's order) then 16 bytes
//       of padding, which makes a warp's 16-byte reads of 32 consecutive chunks conflict-free;
//   xscale [n_chunks]: 2^-e_c, the factor that undoes the chunk's scaling;
//   xsum [n_chunks] (INT4): Σ x of the chunk in fp32 (unrounded, unscaled: the min's term).
// Zeros from `in` to the padded width. Returns Σ x² (NORM; every thread must call: block barriers inside).
template <int C, bool INT4, bool NORM>
__device__ __forceinline__ float stage_x_f16(const float* __restrict__ x, const float* __restrict__ gain, int in,
                                             int n_chunks, unsigned int* __restrict__ xh, float* __restrict__ xscale,
                                             float* __restrict__ xsum) {
    bool vec = (in & 3) == 0;              // whole float4s (x is 16-byte aligned: a CuPy allocation)
    float ss = 0.0f;
    // Q_STAGE_BATCH x 16 values of x a thread loads before converting any: 1 = a chunk at a time (each of a
    // thread's chunks one L2 round trip after the other); more keeps several chunks' loads in flight. Same
    // values, same order of Σ x² either way.
    constexpr int R = Q_STAGE_BATCH * 16 / C > 1 ? Q_STAGE_BATCH * 16 / C : 1;
    int threads = blockDim.x;
    for (int c0 = threadIdx.x; c0 < n_chunks; c0 += R * threads) {
        float v[R][C];
#pragma unroll
        for (int r = 0; r < R; r++) {                    // chunk c0 is there (the loop's condition)
            int c = c0 + r * threads;
            if (r == 0 || c < n_chunks) load_x_chunk<C, NORM>(x, gain, in, c, vec, v[r], ss);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            int c = c0 + r * threads;
            if (r == 0 || c < n_chunks) store_x_chunk<C, INT4>(v[r], c, xh, xscale, xsum);
        }
    }
    if (NORM) ss = block_sum(ss);
    __syncthreads();
    return ss;
}

template <int STEP_CHUNKS>
struct Int8RowsHU {
    static constexpr int C = 16;
    static constexpr int U = STEP_CHUNKS;  // chunks in flight per lane per row (Q_U8 for every kernel but _3b's)
    static constexpr int XW = C / 2 + 4;   // 32-bit words of staged x per chunk (48 bytes)
    static constexpr bool CHUNK_SUMS = false;

    template <bool NORM>
    static __device__ __forceinline__ float stage(const float* x, const float* gain, int in, int n_chunks, float* smem) {
        unsigned int* xh = reinterpret_cast<unsigned int*>(smem);
        float* xscale = smem + (size_t)n_chunks * XW;
        return stage_x_f16<C, false, NORM>(x, gain, in, n_chunks, xh, xscale, nullptr);
    }

    static __device__ __forceinline__ void dot(const uint4* __restrict__ qw, const void* scales, const u16* mins,
                                               int n_chunks, int n_groups, int cpg, int cpg_shift,
                                               const float* smem, int ra, int rb, float& acc_a, float& acc_b) {
        int lane = threadIdx.x & 31;
        const unsigned int* xh = reinterpret_cast<const unsigned int*>(smem);
        const float* xscale = smem + (size_t)n_chunks * XW;
        float s_a = static_cast<const float*>(scales)[ra], s_b = static_cast<const float*>(scales)[rb];
        const uint4* wa = qw + (size_t)ra * n_chunks;
        const uint4* wb = qw + (size_t)rb * n_chunks;
        float a = 0.0f, b = 0.0f;
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
                    const uint4* x4 = reinterpret_cast<const uint4*>(xh + i * XW);
                    uint4 x0 = x4[0], x1 = x4[1];                 // 16 values of x: 8 pairs
                    unsigned int pa = 0u, pb = 0u;                // f16x2 (0, 0)
                    pa = dot4_i8_h2(va[u].x, x0.x, x0.y, pa); pb = dot4_i8_h2(vb[u].x, x0.x, x0.y, pb);
                    pa = dot4_i8_h2(va[u].y, x0.z, x0.w, pa); pb = dot4_i8_h2(vb[u].y, x0.z, x0.w, pb);
                    pa = dot4_i8_h2(va[u].z, x1.x, x1.y, pa); pb = dot4_i8_h2(vb[u].z, x1.x, x1.y, pb);
                    pa = dot4_i8_h2(va[u].w, x1.z, x1.w, pa); pb = dot4_i8_h2(vb[u].w, x1.z, x1.w, pb);
                    float down = xscale[i];
                    a = fmaf(f16x2_sum(pa), down, a);
                    b = fmaf(f16x2_sum(pb), down, b);
                }
            }
        }
        acc_a = warp_sum(a) * s_a;
        acc_b = warp_sum(b) * s_b;
    }
};

using Int8RowsH = Int8RowsHU<Q_U8>;

struct Int4RowsH {
    static constexpr int C = 32;
    static constexpr int U = Q_U4;
    static constexpr int XW = C / 2 + 4;   // 80 bytes of staged x per chunk
    static constexpr bool CHUNK_SUMS = true;

    template <bool NORM>
    static __device__ __forceinline__ float stage(const float* x, const float* gain, int in, int n_chunks, float* smem) {
        unsigned int* xh = reinterpret_cast<unsigned int*>(smem);
        float* xscale = smem + (size_t)n_chunks * XW;
        return stage_x_f16<C, true, NORM>(x, gain, in, n_chunks, xh, xscale, xscale + n_chunks);
    }

    static __device__ __forceinline__ void dot(const uint4* __restrict__ qw, const void* scales,
                                               const u16* __restrict__ mins, int n_chunks, int n_groups, int cpg,
                                               int cpg_shift, const float* smem, int ra, int rb,
                                               float& acc_a, float& acc_b) {
        int lane = threadIdx.x & 31;
        const unsigned int* xh = reinterpret_cast<const unsigned int*>(smem);
        const float* xscale = smem + (size_t)n_chunks * XW;
        const float* xsum = xscale + n_chunks;
        // scales and mins of both rows by 32-bit element offsets from the arrays' bases (cheaper addresses)
        const u16* S = static_cast<const u16*>(scales);
        unsigned int off_a = (unsigned int)ra * n_groups, off_b = (unsigned int)rb * n_groups;
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
                    unsigned int g = cpg_shift >= 0 ? (unsigned int)i >> cpg_shift : (unsigned int)(i / cpg);
                    s_a[u] = S[off_a + g];                             // the chunk's group's scales and mins
                    m_a[u] = mins[off_a + g];
                    s_b[u] = S[off_b + g];
                    m_b[u] = mins[off_b + g];
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = base + 32 * u + lane;
                if (i < n_chunks) {
                    const uint4* x4 = reinterpret_cast<const uint4*>(xh + i * XW);
                    unsigned int pa = 0u, pb = 0u;
                    uint4 xq = x4[0];                                       // values 0..7 of the chunk
                    pa = dot8_i4_h2(va[u].x, xq, pa); pb = dot8_i4_h2(vb[u].x, xq, pb);
                    xq = x4[1];
                    pa = dot8_i4_h2(va[u].y, xq, pa); pb = dot8_i4_h2(vb[u].y, xq, pb);
                    xq = x4[2];
                    pa = dot8_i4_h2(va[u].z, xq, pa); pb = dot8_i4_h2(vb[u].z, xq, pb);
                    xq = x4[3];
                    pa = dot8_i4_h2(va[u].w, xq, pa); pb = dot8_i4_h2(vb[u].w, xq, pb);
                    float down = xscale[i], X = xsum[i], X8 = 8.0f * X;     // 2^-e_c, Σ x of the chunk
                    // s·(Σ(n - 8)·x + 8·Σx) + m·Σx
                    acc_a = fmaf(F16::to_float(s_a[u]), fmaf(f16x2_sum(pa), down, X8),
                                 fmaf(F16::to_float(m_a[u]), X, acc_a));
                    acc_b = fmaf(F16::to_float(s_b[u]), fmaf(f16x2_sum(pb), down, X8),
                                 fmaf(F16::to_float(m_b[u]), X, acc_b));
                }
            }
        }
        acc_a = warp_sum(acc_a);
        acc_b = warp_sum(acc_b);
    }
};

// ---- the kernel -----------------------------------------------------------------------------------------
template <class F, class W, bool NORM, int EPI>
__device__ __forceinline__ void gemv_quant(const uint4* __restrict__ qw, const void* __restrict__ scales,
                                           const u16* __restrict__ mins, int n_chunks, int n_groups, int cpg,
                                           int cpg_shift, const float* __restrict__ x, const float* __restrict__ gain,
                                           float eps, int in, int pairs, int rows, const Epilogue<W>& ep) {
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);                    // x as the format stages it (F::stage)
    int lane = threadIdx.x & 31;
    int first = blockIdx.x * Q_WARPS + (threadIdx.x >> 5);            // this warp's first row pair
    int stride = gridDim.x * Q_WARPS;                                  // ... and the distance to its next
    prefetch_pair<EPI, F::CHUNK_SUMS>(first, pairs, rows, ep.hd, qw, n_chunks, scales, mins, n_groups);  // during the staging
    pdl_wait_then_trigger();                  // x is the last kernel's output: the prefetch above was not

    float ss = F::template stage<NORM>(x, gain, in, n_chunks, smem);
    float inv_rms = NORM ? rsqrtf(ss / (float)in + eps) : 1.0f;

    RowPair r;
    for (int p = first; p < pairs; p += stride) {                      // warp-uniform
        if (!row_pair<EPI>(p, rows, ep.hd, r)) break;
        float acc_a, acc_b;
        F::dot(qw, scales, mins, n_chunks, n_groups, cpg, cpg_shift, smem, r.ra, r.rb, acc_a, acc_b);
        if (lane == 0) ep.template store<EPI>(r, p, acc_a * inv_rms, acc_b * inv_rms);
    }
}

// grid (any; the launcher: ~2 blocks per SM), block (32 * Q_WARPS = 256), dynamic shared memory
// n_chunks * (C / 2 + 5) * 4 bytes (+ n_chunks * 4 for int4). One signature for both formats and every variant:
//   qw [rows, n_chunks] 16-byte chunks; scales: fp32 [rows] (int8) or fp16 [rows, n_groups] (int4);
//   mins fp16 [rows, n_groups] (int4; int8: any pointer); cpg = chunks per group (g / 32), cpg_shift its
//   log2 or -1; x [in] fp32; gain [in] fp32 (NORM); pairs = ceil(rows / 2) (PLAIN), rows / 2 (SWIGLU, QKV);
//   y and the QKV arguments as in gemv.cu v4 (gemv_epilogue.cuh).
#define GEMV_QUANT_KERNEL(NAME, F, W, NORM, EPI) GEMV_QUANT_KERNEL_AT(NAME, F, W, NORM, EPI, Q_MIN_BLOCKS)
#define GEMV_QUANT_KERNEL_AT(NAME, F, W, NORM, EPI, MIN_BLOCKS)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * Q_WARPS, MIN_BLOCKS) NAME(                                 \
        const uint4* qw, const void* scales, const u16* mins, int n_chunks, int n_groups, int cpg, int cpg_shift,\
        const float* x, const float* gain, float eps, int in, int pairs, float* y, int rows, int accumulate,     \
        u16* k_cache, u16* v_cache, int capacity, const int* pos, const float* inv_freq, int n_heads,            \
        int n_kv_heads, int hd) {                                                                               \
        Epilogue<W> ep{y, accumulate, k_cache, v_cache, capacity, pos, inv_freq, n_heads, n_kv_heads, hd};       \
        gemv_quant<F, W, NORM, EPI>(qw, scales, mins, n_chunks, n_groups, cpg, cpg_shift, x, gain, eps, in,    \
                                    pairs, rows, ep);                                                            \
    }
GEMV_QUANT_KERNEL(gemv_int8_f16, Int8RowsH, F16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_int8_bf16, Int8RowsH, BF16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_rmsnorm_int8_f16, Int8RowsH, F16, true, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_rmsnorm_int8_bf16, Int8RowsH, BF16, true, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_swiglu_int8_f16, Int8RowsH, F16, false, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_swiglu_int8_bf16, Int8RowsH, BF16, false, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_rmsnorm_swiglu_int8_f16, Int8RowsH, F16, true, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_rmsnorm_swiglu_int8_bf16, Int8RowsH, BF16, true, EPI_SWIGLU)
GEMV_QUANT_KERNEL_AT(gemv_qkv_int8_3b_f16, Int8RowsHU<Q_QKV_U8>, F16, false, EPI_QKV, Q_QKV_MIN_BLOCKS)
GEMV_QUANT_KERNEL_AT(gemv_qkv_int8_3b_bf16, Int8RowsHU<Q_QKV_U8>, BF16, false, EPI_QKV, Q_QKV_MIN_BLOCKS)
GEMV_QUANT_KERNEL_AT(gemv_rmsnorm_qkv_int8_3b_f16, Int8RowsHU<Q_QKV_U8>, F16, true, EPI_QKV, Q_QKV_MIN_BLOCKS)
GEMV_QUANT_KERNEL_AT(gemv_rmsnorm_qkv_int8_3b_bf16, Int8RowsHU<Q_QKV_U8>, BF16, true, EPI_QKV, Q_QKV_MIN_BLOCKS)
GEMV_QUANT_KERNEL(gemv_int4_f16, Int4RowsH, F16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_int4_bf16, Int4RowsH, BF16, false, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_rmsnorm_int4_f16, Int4RowsH, F16, true, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_rmsnorm_int4_bf16, Int4RowsH, BF16, true, EPI_PLAIN)
GEMV_QUANT_KERNEL(gemv_swiglu_int4_f16, Int4RowsH, F16, false, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_swiglu_int4_bf16, Int4RowsH, BF16, false, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_rmsnorm_swiglu_int4_f16, Int4RowsH, F16, true, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_rmsnorm_swiglu_int4_bf16, Int4RowsH, BF16, true, EPI_SWIGLU)
GEMV_QUANT_KERNEL(gemv_qkv_int4_f16, Int4RowsH, F16, false, EPI_QKV)
GEMV_QUANT_KERNEL(gemv_qkv_int4_bf16, Int4RowsH, BF16, false, EPI_QKV)
GEMV_QUANT_KERNEL(gemv_rmsnorm_qkv_int4_f16, Int4RowsH, F16, true, EPI_QKV)
GEMV_QUANT_KERNEL(gemv_rmsnorm_qkv_int4_bf16, Int4RowsH, BF16, true, EPI_QKV)
// ---- prefill: the whole matrix back to 16 bits for cuBLAS ---------------------------------------------------
// out [rows, in] 16-bit = W, 8 consecutive elements of a row per thread (one 16-byte store when in % 8 == 0).
// An int4 run of 8 is one 32-bit word of codes in one group (c0 % 8 == 0, g % 32 == 0).
template <class W, bool INT4>
__device__ void dequantize(const unsigned char* __restrict__ q, const void* __restrict__ scales,
                           const u16* __restrict__ mins, int row_bytes, int n_groups, int group, u16* __restrict__ out,
                           int rows, int in) {
    int per_row = (in + 7) >> 3;
    size_t n = (size_t)rows * per_row;
    for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (size_t)gridDim.x * blockDim.x) {
        int r = (int)(t / per_row);
        int c0 = (int)(t - (size_t)r * per_row) * 8;
        const unsigned char* row = q + (size_t)r * row_bytes;
        float v[8];
        if (INT4) {
            unsigned int w = *reinterpret_cast<const unsigned int*>(row + c0 / 2);
            size_t g = (size_t)r * n_groups + c0 / group;
            float s = F16::to_float(static_cast<const u16*>(scales)[g]), m = F16::to_float(mins[g]);
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = (float)((w >> (4 * k)) & 15u) * s + m;
        } else {
            uint2 b = *reinterpret_cast<const uint2*>(row + c0);
            float s = static_cast<const float*>(scales)[r];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                unsigned int word = k < 4 ? b.x : b.y;
                v[k] = (float)(signed char)((word >> (8 * (k & 3))) & 0xFFu) * s;
            }
        }
        u16* dst = out + (size_t)r * in + c0;
        if ((in & 7) == 0) {
            uint4 packed;
            packed.x = W::from_float(v[0]) | ((unsigned int)W::from_float(v[1]) << 16);
            packed.y = W::from_float(v[2]) | ((unsigned int)W::from_float(v[3]) << 16);
            packed.z = W::from_float(v[4]) | ((unsigned int)W::from_float(v[5]) << 16);
            packed.w = W::from_float(v[6]) | ((unsigned int)W::from_float(v[7]) << 16);
            *reinterpret_cast<uint4*>(dst) = packed;
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (c0 + k < in) dst[k] = W::from_float(v[k]);
        }
    }
}

// grid (any), block (256): q, scales (, mins) as for the GEMV (row_bytes = n_chunks * 16) -> out [rows, in]
#define DEQUANT_KERNEL(NAME, W, INT4)                                                                            \
    extern "C" __global__ void NAME(const unsigned char* q, const void* scales, const u16* mins, int row_bytes,  \
                                    int n_groups, int group, u16* out, int rows, int in) {                       \
        dequantize<W, INT4>(q, scales, mins, row_bytes, n_groups, group, out, rows, in);                        \
    }
DEQUANT_KERNEL(dequant_int8_f16, F16, false)
DEQUANT_KERNEL(dequant_int8_bf16, BF16, false)
DEQUANT_KERNEL(dequant_int4_f16, F16, true)
DEQUANT_KERNEL(dequant_int4_bf16, BF16, true)

// Random codes for benchmarks, made on the device: out [n] 32-bit words = hash_u32(k, seed).
extern "C" __global__ void fill_random_words(unsigned int* out, unsigned long long n, unsigned int seed) {
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x)
        out[k] = hash_u32(k, seed);
}
