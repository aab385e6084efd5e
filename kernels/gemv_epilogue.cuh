// gemv_epilogue.cuh: what every "row pair per warp" GEMV shares (gemv.cu v4 over 16-bit weights,
// gemv_quant.cu over int8/int4): the streaming weight load, which two rows a warp computes for each
// epilogue, and the epilogues that turn the two dot products into the decode step's outputs.
//
//   EPI_PLAIN : rows (2p, 2p+1), y = acc or y += acc (the residual add of o_proj and down_proj).
//   EPI_SWIGLU: rows (i, ffn + i) of the [gate; up] matrix -> y[i] = silu(gate)·up (swiglu.cu's formula):
//               the gate/up vector never goes to memory and the swiglu launch is gone.
//   EPI_QKV   : rows (head·hd + j, head·hd + j + hd/2) of the fused q|k|v matrix: RoPE (rope.cu's formula)
//               on q and k heads, the whole rotated row to y (attention reads q there), and k and v
//               narrowed into the KV cache at pos[0] (kv_append.cu): rope and kv_append gone.
#pragma once
#include "common.cuh"

#define EPI_PLAIN 0
#define EPI_SWIGLU 1
#define EPI_QKV 2

// A weight load that streams past L1 (read once per token; L1 stays free for x and the gain).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The two rows of row pair p. has_b is false only for the last pair of an odd PLAIN matrix, which then
// reads row a twice (rb = ra) and stores once.
struct RowPair {
    int ra, rb;
    int head, j;        // EPI_QKV: the head and the rotation pair inside it
    bool has_b;
};

// false when p is past the last pair (callers launch whole warps per pair, so this is warp-uniform)
template <int EPI>
__device__ __forceinline__ bool row_pair(int p, int rows, int hd, RowPair& r) {
    r.head = 0;
    r.j = 0;
    r.has_b = true;
    if (EPI == EPI_PLAIN) {
        r.ra = 2 * p;
        if (r.ra >= rows) return false;
        r.rb = r.ra + 1;
        r.has_b = r.rb < rows;
        if (!r.has_b) r.rb = r.ra;
    } else if (EPI == EPI_SWIGLU) {
        int ffn = rows >> 1;
        if (p >= ffn) return false;
        r.ra = p;
        r.rb = p + ffn;
    } else {
        int half = hd >> 1;
        if (2 * p >= rows) return false;
        r.head = p / half;
        r.j = p - r.head * half;
        r.ra = r.head * hd + r.j;
        r.rb = r.ra + half;
    }
    return true;
}

// Where the results go. The QKV fields (one layer's k_cache, v_cache [n_kv_heads, capacity, hd] in the
// weight dtype W, the position pos[0], inv_freq [hd / 2]) are unused by the other epilogues.
template <class W>
struct Epilogue {
    float* y;
    int accumulate;
    u16* k_cache;
    u16* v_cache;
    int capacity;
    const int* pos;
    const float* inv_freq;
    int n_heads, n_kv_heads, hd;

    // acc_a, acc_b: the finished dot products of rows ra and rb (one lane calls this)
    template <int EPI>
    __device__ __forceinline__ void store(const RowPair& r, int p, float acc_a, float acc_b) const {
        if (EPI == EPI_PLAIN) {
            y[r.ra] = accumulate ? y[r.ra] + acc_a : acc_a;
            if (r.has_b) y[r.rb] = accumulate ? y[r.rb] + acc_b : acc_b;
        } else if (EPI == EPI_SWIGLU) {
            float g = acc_a, u = acc_b;
            y[p] = g / (1.0f + expf(-g)) * u;
        } else {
            int P = pos[0];
            float x1 = acc_a, x2 = acc_b;
            if (r.head < n_heads + n_kv_heads) {                           // q and k heads rotate
                float angle = (float)P * inv_freq[r.j];
                float c = cosf(angle), s = sinf(angle);
                x1 = acc_a * c - acc_b * s;
                x2 = acc_b * c + acc_a * s;
            }
            y[r.ra] = x1;
            y[r.rb] = x2;
            if (r.head >= n_heads && P < capacity) {                       // k or v head: into the cache
                bool is_k = r.head < n_heads + n_kv_heads;
                int kvh = is_k ? r.head - n_heads : r.head - n_heads - n_kv_heads;
                u16* cache = is_k ? k_cache : v_cache;
                size_t dst = ((size_t)kvh * capacity + P) * hd + r.j;
                cache[dst] = W::from_float(x1);
                cache[dst + (hd >> 1)] = W::from_float(x2);
            }
        }
    }
};
