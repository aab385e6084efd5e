// common.cuh: the small helpers every minillm kernel shares (included textually by minillm/cuda/kernels.py,
// and by nvcc through the ordinary #include, so both compilers see the same code).
//
// Why no <cuda_fp16.h> / <cuda_bf16.h>: NVRTC only finds those headers when CuPy can point it at a CUDA
// toolkit, and a bare machine may not have one. A 16-bit float is just 16 bits, so weights and the KV
// cache travel as `unsigned short` and we convert with one PTX instruction (fp16) or a shift (bf16):
// exactly what the headers do, with nothing to include.
#pragma once

typedef unsigned short u16;

#define NEG_INF (__int_as_float(0xff800000))

// fp16 bits <-> fp32
struct F16 {
    static __device__ __forceinline__ float to_float(u16 h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ u16 from_float(float f) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));   // round to nearest even
        return h;
    }
    // two packed values in one 32-bit word; element 0 is the low half (little-endian)
    static __device__ __forceinline__ float lo(unsigned int w) { return to_float((u16)(w & 0xffffu)); }
    static __device__ __forceinline__ float hi(unsigned int w) { return to_float((u16)(w >> 16)); }
};

// bf16 bits <-> fp32: bf16 is the top half of an fp32
struct BF16 {
    static __device__ __forceinline__ float to_float(u16 b) { return __uint_as_float(((unsigned int)b) << 16); }
    static __device__ __forceinline__ u16 from_float(float f) {
        unsigned int bits = __float_as_uint(f);
        if ((bits & 0x7fffffffu) > 0x7f800000u) return (u16)((bits >> 16) | 0x0040u);   // NaN stays NaN
        bits += 0x7fffu + ((bits >> 16) & 1u);                                           // round half to even
        return (u16)(bits >> 16);
    }
    static __device__ __forceinline__ float lo(unsigned int w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
};

// Stores for templated outputs: fp32 as is, 16-bit through the type's rounding.
template <class T> struct Store;
template <> struct Store<float> { template <class W> static __device__ __forceinline__ void put(float* p, float v) { *p = v; } };
template <> struct Store<u16>   { template <class W> static __device__ __forceinline__ void put(u16* p, float v) { *p = W::from_float(v); } };

// Programmatic dependent launch (sm_90; minillm/cuda/pdl.py launches with it). A kernel launched with the
// PDL attribute may start while the kernel before it on the stream is still finishing; it must not touch
// that kernel's outputs before pdl_wait(), which returns once the previous grid has completed and its
// writes are visible. What a kernel does before the wait is only what no earlier kernel writes: loading
// or L2-prefetching its weights, so the launch gap and the previous kernel's tail overlap its first HBM
// reads. pdl_trigger() lets the next PDL kernel begin launching (its blocks take SM slots as this grid's
// free up); every kernel here triggers right after its own wait. Launched without the attribute, both are
// no-ops: the same binary serves graphs with and without PDL.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// both, in the order every kernel here uses them
__device__ __forceinline__ void pdl_wait_then_trigger() {
    pdl_wait();
    pdl_trigger();
}

// An L2 prefetch (sm_90's bulk form: one instruction for a whole 16-byte-aligned range, size % 16 == 0). It
// moves bytes from HBM into L2 without registers or a wait, so a GEMV can have its first rows on their way
// before it waits for its input (PDL). Before sm_90 there is no such instruction and no PDL to overlap: nothing.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One vector of hd values -> int8 codes and its scale, by one warp (the int8 KV cache: kv_int8.cu and the
// paged pool, paged_attention.cu). CPU reference: minillm.model.quant.quantize_int8 on each vector:
//     scale = max_i |x_i| / 127,   code_i = rint(x_i / scale) in [-127, 127]   (an all-zero vector: 0, 0)
__device__ __forceinline__ void quantize_vector_int8(const float* src, int hd, int lane, signed char* codes,
                                                     float* scale_out) {
    float largest = 0.0f;
    for (int d = lane; d < hd; d += 32) largest = fmaxf(largest, fabsf(src[d]));
    largest = warp_max(largest);
    float scale = largest / 127.0f;
    float divisor = scale > 0.0f ? scale : 1.0f;    // an all-zero vector stays zero
    for (int d = lane; d < hd; d += 32)             // rint: ties to even, as np.rint
        codes[d] = (signed char)fminf(fmaxf(rintf(src[d] / divisor), -127.0f), 127.0f);
    if (lane == 0) *scale_out = scale;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// A 32-bit hash of (k, seed) (splitmix64's finalizer): random weights made on the device, no cuRAND needed.
__device__ __forceinline__ unsigned int hash_u32(unsigned long long k, unsigned int seed) {
    unsigned long long z = k * 0x9E3779B97F4A7C15ull + ((unsigned long long)seed << 32) + seed;   // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (unsigned int)((z ^ (z >> 31)) >> 32);
}
