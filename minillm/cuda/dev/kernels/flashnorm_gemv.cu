// flashnorm_gemv.cu: FlashNorm on the GPU, for weights whose RMSNorm gains are folded in (all-ones norms).
//
// CPU reference: minillm.model.flashnorm.deferred_linear and deferred_swiglu (fp32). Prop. 2: the projection of
// the raw x and the reduction 1/RMS(x) = rsqrt(mean(x^2) + eps) do not depend on each other; one fp32 scale
// per token (row) joins them at the end.
//
// The two-stream path (minillm/cuda/dev/flashnorm.py) runs the projection as an ordinary GEMV or cuBLAS GEMM
// on one stream and these small kernels around it:
//   flashnorm_inv_rms     s[t] = rsqrt(mean_i x[t, i]^2 + eps)           on the second stream
//   flashnorm_scale_rows  out[t, r] = y[t, r] * s[t]                    after the join (waits on both)
//   flashnorm_spin        busy-waits a number of nanoseconds on its stream: a stand-in for a matmul stream
//                         kept busy by other work. The tests put it before the projection to prove the join
//                         is explicit (nothing may change); lesson 15 uses it to make the race certain.
//
// The fused decode kernels (one launch instead of three, no second stream needed):
// v1 flashnorm_gemv_*: y[r] (+)= (sum_k W*[r, k] x[k]) * rsqrt(sum_k x[k]^2 / in + eps).
//     One warp per pair of rows, FN_U sixteen-byte weight loads in flight per lane per row (the decode GEMV
//     is a memory stream: bytes in flight are what keep HBM busy); whole steps of 32 x FN_U chunks without
//     bounds checks, then one checked step for the ragged end (a first version checked every chunk and
//     ran 11% slower at Mistral-7B's shape). Each lane loads its 8 activations as two
//     float4 and uses the same registers twice: for the dot products and for the sum of squares. So the
//     reduction costs no extra pass over x, no shared memory and no block barrier, and the only trace of
//     the norm is one fp32 multiply in the epilogue. gemv.cu's v4 NORM variant also sums x^2 in-flight but
//     multiplies every x[k] by gain[k] inside the loop (an extra read stream); here the gain lives in W*,
//     and the normalized vector is never formed: the multiply-adds run on raw x, then scale.
//     Every warp reduces x itself, in the same order, so every row sees the same bits of 1/RMS.
//   flashnorm_gemv_swiglu_*: rows (i, ffn + i) of [W_gate*; W_up*] -> act[i] = silu(s * g_i) * u_i, with u_i
//     NOT scaled: the up path's 1/RMS is deferred past the product and through the down projection
//     (linear, no bias), and s is written to inv_rms_out[0] for it.
//   gemv_scaled_*: y[r] (+)= scale[0] * sum_k W[r, k] act[k]: that down projection, applying the deferred s.
//   flashnorm_gemv_qkv_*: the stacked q|k|v matrix with gemv.cu's QKV epilogue (gemv_epilogue.cuh) on s * acc:
//     RoPE on the q and k heads, the rotated row to y, k and v into the KV cache at pos[0]. With it a decode
//     layer on folded weights is as many launches as gemv.cu v4's (minillm/cuda/dev/flashnorm.py, --e2e).
//
// No GEMM (prefill) variant, deliberately: at T = 512 tokens the projection is a tensor-core GEMM that
// cuBLAS runs near the matrix-unit peak, and the RMS reduction reads T x dim floats once (8 MB at
// Mistral-7B's shape: a few µs of HBM time next to ~100 µs of GEMM per layer). Fusing the sum of squares
// into the GEMM's A-tile loads (and the scale into its epilogue) means writing our own wgmma GEMM; the
// benchmark's prefill rows (unfused vs projection alone) bound what it could save.
//
// Requires in % 8 == 0 and 16-byte-aligned rows and x (the launcher checks in % 8).
#include "common.cuh"
// gemv_epilogue.cuh: RowPair, row_pair, Epilogue (the QKV epilogue: RoPE + KV append)
#include "gemv_epilogue.cuh"

#define FN_U 8              // 16-byte weight loads in flight per lane per row (x 2 rows: 8 KB a warp)
#define FN_WARPS 4          // row pairs per block (block = 128 threads)
#define FN_PLAIN 0          // y (+)= s * acc
#define FN_SWIGLU 1         // act = silu(s * gate) * up
#define FN_SCALED 2         // y (+)= scale[0] * acc (no norm of its own)
#define FN_QKV 3            // gemv_epilogue.cuh's EPI_QKV on s * acc: RoPE, y, KV append

