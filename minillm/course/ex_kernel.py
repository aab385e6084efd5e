"""Exercise 12.2, a GPU kernel: RMSNorm as CUDA C, compiled and launched by the grader with CuPy's RawKernel.

The student's function returns the kernel's source as a string (data, like every answer); the grader
compiles it with NVRTC and launches it, one block of BLOCK threads per row, on its own GPU buffers, and
compares the output with the engine's `minillm.model.layers.rmsnorm`. Without a GPU the exercise is
"not graded (no GPU)": never a pass. (The kernel runs in the grader's GPU context, on buffers it
allocated for the case; a kernel that faults fails the case it faulted on and the ones after it.)"""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, NotGraded, case_rng, expect_close

BLOCK = 256                        # threads per block: one block per row
KERNEL_NAME = "rmsnorm"


def rmsnorm_kernel_reference() -> str:
    """A block-per-row RMSNorm: strided partial sums of squares, a shared-memory tree, then the scale."""
    return r'''
extern "C" __global__ void rmsnorm(const float* x, const float* gain, float* out, int dim, float eps) {
    __shared__ float partial[256];
    const float* row = x + (size_t)blockIdx.x * dim;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    float scale = rsqrtf(partial[0] / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)blockIdx.x * dim + i] = row[i] * scale * gain[i];
}
'''


def _kernel_cases() -> list[Case]:
    rng = case_rng(12, 2)

    def case(name, rows, dim, scale=1.0):
        x = (rng.standard_normal((rows, dim)) * scale).astype(np.float32)
        gain = (1 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
        return Case(name, dict(x=x, gain=gain))
    return [case("one decode row of SmolLM2 (dim 576)", 1, 576),
            case("a prefill of 7 rows", 7, 576),
            case("dim 1000: not a multiple of the block (the tail)", 3, 1000),
            case("dim 100: fewer elements than threads", 5, 100),
            case("Mistral's dim 4096, 16 rows, large values", 16, 4096, scale=40.0)]


def _check_kernel(fn, case: Case) -> str:
    from minillm.course.gpu_parts import why_no_gpu
    from minillm.model.layers import rmsnorm
    source = fn()
    if not isinstance(source, str) or "__global__" not in source:
        raise CaseFailed(f"returned {type(source).__name__}, expected the kernel's CUDA C source as a str")
    why = why_no_gpu()
    if why is not None:
        raise NotGraded(f"no GPU: {why}")
    import cupy as cp
    try:
        kernel = cp.RawKernel(source, KERNEL_NAME)
        kernel.compile()
    except Exception as e:  # noqa: BLE001 - NVRTC's error, whatever CuPy wraps it in
        first = next((line for line in str(e).splitlines() if "error" in line), str(e).splitlines()[0])
        raise CaseFailed(f"does not compile: {first.strip()[:200]}") from None
    x, gain = case.inputs["x"], case.inputs["gain"]
    rows, dim = x.shape
    d_x, d_gain = cp.asarray(x), cp.asarray(gain)
    d_out = cp.full_like(d_x, cp.nan)                             # untouched outputs show as NaN
    kernel((rows,), (BLOCK,), (d_x, d_gain, d_out, np.int32(dim), np.float32(1e-5)))
    cp.cuda.Device().synchronize()
    return expect_close("the kernel's output", cp.asnumpy(d_out), rmsnorm(x, gain, 1e-5), rtol=1e-5, atol=1e-5)
