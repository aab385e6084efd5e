// gemv_layer.cuh: a decoder layer as ONE kernel (an experiment: dev/layer.py).
//
// The decode step launches a kernel per GEMV and one for attention; each launch pays a ramp (its first HBM
// round trip) and a tail (its last, partly filled wave) that programmatic dependent launch only partly
// overlaps. Here one grid of resident blocks (2 an SM) runs the layer's kernels as phases, a grid barrier
// between them instead of a kernel boundary; each GEMV phase still asks L2 for its first weights before its
// barrier, as it does before a PDL wait:
//
//   phase 0  norm + qkv + RoPE + KV append   (waits for the kernel ahead: PDL)
//   phase 1  decode attention                (gemv_layer_attn_*; gemv_layer_* leave it out, as dev.chain's
//                                             "without attention" step does, to time the GEMVs' chain alone)
//   phase 2  o (+ residual)
//   phase 3  norm + gate_up + SwiGLU
//   phase 4  down (+ residual)
//
// Each phase is the engine's own device function (gemv_quant(), attention_gqa()) with the arguments the
// launcher gives that kernel: `args` holds them as LAYER_ARGS 64-bit words a phase, in the launch's order
// (pointers, integers, floats as their bits; attention's then the scratch's split stride), so every output is
// computed by the same code and arithmetic as in the engine's step: the logits must match its, bit for bit.
// dev/layer.py compiles this after gemv_quant.cu and decode_attention.cu, with -DQ_X_COHERENT (x read from L2:
// an earlier phase of the same kernel wrote it).
#pragma once

#define LAYER_ARGS 24        // words a phase
#define LAYER_GM 1           // query heads an attention block: attention_gqa<.., 4>'s 205 registers would spill

template <class F, bool NORM, int EPI>
__device__ __forceinline__ void gemv_phase(const unsigned long long* __restrict__ a, unsigned int* grid_bar) {
    Epilogue<F16> ep{reinterpret_cast<float*>(a[12]), (int)a[14], reinterpret_cast<u16*>(a[15]),
                     reinterpret_cast<u16*>(a[16]), (int)a[17], reinterpret_cast<const int*>(a[18]),
                     reinterpret_cast<const float*>(a[19]), (int)a[20], (int)a[21], (int)a[22]};
    NextWeights none{nullptr, 0ull, nullptr, 0ull, 0};
    gemv_quant<F, F16, NORM, EPI>(reinterpret_cast<const uint4*>(a[0]), reinterpret_cast<const void*>(a[1]),
                                  reinterpret_cast<const u16*>(a[2]), (int)a[3], (int)a[4], (int)a[5], (int)a[6],
                                  reinterpret_cast<const float*>(a[7]), reinterpret_cast<const float*>(a[8]),
                                  __uint_as_float((unsigned int)a[9]), (int)a[10], (int)a[11], (int)a[13], ep,
                                  (int)a[23], none, grid_bar);
}

// attention_gqa over the 16-bit cache for one query (T = 1), its (KV-head chunk, split) blocks dealt out over
// the persistent grid; the blocks past them go on to the o phase (and its L2 prefetch) at once. Words: the
// launch's 19 arguments (q .. out, scale as float bits), then the scratch's split stride.
__device__ __forceinline__ void attention_phase(const unsigned long long* __restrict__ a, unsigned int* grid_bar) {
    grid_barrier(grid_bar);                             // q and the newest key and value: phase 0's, every block's
    int n_heads = (int)a[5], n_kv_heads = (int)a[6], part_splits = (int)a[19];
    int x_blocks = n_kv_heads * ((n_heads / n_kv_heads + LAYER_GM - 1) / LAYER_GM);
    for (int b = blockIdx.x; b < x_blocks * part_splits; b += gridDim.x)        // block-uniform
        attention_gqa<KV16<F16>, LAYER_GM>(
            reinterpret_cast<const float*>(a[0]), (int)a[1], reinterpret_cast<const u16*>(a[2]),
            reinterpret_cast<const u16*>(a[3]), nullptr, nullptr, (int)a[4], n_heads, n_kv_heads, (int)a[7],
            reinterpret_cast<const int*>(a[8]), (int)a[9], __uint_as_float((unsigned int)a[10]), (int)a[11],
            (int)a[12], (int)a[13], reinterpret_cast<float*>(a[14]), reinterpret_cast<float*>(a[15]),
            reinterpret_cast<float*>(a[16]), reinterpret_cast<unsigned int*>(a[17]), reinterpret_cast<float*>(a[18]),
            GqaBlock{(unsigned int)(b % x_blocks), b / x_blocks, 0, part_splits});
}

// grid (2 blocks an SM, all resident), block (32 * Q_WARPS = GQA_THREADS), dynamic shared memory: the widest
// phase's (down's) staged x. args [phases][LAYER_ARGS]; grid_bar {0, any} (grid_barrier).
#define GEMV_LAYER_KERNEL(NAME, F)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * Q_WARPS, Q_MIN_BLOCKS) NAME(                               \
        const unsigned long long* args, unsigned int* grid_bar) {                                              \
        gemv_phase<F, true, EPI_QKV>(args, nullptr);                                                           \
        gemv_phase<F, false, EPI_PLAIN>(args + LAYER_ARGS, grid_bar);                                          \
        gemv_phase<F, true, EPI_SWIGLU>(args + 2 * LAYER_ARGS, grid_bar);                                      \
        gemv_phase<F, false, EPI_PLAIN>(args + 3 * LAYER_ARGS, grid_bar);                                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * Q_WARPS, Q_MIN_BLOCKS) NAME##_attn(                       \
        const unsigned long long* args, unsigned int* grid_bar) {                                              \
        gemv_phase<F, true, EPI_QKV>(args, nullptr);                                                           \
        attention_phase(args + LAYER_ARGS, grid_bar);                                                          \
        gemv_phase<F, false, EPI_PLAIN>(args + 2 * LAYER_ARGS, grid_bar);                                      \
        gemv_phase<F, true, EPI_SWIGLU>(args + 3 * LAYER_ARGS, grid_bar);                                      \
        gemv_phase<F, false, EPI_PLAIN>(args + 4 * LAYER_ARGS, grid_bar);                                      \
    }
GEMV_LAYER_KERNEL(gemv_layer_int8, Int8RowsH)
GEMV_LAYER_KERNEL(gemv_layer_int4, Int4RowsH)