// A weight load that bypasses L1: each weight is used once per token; L1 stays for x.
__device__ __forceinline__ uint4 fn_ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <class W>
__device__ __forceinline__ float fn_dot8(uint4 w, float4 a, float4 b) {
    return W::lo(w.x) * a.x + W::hi(w.x) * a.y + W::lo(w.y) * a.z + W::hi(w.y) * a.w
         + W::lo(w.z) * b.x + W::hi(w.z) * b.y + W::lo(w.w) * b.z + W::hi(w.w) * b.w;
}

// One 16-byte chunk i of both rows: raw x (no gain, no 1/RMS yet) into the dot products, and, from the
// same registers, into the sum of squares.
template <class W, bool SUM_SQUARES>
__device__ __forceinline__ void fn_step(uint4 wa, uint4 wb, const float4* __restrict__ x4, int i, float& acc_a,
                                        float& acc_b, float& ss) {
    float4 a = x4[2 * i], b = x4[2 * i + 1];
    if (SUM_SQUARES)
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
    acc_a += fn_dot8<W>(wa, a, b);
    acc_b += fn_dot8<W>(wb, a, b);
}

template <class W, int EPI>
__device__ __forceinline__ void flashnorm_gemv(const u16* __restrict__ w, const float* __restrict__ x, float eps,
                                               const float* __restrict__ scale, float* __restrict__ y, int rows,
                                               int in, int accumulate, float* __restrict__ inv_rms_out,
                                               const Epilogue<W>* qkv) {
    int lane = threadIdx.x & 31;
    int p = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);      // this warp's row pair
    int ra, rb;
    bool has_b = true;
    RowPair pair = {0, 0, 0, 0, true};                                 // FN_QKV: the rotation pair's rows
    if (EPI == FN_QKV) {
        if (!row_pair<EPI_QKV>(p, rows, qkv->hd, pair)) return;        // whole warp: uniform
        ra = pair.ra;
        rb = pair.rb;
    } else if (EPI == FN_SWIGLU) {
        if (p >= rows >> 1) return;                                    // whole warp: uniform
        ra = p;
        rb = p + (rows >> 1);
    } else {
        ra = 2 * p;
        if (ra >= rows) return;
        rb = ra + 1;
        has_b = rb < rows;
        if (!has_b) rb = ra;                                           // odd rows: read row a twice, store once
    }
    const uint4* wa = reinterpret_cast<const uint4*>(w + (size_t)ra * in);
    const uint4* wb = reinterpret_cast<const uint4*>(w + (size_t)rb * in);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int n8 = in >> 3;                                                  // 16-byte chunks per row
    float acc_a = 0.0f, acc_b = 0.0f, ss = 0.0f;
    int base = 0;
    for (; base + 32 * FN_U <= n8; base += 32 * FN_U) {               // whole steps: no bounds checks
        uint4 va[FN_U], vb[FN_U];
#pragma unroll
        for (int u = 0; u < FN_U; u++) {                               // all loads issued before any math
            va[u] = fn_ld_stream(wa + base + 32 * u + lane);
            vb[u] = fn_ld_stream(wb + base + 32 * u + lane);
        }
#pragma unroll
        for (int u = 0; u < FN_U; u++)
            fn_step<W, EPI != FN_SCALED>(va[u], vb[u], x4, base + 32 * u + lane, acc_a, acc_b, ss);
    }
    if (base < n8) {                                                   // the ragged end (in % 2048 != 0)
        uint4 va[FN_U], vb[FN_U];
#pragma unroll
        for (int u = 0; u < FN_U; u++) {
            int i = base + 32 * u + lane;
            va[u] = i < n8 ? fn_ld_stream(wa + i) : make_uint4(0u, 0u, 0u, 0u);
            vb[u] = i < n8 ? fn_ld_stream(wb + i) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < FN_U; u++)
            if (base + 32 * u + lane < n8)
                fn_step<W, EPI != FN_SCALED>(va[u], vb[u], x4, base + 32 * u + lane, acc_a, acc_b, ss);
    }
    acc_a = warp_sum(acc_a);
    acc_b = warp_sum(acc_b);
    // The epilogue: one fp32 scale. (Not fp16: the un-normalized dot product may exceed its range.)
    float s = EPI == FN_SCALED ? scale[0] : rsqrtf(warp_sum(ss) / (float)in + eps);
    if (lane != 0) return;
    if (EPI == FN_QKV) {                                               // RoPE is linear: rotate s * acc
        qkv->template store<EPI_QKV>(pair, p, acc_a * s, acc_b * s);
        return;
    }
    if (EPI == FN_SWIGLU) {
        float g = acc_a * s;                                           // the gate is scaled before SiLU
        y[p] = g / (1.0f + expf(-g)) * acc_b;                          // the up path is not: deferred
        if (p == 0) inv_rms_out[0] = s;
        return;
    }
    acc_a *= s;
    acc_b *= s;
    y[ra] = accumulate ? y[ra] + acc_a : acc_a;
    if (has_b) y[rb] = accumulate ? y[rb] + acc_b : acc_b;
}

