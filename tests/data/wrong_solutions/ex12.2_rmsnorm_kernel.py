"""A deliberately wrong solution of exercise 12.2: the sum of squares, not their mean, under the root.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py);
on a machine without a GPU it is "not graded (no GPU)" like every answer to 12.2."""

FAILS_CASE = "one decode row of SmolLM2"
SAYS = "max abs error"


def rmsnorm_kernel():
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
    float scale = rsqrtf(partial[0] + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)blockIdx.x * dim + i] = row[i] * scale * gain[i];
}
'''
