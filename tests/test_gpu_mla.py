"""MLA's decode fast path (cuda/gpu_mla.py, kernels/mla_decode.cu).

On the CPU: the kernels' NumPy references (minillm.cuda.dev.mla), composed into a decode step in the fast
path's order, reproduce the CPU engine's MLA logits on random DeepSeek-V3 models (q_lora or not, YaRN,
half-split RoPE, 20 heads); and shapes the kernels cannot take are refused in one line.
On a GPU (skipped without one): each kernel against its reference, and the graph-captured step's logits and
greedy tokens against the CPU engine and device_model's path."""
import numpy as np
import pytest

import minillm
from hf_models import save_random_model
from minillm.cuda import available as gpu_available
from minillm.cuda.dev import mla as dev
from minillm.cuda.dev.common import rel_err
from minillm.cuda.dev.model import MODEL_TOL
from minillm.cuda.gpu_mla import check_shape
from minillm.model.config import ModelConfig
from test_mla import YARN, deepseek_config

CASES = {
    "q-lora": lambda: deepseek_config(),
    "no-q-lora": lambda: deepseek_config(q_lora_rank=None),
    "yarn": lambda: deepseek_config(rope_parameters=YARN, max_position_embeddings=64),
}
DTYPES = ["float16", "bfloat16"]


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(CASES[request.param](), path)
    return path


def _ids(n, seed=1, vocab=320):
    return np.random.default_rng(seed).integers(0, vocab, n)