// grid (ceil(pairs / FN_WARPS)), block (32 * FN_WARPS = 128); pairs = ceil(rows / 2), or rows / 2 (SWIGLU).
//   w [rows, in] 16-bit (folded); x [in] fp32; y [rows] fp32, or [rows / 2] (SWIGLU: the activation);
//   scale [1] fp32 (SCALED); inv_rms_out [1] fp32 (SWIGLU). Unused pointers: any valid pointer.
#define FLASHNORM_KERNEL(NAME, W, EPI)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * FN_WARPS) NAME(                                            \
        const u16* w, const float* x, float eps, const float* scale, float* y, int rows, int in, int accumulate, \
        float* inv_rms_out) {                                                                                    \
        flashnorm_gemv<W, EPI>(w, x, eps, scale, y, rows, in, accumulate, inv_rms_out, nullptr);                 \
    }
FLASHNORM_KERNEL(flashnorm_gemv_f16, F16, FN_PLAIN)
FLASHNORM_KERNEL(flashnorm_gemv_bf16, BF16, FN_PLAIN)
FLASHNORM_KERNEL(flashnorm_gemv_swiglu_f16, F16, FN_SWIGLU)
FLASHNORM_KERNEL(flashnorm_gemv_swiglu_bf16, BF16, FN_SWIGLU)
FLASHNORM_KERNEL(gemv_scaled_f16, F16, FN_SCALED)
FLASHNORM_KERNEL(gemv_scaled_bf16, BF16, FN_SCALED)

// grid (ceil(rows / 2 / FN_WARPS)), block (128): rows = (n_heads + 2 n_kv_heads) * hd, one warp per rotation pair.
//   w [rows, in] 16-bit (folded q|k|v); x [in] fp32 raw; y [rows] fp32 (q, k rotated; v as is); k_cache, v_cache:
//   one layer [n_kv_heads, capacity, hd] in the weight dtype; pos [1] int32; inv_freq [hd / 2] fp32.
#define FLASHNORM_QKV_KERNEL(NAME, W)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * FN_WARPS) NAME(                                           \
        const u16* w, const float* x, float eps, float* y, int rows, int in, u16* k_cache, u16* v_cache,        \
        int capacity, const int* pos, const float* inv_freq, int n_heads, int n_kv_heads, int hd) {            \
        Epilogue<W> ep{y, 0, k_cache, v_cache, capacity, pos, inv_freq, n_heads, n_kv_heads, hd};             \
        flashnorm_gemv<W, FN_QKV>(w, x, eps, nullptr, y, rows, in, 0, nullptr, &ep);                           \
    }
FLASHNORM_QKV_KERNEL(flashnorm_gemv_qkv_f16, F16)
FLASHNORM_QKV_KERNEL(flashnorm_gemv_qkv_bf16, BF16)

// ---- the pieces of the two-stream path -------------------------------------------------------------

// grid (T), block (256): x [T, dim] fp32 -> s [T] fp32
extern "C" __global__ void flashnorm_inv_rms(const float* x, float* s, int dim, float eps) {
    const float* row = x + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += row[i] * row[i];
    float total = block_sum(ss);
    if (threadIdx.x == 0) s[blockIdx.x] = rsqrtf(total / (float)dim + eps);
}

// grid-stride over T * n: y [T, n] fp32, s [T] -> out [T, n] fp32 (out may be y)
extern "C" __global__ void flashnorm_scale_rows(const float* y, const float* s, float* out, int n, int T) {
    size_t total = (size_t)n * T;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
        out[i] = y[i] * s[i / n];
}

// grid (1), block (1): returns after `ns` nanoseconds of the GPU's global timer
extern "C" __global__ void flashnorm_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
