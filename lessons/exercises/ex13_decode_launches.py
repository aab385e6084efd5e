"""Exercise 13 (lesson 13): how many kernels the GPU decode step launches for one token.

Write `decode_launches` below, then check it:
    minillm exercise check 13         (in a clone: pytest lessons/exercises --exercise 13)
The grader compares it with the launches recorded while the engine's own decode step runs.
"""


def decode_launches(config, gemv_version: int, fuse_norm: bool) -> int:
    """Kernel launches in one decode step (one new token) of a model shaped like `config`.

    config        a model's shape: a minillm.model.config.ModelConfig's fields as attributes (n_layers, dim, ...)
    gemv_version  1 or 2 (the first GEMV kernels: one matrix-vector product a launch, then separate RoPE,
                  KV-append, attention split + combine and SwiGLU launches) or 4 (fused variants)
    fuse_norm     whether each RMSNorm is folded into the GEMV that follows it

    gemv_version 4 with fuse_norm is the step the engine ships: GPUTransformer.decode_step in
    minillm/cuda/gpu_model.py. The earlier steps are kept in the laboratory: LabTransformer.decode_step and
    the helpers it calls (_norm_input, _norm_gemv, _fused) in minillm/cuda/dev/lab.py. Count the kernel
    launches: every Kernels method in minillm/cuda/kernels.py (and LabKernels') launches through `_launch`,
    some of them more than once. Mind what happens before the layers, after them, and when _fused() says no
    even though fuse_norm is True.
    """
    raise NotImplementedError("write decode_launches: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex13_decode_launches.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(13, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
