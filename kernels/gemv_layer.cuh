// gemv_layer.cuh: a decoder layer's four quantized GEMVs as ONE kernel (an experiment: dev/layer.py).
//
// The decode step launches a kernel per GEMV; each launch pays a ramp (its first HBM round trip) and a tail
// (its last, partly filled wave) that programmatic dependent launch only partly overlaps. Here one grid of
// resident blocks (2 an SM) runs the layer's GEMVs as phases, a grid barrier between them instead of a kernel
// boundary; each phase still asks L2 for its first weights before its barrier, as before a PDL wait:
//
//   phase 0  norm + qkv + RoPE + KV append   (waits for the kernel ahead: PDL)
//   phase 1  o (+ residual)                  decode attention, which sits between qkv and o, is left out,
//   phase 2  norm + gate_up + SwiGLU         as dev.chain's "without attention" step leaves it out of the
//   phase 3  down (+ residual)               engine's: the two time the GEMVs' chain alone
//
// Each phase is gemv_quant() with the arguments the launcher gives that GEMV's own kernel: `args` holds them as
// LAYER_ARGS 64-bit words a phase, in _quant_args' order (pointers, integers, eps as its float bits), so every
// pair is computed by the same code and arithmetic as in the engine: the logits must match its, bit for bit.
// dev/layer.py compiles this after gemv_quant.cu with -DQ_X_COHERENT (x read from L2: an earlier phase of the
// same kernel wrote it, and an SM's L1 may still hold the lines it read before).
#pragma once

#define LAYER_ARGS 24        // words a phase

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

// grid (2 blocks an SM, all resident), block (32 * Q_WARPS), dynamic shared memory: the widest
// phase's (down's) staged x. args [phases][LAYER_ARGS]; grid_bar {0, any} (grid_barrier).
#define GEMV_LAYER_KERNEL(NAME, F)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * Q_WARPS, Q_MIN_BLOCKS) NAME(                               \
        const unsigned long long* args, unsigned int* grid_bar) {                                              \
        gemv_phase<F, true, EPI_QKV>(args, nullptr);                                                           \
        gemv_phase<F, false, EPI_PLAIN>(args + LAYER_ARGS, grid_bar);                                          \
        gemv_phase<F, true, EPI_SWIGLU>(args + 2 * LAYER_ARGS, grid_bar);                                      \
        gemv_phase<F, false, EPI_PLAIN>(args + 3 * LAYER_ARGS, grid_bar);                                      \
    }
GEMV_LAYER_KERNEL(gemv_layer_int8, Int8RowsH)
GEMV_LAYER_KERNEL(gemv_layer_int4, Int4RowsH)
