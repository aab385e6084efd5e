// sampling.cu: greedy sampling on the device. The batching engine's greedy steps pick each row's next token
// here and copy back B int32 ids instead of the logits [B, vocab] fp32 (8 MB at 64 rows of a 32k vocabulary).
//
// CPU reference: np.argmax on each row, the Sampler's greedy pick, exactly: the FIRST index of the maximum,
// and in a row holding any NaN the index of its first NaN (NumPy ranks NaN above every number). The NumPy
// model of this kernel's scan and reduction: minillm.cuda.dev.sampling.argmax_rows_reference.
//
// v1 (this file): one block per row. Thread t scans indices t, t + blockDim, t + 2·blockDim, ... (each step
// one coalesced load for the block), keeping its best (value, index); then the block reduces those pairs,
// by warp shuffles and then one warp over the warps' winners. Every comparison uses one total order, so
// the winner is the same whatever order the reduction takes (deterministic):
//     a NaN beats every number; of two NaNs, the lower index wins;
//     else the larger value wins; of two equal values (-0.0 == 0.0 too), the lower index wins.
// A thread with no index (vocab < blockDim) holds (-inf, INT_MAX): every real entry beats it, an all -inf
// row included (np.argmax gives 0 there).
#include "common.cuh"

#define NO_INDEX 0x7fffffff

// Does (a, ia) come before (b, ib) in the order above? (x != x: NaN, with no header for isnan.)
__device__ __forceinline__ bool argmax_beats(float a, int ia, float b, int ib) {
    bool a_nan = a != a, b_nan = b != b;
    if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
    return a > b || (a == b && ia < ib);
}

// Every lane of the warp ends with the warp's best pair (a butterfly: the order is associative and total).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_beats(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// grid (rows), block (a multiple of 32, <= 1024): logits [rows, vocab] fp32 -> ids [rows] int32
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ ids) {
    __shared__ float warp_v[32];
    __shared__ int warp_i[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = NEG_INF;
    int i = NO_INDEX;
    for (int k = threadIdx.x; k < vocab; k += blockDim.x) {
        float x = row[k];
        if (argmax_beats(x, k, v, i)) { v = x; i = k; }
    }
    warp_argmax(v, i);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { warp_v[warp] = v; warp_i[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        bool real = lane < (int)(blockDim.x >> 5);
        v = real ? warp_v[lane] : NEG_INF;
        i = real ? warp_i[lane] : NO_INDEX;
        warp_argmax(v, i);
        if (lane == 0) ids[blockIdx.x] = i;
    }
}
