"""Exercise 12.2 (lesson 12): RMSNorm as a CUDA kernel, one block of threads per row.

Reference solution (for teachers; never in the handout). The stub is
lessons/exercises/ex12.2_rmsnorm_kernel.py.

A GPU exercise: your function returns the kernel's CUDA C source; the grader compiles it (CuPy's
RawKernel, NVRTC) and launches it on a GPU, and compares the output with the engine's RMSNorm. On a
machine without a GPU it is reported "not graded (no GPU)", never passed. Lesson 12 builds v1 and v2
of this kernel and says why a block per row with a shared reduction beats a thread per row.

Write `rmsnorm_kernel` below, then check it (on a GPU machine):
    minillm exercise check 12.2       (in a clone: pytest lessons/exercises --exercise 12.2)
"""


def rmsnorm_kernel() -> str:
    """The CUDA C source of `extern "C" __global__ void rmsnorm(const float* x, const float* gain,
    float* out, int dim, float eps)`.

    x, out   [rows, dim] float32, row-major;  gain [dim]
    launch   grid = (rows,), block = (256,): block b normalizes row b, its 256 threads share the row
    result   out[b, i] = x[b, i] / sqrt(mean_i x[b, i]² + eps) * gain[i]

    Every thread sums the squares of its elements (i = threadIdx.x, + 256, ...), the block adds its 256
    partial sums (shared memory and __syncthreads, or warp shuffles), then every thread writes its
    elements scaled. dim may be any size, smaller or larger than 256. Return the source as a str.
    """
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


if __name__ == "__main__":   # `python lessons/exercises/ex12.2_rmsnorm_kernel.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise("12.2", __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
