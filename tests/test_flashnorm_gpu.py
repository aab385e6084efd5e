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
        k.gemv(wd, h[0], y[0])
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


# ---- FlashNorm at every norm site of the graph-captured decode step ---------------------------------

@pytest.mark.parametrize("hd,dim", [(64, 576), (128, 4096)])        # the ragged end only; whole steps too
def test_fused_qkv_gemv_rotates_scales_and_appends(kernels, hd, dim):
    """flashnorm_gemv_qkv: RoPE((W*·x)·1/RMS(x)) at pos into y, k and v (16-bit) into the cache at pos."""
    from minillm.model.layers import apply_rope, rope_inv_freq, rope_tables
    k, fk = kernels
    n_heads, n_kv, pos, capacity = 4, 2, 5, 16
    rows = (n_heads + 2 * n_kv) * hd
    w, x, w32 = inputs(rows, dim, dtype=k.dtype)
    inv_freq = rope_inv_freq(hd, 10000.0)
    raw = deferred_linear(x, w32, EPS)[0]                                          # [rows], scaled
    cos, sin = rope_tables(np.array([pos]), inv_freq)
    q = apply_rope(raw[:n_heads * hd].reshape(1, n_heads, hd), cos, sin).reshape(-1)
    kk = apply_rope(raw[n_heads * hd:(n_heads + n_kv) * hd].reshape(1, n_kv, hd), cos, sin).reshape(n_kv, hd)
    v = raw[(n_heads + n_kv) * hd:].reshape(n_kv, hd)
    y = cp.full(rows, cp.nan, cp.float32)
    kc, vc = (cp.zeros((n_kv, capacity, hd), cp.asarray(w).dtype) for _ in range(2))
    fk.gemv_qkv(cp.asarray(w), cp.asarray(x[0]), EPS, y, cp.asarray(np.array([pos], np.int32)), cp.asarray(inv_freq),
                kc, vc, n_heads, n_kv, hd)
    got = y.get()
    assert rel_err(got[:n_heads * hd], q) <= F32_TOL
    assert rel_err(got[n_heads * hd:(n_heads + n_kv) * hd], kk.reshape(-1)) <= F32_TOL
    assert rel_err(got[(n_heads + n_kv) * hd:], v.reshape(-1)) <= F32_TOL
    tol16 = {"float16": 2e-3, "bfloat16": 1.6e-2}[k.dtype]
    assert rel_err(as_f32(kc.get())[:, pos], kk) <= tol16 and rel_err(as_f32(vc.get())[:, pos], v) <= tol16
    assert not as_f32(kc.get())[:, :pos].any() and not as_f32(vc.get())[:, pos + 1:].any()   # only slot pos


@pytest.fixture(scope="module")
def folded_cpu(tmp_path_factory):
    """A random Llama (gains around 1) folded with an untied head, as Transformer(flashnorm=True)."""
    from hf_models import llama_config, save_random_model
    from minillm.checkpoints.weights import load_hf_dir
    from minillm.model.transformer import Transformer
    path = tmp_path_factory.mktemp("flashnorm-e2e")
    save_random_model(llama_config(tied=True), path, seed=26)
    config, tensors = load_hf_dir(path)
    config, tensors, _ = fold_checkpoint(config, tensors, untie=True)
    return Transformer(config, tensors, flashnorm=True)


def stepped(model, ids, n_prompt=4) -> np.ndarray:
    """Prefill logits, then each later id decoded (the captured graph for GPU models)."""
    cache = model.new_cache(len(ids) + 4)
    return np.stack([model.prefill(ids[:n_prompt], cache)] + [model.decode(t, cache) for t in ids[n_prompt:]])


E2E_MODES = [("fused", True), ("deferred", True), ("deferred", False)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mode,two_streams", E2E_MODES, ids=["fused", "deferred-two-streams", "deferred-one-stream"])
def test_every_norm_site_step_matches_the_cpu_and_the_production_step(folded_cpu, dtype, mode, two_streams):
    from minillm.cuda.dev.flashnorm import FlashNormDecodeTransformer
    ids = np.random.default_rng(0).integers(0, folded_cpu.config.vocab_size, 14).tolist()
    gpu = FlashNormDecodeTransformer.from_cpu(folded_cpu, dtype, mode=mode, two_streams=two_streams)
    got = stepped(gpu, ids)
    production = stepped(GPUTransformer.from_cpu(folded_cpu, dtype), ids)
    cpu = stepped(folded_cpu, ids)
    tol = {"float16": 5e-3, "bfloat16": 3e-2}[dtype]            # 16-bit weights vs the CPU's fp32 ones
    assert rel_err(got, cpu) <= tol
    assert rel_err(got, production) <= (2e-3 if dtype == "float16" else tol)


def test_the_graph_joins_both_branches(folded_cpu):
    """200 µs of spinning on the matmul branch of every site, inside the captured graph: the same bits."""
    from minillm.cuda.dev.flashnorm import FlashNormDecodeTransformer
    ids = np.random.default_rng(1).integers(0, folded_cpu.config.vocab_size, 8).tolist()
    plain = FlashNormDecodeTransformer.from_cpu(folded_cpu, mode="deferred")
    delayed = FlashNormDecodeTransformer.from_cpu(folded_cpu, mode="deferred")
    delayed.two.delay_ns = 200_000
    assert np.array_equal(stepped(delayed, ids), stepped(plain, ids))


def test_every_norm_site_model_refuses_unfolded_weights(folded_cpu):
    from minillm.cuda.dev.flashnorm import FlashNormDecodeTransformer
    gpu = GPUTransformer.from_cpu(folded_cpu)
    gpu.layers[0].mlp_norm[3] = 1.5                                       # one gain left unfolded
    with pytest.raises(ValueError, match="folded weights"):
        FlashNormDecodeTransformer(gpu.config, gpu.layers, gpu.embed, gpu.final_norm, gpu.lm_head)


def test_e2e_checks_and_times_every_variant():
    from minillm.cuda.dev.flashnorm import E2E_TOL, e2e, print_e2e
    from minillm.model.config import PRESETS
    rows = e2e(presets=("smollm2-135m",), n_new=4, repeats=1, check_steps=2)
    print_e2e(rows, "float16", 4)
    assert [r["variant"] for r in rows] == ["v4 (production)", "v4 on folded weights", "fused flashnorm_gemv",
                                            "deferred, two streams", "deferred, one stream"]
    assert all(r["error"] is None and r["tok_s"] > 0 and r["gpu_ms"] > 0 for r in rows), [r["error"] for r in rows]
    assert all(r["err_folded"] <= E2E_TOL for r in rows[2:])          # the variants vs v4 on the same weights
    assert rows[1]["err"] > 0                     # the gains were random: folding rounded the weights anew
    n = PRESETS["smollm2-135m"].config.n_layers
    assert [r["launches"] for r in rows] == [5 * n + 2] * 3 + [11 * n + 4] * 2
