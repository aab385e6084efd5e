// rope.cu: rotary position embedding on the queries and keys, in place, HF's half-split layout:
//   (x[i], x[i + hd/2]) -> (x[i]·cos - x[i + hd/2]·sin, x[i + hd/2]·cos + x[i]·sin),  angle = pos · inv_freq[i]
//
// CPU reference: minillm.model.layers.rope_tables + apply_rope. inv_freq [hd/2] comes from the CPU model (so
// Llama-3 / linear scaling are already folded in). The position is read from a device buffer, not passed
// as an argument: a CUDA graph captures argument values, so a captured decode step would otherwise
// replay position 0 forever. Token t of this call sits at position pos[0] + t.
//
// v1 (this file): one block per (token, head), one thread per rotation pair; q heads and k heads are one
// contiguous run of n_heads + n_kv_heads heads inside the fused qkv row, so one launch covers both.
// cos/sin are computed in fp32 from an fp32 angle (as HF does), with the precise cosf/sinf.
#include "common.cuh"

// grid (T, n_heads + n_kv_heads), block (hd / 2)
// qkv: [T, row_stride] fp32, each row = q heads | k heads | v heads (hd floats each)
extern "C" __global__ void rope_qk(float* qkv, int row_stride, int hd, const int* pos, const float* inv_freq) {
    int t = blockIdx.x, head = blockIdx.y, i = threadIdx.x, half = hd / 2;
    if (i >= half) return;
    float angle = (float)(pos[0] + t) * inv_freq[i];
    float c = cosf(angle), s = sinf(angle);
    float* v = qkv + (size_t)t * row_stride + (size_t)head * hd;
    float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
}
