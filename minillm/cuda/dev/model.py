"""The production model checks (minillm/cuda/selfcheck.py: GPU vs CPU on small random models) run on the lab's
decode steps too: the earlier GEMV versions (gemv_version 2), the unfused norms, the lab's settings.

Each check_* takes the production check's arguments plus fuse_norm, gemv_version and settings (KernelSettings
or LabSettings changes); the shipped choices (4, True, none) check GPUTransformer itself.
"""
from __future__ import annotations

from minillm.cuda import selfcheck as shipped_checks
from minillm.cuda.selfcheck import (MODEL_TOL, SHORT, greedy, model_checks as shipped_model_checks,  # noqa: F401
                                    random_cpu_model, small_config, within)


def gpu_model(cpu, dtype: str, fuse_norm: bool = True, gemv_version: int = 4, settings: dict | None = None, **options):
    """GPUTransformer.from_cpu(cpu, dtype, **options): the shipped model, or the lab's around it (lab.py) for an
    earlier decode step (gemv_version 2, fuse_norm off) or settings that are the lab's."""
    from dataclasses import fields

    from minillm.cuda.dev.lab import LabTransformer
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.cuda.kernels import KernelSettings
    gpu = GPUTransformer.from_cpu(cpu, dtype, **options)
    settings = settings or {}
    if gemv_version >= 4 and fuse_norm and set(settings) <= {f.name for f in fields(KernelSettings)}:
        return gpu.with_settings(**settings)
    return LabTransformer.of(gpu, gemv_version, fuse_norm, **settings)


def _lab(fuse_norm: bool, gemv_version: int, settings: dict | None):
    return lambda cpu, dtype, **options: gpu_model(cpu, dtype, fuse_norm, gemv_version, settings, **options)


def check_model_logits(kind: str, dtype: str, fuse_norm: bool = True, gemv_version: int = 4,
                       settings: dict | None = None, **kw):
    return shipped_checks.check_model_logits(kind, dtype, make_gpu=_lab(fuse_norm, gemv_version, settings), **kw)


def check_greedy(kind: str, dtype: str, fuse_norm: bool = True, gemv_version: int = 4, **kw):
    return shipped_checks.check_greedy(kind, dtype, make_gpu=_lab(fuse_norm, gemv_version, None), **kw)


def check_graph_equals_eager(kind: str, dtype: str, fuse_norm: bool = True, gemv_version: int = 4,
                             settings: dict | None = None, **kw):
    return shipped_checks.check_graph_equals_eager(kind, dtype, make_gpu=_lab(fuse_norm, gemv_version, settings),
                                                   **kw)


def model_checks(quick: bool) -> None:
    """The selfcheck's model checks, then the same on the lab's earlier decode steps."""
    shipped_model_checks(quick)
    say = shipped_checks.say
    say("the lab's earlier decode steps, GPU vs CPU")
    variants = [(4, False, "v4 unfused-norm"), (2, False, "v2"), (2, True, "v2+v3 fused-norm")]
    for dtype in ("float16", "bfloat16"):
        for kind in ("gqa", "mistral") if quick else ("gqa", "mistral", "tied"):
            for version, fuse, tag in variants:
                within(f"{SHORT[dtype]} logits {kind} {tag}",
                       lambda: check_model_logits(kind, dtype, fuse_norm=fuse, gemv_version=version))
    for kind in ("gqa", "mistral"):
        within(f"fp16 greedy 16 tokens {kind} v2",
               lambda: check_greedy(kind, "float16", fuse_norm=False, gemv_version=2))
        for version, fuse, tag in variants:
            within(f"fp16 graph replay == eager {kind} {tag}",
                   lambda: check_graph_equals_eager(kind, "float16", fuse_norm=fuse, gemv_version=version))
