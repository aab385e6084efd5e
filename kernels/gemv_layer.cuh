// gemv_layer.cuh: a decoder layer's four quantized GEMVs as ONE kernel (an experiment: dev/layer.py).
//
// The decode step launches a kernel per GEMV; each launch pays a ramp (its first HBM round trip) and a tail
// (its last, partly filled wave) that programmatic dependent launch only partly overlaps. Here one grid of
// resident blocks (2 an SM) runs the layer's GEMVs as phases, a grid barrier between them instead of a kernel
// boundary; each phase's first weights are still asked of L2 before its barrier, as before a PDL wait:
//
//   phase 0  norm + qkv + RoPE + KV append   (waits for the kernel ahead: PDL)
//   phase 1  o (+ residual)                  (attention, which sits between qkv and o, is left out: the
//   phase 2  norm + gate_up + SwiGLU          experiment times the GEMVs' chain against the engine's own
//   phase 3  down (+ residual)                step with attention left out, dev.chain's "without attention")
//
// Each phase is gemv_quant() with the arguments the launcher would give that GEMV's own kernel: `args` holds
// them as 4 x 24 64-bit words in _quant_args' order (pointers, integers, eps as its float bits), so every pair
// is computed by the same code and arithmetic as in the engine: the logits must match its, bit for bit.
// Compiled only with -DQ_LAYER_KERNELS -DQ_X_COHERENT (x read from L2: an earlier phase wrote it).
#pragma once

#define LAYER_ARGS 24        // words a phase

template <class F, class W, bool NORM, int EPI>
__device__ __forceinline__ void gemv_phase(const unsigned long long* __restrict__ a, unsigned int* grid_bar) {
    Epilogue<W> ep{reinterpret_cast<float*>(a[12]), (int)a[14], reinterpret_cast<u16*>(a[15]),
                   reinterpret_cast<u16*>(a[16]), (int)a[17], reinterpret_cast<const int*>(a[18]),
                   reinterpret_cast<const float*>(a[19]), (int)a[20], (int)a[21], (int)a[22]};
    NextWeights none{nullptr, 0ull, nullptr, 0ull, 0};
    gemv_quant<F, W, NORM, EPI>(reinterpret_cast<const uint4*>(a[0]), reinterpret_cast<const void*>(a[1]),
                                reinterpret_cast<const u16*>(a[2]), (int)a[3], (int)a[4], (int)a[5], (int)a[6],
                                reinterpret_cast<const float*>(a[7]), reinterpret_cast<const float*>(a[8]),
                                __uint_as_float((unsigned int)a[9]), (int)a[10], (int)a[11], (int)a[13], ep,
                                (int)a[23], none, grid_bar);
}

// grid (2 blocks an SM, all resident), block (32 * Q_WARPS), dynamic shared memory: the widest phase's (down's)
// staged x. args [4][LAYER_ARGS]; grid_bar {0, any} (grid_barrier).
#define GEMV_LAYER_KERNEL(NAME, F)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * Q_WARPS, Q_MIN_BLOCKS) NAME(                               \
        const unsigned long long* args, unsigned int* grid_bar) {                                              \
        gemv_phase<F, F16, true, EPI_QKV>(args, nullptr);                                                      \
        gemv_phase<F, F16, false, EPI_PLAIN>(args + LAYER_ARGS, grid_bar);                                     \
        gemv_phase<F, F16, true, EPI_SWIGLU>(args + 2 * LAYER_ARGS, grid_bar);                                 \
        gemv_phase<F, F16, false, EPI_PLAIN>(args + 3 * LAYER_ARGS, grid_bar);                                 \
    }
GEMV_LAYER_KERNEL(gemv_layer_int8_f16, Int8RowsH)
GEMV_LAYER_KERNEL(gemv_layer_int4_f16, Int4RowsH)