def reference_error(cpu, dtype: str, n_prompt: int = 10, n_decode: int = 6) -> float:
    """Largest relative error of reference_step's logits (one token at a time, a 16-bit latent cache) against
    the CPU engine's prefill (every position) and decode steps."""
    ids = _ids(n_prompt + n_decode, vocab=cpu.config.vocab_size)
    host = dev.HostMLA(cpu, dtype, capacity=32)
    got = np.stack([dev.reference_step(host, int(t)) for t in ids])
    cache = cpu.new_cache(32)
    want = [cpu.prefill(ids[:n_prompt], cache, all_logits=True)]
    want += [cpu.decode(int(t), cache)[None] for t in ids[n_prompt:]]
    return rel_err(got, np.concatenate(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_step_matches_cpu_engine(model_dir, dtype):
    cpu = minillm.load(str(model_dir), dtype=dtype).model
    err = reference_error(cpu, dtype)
    assert err <= MODEL_TOL[dtype], f"error {err:.2e} > {MODEL_TOL[dtype]:.0e}"


@pytest.mark.parametrize("shape", [dict(interleave=False), dict(n_heads=20, r=64), dict(q_lora=False, yarn=True)],
                         ids=["half-split", "20-heads-r64", "no-q-lora-yarn"])
def test_reference_step_matches_cpu_engine_on_more_shapes(shape):
    cpu = dev.small_model(dev.small_config(**shape), "float16")
    err = reference_error(cpu, "float16")
    assert err <= MODEL_TOL["float16"], f"error {err:.2e}"


def test_a_wrong_reference_is_caught():
    """The comparison has teeth: a reference that drops the RoPE gain (YaRN's mscale) misses by over 10x
    the right one's error, and by more than the tolerance."""
    cpu = dev.small_model(dev.small_config(yarn=True), "float16")
    ids = _ids(8)
    want = cpu.prefill(ids, cpu.new_cache(32), all_logits=True)
    errors = []
    for drop_gain in (False, True):
        host = dev.HostMLA(cpu, "float16", capacity=32)
        assert host.rope_gain != 1.0
        if drop_gain:
            host.rope_gain = 1.0
        errors.append(rel_err(np.stack([dev.reference_step(host, int(t)) for t in ids]), want))
    right, wrong = errors
    assert right <= MODEL_TOL["float16"] < wrong and wrong > 10 * right, errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_prefill_writes_the_cache_the_kernels_read(model_dir, dtype, monkeypatch):
    """The fast path's prefill (device_model's Transformer over its arrays, prefill_transformer) fills the
    GPUMLACache; decode steps of the kernels' references, reading that cache, then continue the CPU
    engine's logits. Run on NumPy: the cache and the prefill model only use the array module."""
    from minillm.backend import to_dtype
    from minillm.cuda import gpu_kv_cache, gpu_mla
    monkeypatch.setattr(gpu_mla, "_cp", lambda: np)
    monkeypatch.setattr(gpu_kv_cache, "_cp", lambda: np)
    cpu = minillm.load(str(model_dir), dtype=dtype).model
    layers = [gpu_mla.host_layer(L, dtype) for L in cpu.layers]
    narrow = lambda a: to_dtype(np.asarray(a), dtype)
    prefill = gpu_mla.prefill_transformer(cpu, layers, narrow(cpu.embed), to_dtype(cpu.final_norm, "float32"),
                                          narrow(cpu.lm_head), dtype)
    cache = gpu_mla.GPUMLACache(cpu.config, 32, dtype)
    ids = _ids(16)
    got = [prefill.prefill(ids[:10], cache, all_logits=True)]
    assert cache.length == 10 and cache.latent.dtype == (np.float16 if dtype == "float16" else np.uint16)
    host = dev.HostMLA(cpu, dtype, capacity=32)
    host.cache, host.length = cache.latent, cache.length
    got += [dev.reference_step(host, int(t))[None] for t in ids[10:]]
    cc = cpu.new_cache(32)
    want = [cpu.prefill(ids[:10], cc, all_logits=True)] + [cpu.decode(int(t), cc)[None] for t in ids[10:]]
    err = rel_err(np.concatenate(got), np.concatenate(want))
    assert err <= MODEL_TOL[dtype], f"error {err:.2e}"


def test_unsupported_shapes_are_refused():
    odd = dev.small_config(r=12)
    with pytest.raises(ValueError, match="multiples of 8.*kv_lora_rank=12.*device_model"):
        check_shape(odd)
    with pytest.raises(ValueError, match="kv_lora_rank <= 512"):
        check_shape(dev.small_config(r=1024))
    with pytest.raises(ValueError, match="runs MLA models"):
        check_shape(ModelConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64))


# ---- on the GPU: skipped without CuPy and a CUDA device -------------------------------------------------
needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [("kv_append", (16, 8, 5, True, True)), ("kv_append", (512, 64, 300, False, True)),
                                  ("kv_append", (64, 8, 7, True, False)), ("q_absorb", (4, 16, 8, 12, 16, 3)),
                                  ("q_absorb", (128, 128, 64, 128, 512, 77)), ("attention", (4, 16, 8, 1, 32)),
                                  ("attention", (20, 64, 8, 45, 64)), ("attention", (128, 512, 64, 4000, 4096)),
                                  ("v_up", (128, 128, 128, 512))], ids=lambda c: f"{c[0]}{c[1]}")
def test_kernel_matches_reference(dtype, case):
    name, args = case
    err, tol = getattr(dev, f"check_{name}")(dtype, *args)
    assert err <= tol, f"{name}: error {err:.2e} > {tol:.1e}"


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_logits_match_cpu_and_device_model(model_dir, dtype):
    errs = dev.model_errors(minillm.load(str(model_dir), dtype=dtype).model, dtype)
    assert max(errs.values()) <= MODEL_TOL[dtype], errs


@needs_gpu
def test_fast_path_greedy_matches_cpu(model_dir):
    from minillm.cuda.dev.model import greedy
    from minillm.cuda.gpu_mla import GPUMLATransformer
    cpu = minillm.load(str(model_dir), dtype="float16").model
    gpu = GPUMLATransformer.from_cpu(cpu, "float16")
    prompt = _ids(8, seed=2)
    want, cpu_logits = greedy(cpu, prompt, 16, cpu.new_cache(32))
    got, _ = greedy(gpu, prompt, 16, gpu.new_cache(32))
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:                                   # accepted only at a near-tie of the CPU's top two
            top2 = np.sort(cpu_logits[i])[-2:]
            assert top2[1] - top2[0] < 1e-2 * np.abs(cpu_logits[i]).max(), f"diverged at token {i}"
            return
    assert len(got) == 16
