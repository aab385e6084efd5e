"""FlashNorm on the GPU: the fused kernels and the two-stream path equal the unfused path, and a delayed
matmul stream changes nothing (the join is explicit). Skipped without CuPy or a CUDA device."""
from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_skip import cupy_with_a_device

cp = cupy_with_a_device()

from minillm.backend import as_f32  # noqa: E402
from minillm.cuda.dev.common import narrow  # noqa: E402
from minillm.cuda.dev.flashnorm import (FlashNormGPUTransformer, FlashNormKernels, TwoStreamNorm,  # noqa: E402
                                        benchmark)
from minillm.cuda.gpu_model import GPUTransformer  # noqa: E402
from minillm.cuda.kernels import Kernels  # noqa: E402
from minillm.model.flashnorm import deferred_linear, fold_checkpoint, inv_rms  # noqa: E402
from minillm.model.layers import rmsnorm, silu  # noqa: E402

EPS = 1e-5
# The reference uses the same 16-bit weights widened to fp32: only the fp32 summation order differs.
F32_TOL = 2e-5


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def kernels(request):
    return Kernels(request.param), FlashNormKernels(request.param)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


def inputs(rows, n_in, T=1, seed=0, dtype="float16"):
    """Folded 16-bit weights and an un-normalized x with a few large channels (as residual streams have)."""
    rng = np.random.default_rng(seed)
    w = narrow(rng.standard_normal((rows, n_in)) / math.sqrt(n_in), dtype)
    x = (rng.standard_normal((T, n_in)) * 3).astype(np.float32)
    x[:, :: max(1, n_in // 4)] *= 40.0
    return w, x, as_f32(w)


@pytest.mark.parametrize("rows,n_in", [(1, 8), (13, 64), (960, 576), (6144, 4096), (33, 12000), (7, 14336)])
def test_fused_gemv_matches_numpy(kernels, rows, n_in):
    k, fk = kernels
    w, x, w32 = inputs(rows, n_in, dtype=k.dtype)
    y = cp.full(rows, cp.nan, cp.float32)
    fk.gemv(cp.asarray(w), cp.asarray(x[0]), y, EPS)
    assert rel_err(y.get(), deferred_linear(x, w32, EPS)[0]) <= F32_TOL


def test_fused_gemv_accumulates(kernels):
    k, fk = kernels
    w, x, w32 = inputs(100, 576, dtype=k.dtype)
    y0 = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    y = cp.asarray(y0)
    fk.gemv(cp.asarray(w), cp.asarray(x[0]), y, EPS, accumulate=True)
    assert rel_err(y.get(), y0 + deferred_linear(x, w32, EPS)[0]) <= F32_TOL


@pytest.mark.parametrize("ffn,dim", [(8, 64), (1536, 576), (304, 4096)])
def test_fused_swiglu_then_scaled_down_is_the_llama_mlp(kernels, ffn, dim):
    """silu(s·gate)·up, then x += s·(down · act): equals down(swiglu(rmsnorm(x))) of the folded weights."""
    k, fk = kernels
    w_gu, x, gu32 = inputs(2 * ffn, dim, dtype=k.dtype)
    w_down, _, down32 = inputs(dim, ffn, seed=1, dtype=k.dtype)
    act, s = cp.full(ffn, cp.nan, cp.float32), cp.full(1, cp.nan, cp.float32)
    y = cp.asarray(x[0])
    fk.gemv_swiglu(cp.asarray(w_gu), cp.asarray(x[0]), EPS, act, s)
    fk.gemv_scaled(cp.asarray(w_down), act, s, y)
    h = rmsnorm(x, np.ones(dim, np.float32), EPS)
    gate, up = h @ gu32[:ffn].T, h @ gu32[ffn:].T
    assert abs(float(s.get()[0]) - float(inv_rms(x, EPS)[0, 0])) <= 1e-6 * float(inv_rms(x, EPS)[0, 0])
    assert rel_err(y.get(), x[0] + (silu(gate) * up @ down32.T)[0]) <= 1e-4


def unfused(k, w, x):
    """The reference GPU path: the rmsnorm kernel, then the projection of the normalized x."""
    T, dim = x.shape
    xd, wd = cp.asarray(x), cp.asarray(w)
    if T == 1:
        h, y = cp.empty((1, dim), cp.float32), cp.empty((1, w.shape[0]), cp.float32)
        k.rmsnorm(xd, cp.ones(dim, cp.float32), h, EPS)
        k.gemv(wd, h[0], y[0], version=4)
    else:
        from minillm.cuda.dev.flashnorm import gemm
        h, y = cp.empty((T, dim), wd.dtype), cp.empty((T, w.shape[0]), cp.float32)
        k.rmsnorm(xd, cp.ones(dim, cp.float32), h, EPS)
        gemm(h, wd, y, k.dtype, cp.cuda.get_current_stream())
    cp.cuda.Device().synchronize()
    return y.get()


def two_stream(k, fk, w, x, delay_ns=0):
    T, dim = x.shape
    rows = w.shape[0]
    two = TwoStreamNorm(k, fk)
    two.delay_ns = delay_ns
    main = cp.cuda.Stream(non_blocking=True)
    out = cp.full((T, rows), cp.nan, cp.float32)
    y_raw = cp.full((T, rows), cp.nan, cp.float32)        # what a stale read would see: NaN
    with main:
        two(cp.asarray(x), cp.asarray(w), y_raw, cp.empty(T, cp.float32), out, EPS,
            cp.empty((T, dim), cp.asarray(w).dtype))
        got = out.get()                                    # waits on main only: the join must cover the rest
    cp.cuda.Device().synchronize()
    return got


@pytest.mark.parametrize("rows,n_in,T", [(960, 576, 1), (6144, 4096, 1), (3072, 576, 16), (1024, 4096, 64)])
def test_two_stream_matches_unfused(kernels, rows, n_in, T):
    k, fk = kernels
    w, x, _ = inputs(rows, n_in, T, dtype=k.dtype)
    # prefill rounds the normalized x (unfused) or the raw x (two-stream) to 16 bits before cuBLAS
    tol = F32_TOL if T == 1 else {"float16": 2e-3, "bfloat16": 1.6e-2}[k.dtype]
    assert rel_err(two_stream(k, fk, w, x), unfused(k, w, x)) <= tol


@pytest.mark.parametrize("T", [1, 16])
def test_a_delayed_matmul_stream_changes_nothing(kernels, T):
    """2 ms of spinning before the projection: with the explicit join the result is bit-identical."""
    k, fk = kernels
    w, x, _ = inputs(4096, 576, T, dtype=k.dtype)
    assert np.array_equal(two_stream(k, fk, w, x, delay_ns=2_000_000), two_stream(k, fk, w, x))


def test_two_stream_head_model_matches_the_gpu_model(tmp_path):
    """GPUTransformer and its FlashNorm twin on the same folded weights: same logits, step by step."""
    from hf_models import llama_config, save_random_model
    from minillm.model.transformer import Transformer
    from minillm.checkpoints.weights import load_hf_dir
    save_random_model(llama_config(tied=True), tmp_path)
    config, tensors = load_hf_dir(tmp_path)
    config, tensors, _ = fold_checkpoint(config, tensors, untie=True)
    cpu = Transformer(config, tensors, flashnorm=True)
    base, fn = GPUTransformer.from_cpu(cpu), FlashNormGPUTransformer.from_cpu(cpu)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 12).tolist()
    steps = []
    for model in (base, fn):
        cache = model.new_cache(32)
        steps.append(np.stack([model.prefill(ids[:4], cache)] + [model.decode(t, cache) for t in ids[4:]]))
    assert rel_err(steps[1], steps[0]) <= 2e-3


def test_benchmark_runs_and_reports_every_variant():
    rows = benchmark(presets=("smollm2-135m",), prefill_tokens=16, quick=True)
    names = {(r["phase"], r["variant"]) for r in rows}
    assert ("decode", "fused flashnorm_gemv") in names and ("prefill 16", "two-stream") in names
    assert all(r["eager_us"] > 0 for r in rows)
