"""MLA on the device (cuda/device_model.py: the engine's Transformer on CuPy arrays) against the CPU
Transformer, on random DeepSeek-V3 models.

to_device only moves arrays: the first tests run that conversion with xp=numpy (16-bit weights and
latent cache, the naive-prefill rule), everywhere; the last ones run it on CuPy and skip without a
CUDA device."""
import numpy as np
import pytest

import minillm
from hf_models import llama_config, save_random_model
from minillm.cuda import available as gpu_available
from minillm.cuda import device_model, gpu_mla
from minillm.cuda.dev.common import rel_err
from minillm.cuda.dev.model import MODEL_TOL, greedy
from minillm.cuda.device_model import to_device
from minillm.model.kv_cache import MLACache
from minillm.model.transformer import Transformer
from minillm.llm import LLM, _to_gpu
from minillm.checkpoints.mla_convert import convert_to_mla
from minillm.checkpoints.weights import load_hf_dir, save_hf_dir
from test_mla import YARN, deepseek_config

DTYPES = ["float16", "bfloat16"]


def _converted_llama(path):
    """A Llama turned MLA by mla_convert: no un-rotated query part, no latent norm, "repeat" RoPE."""
    source = path / "llama"         # its own folder: load_hf_dir maps the file it reads
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, initializer_range=0.1), source)
    config, tensors = load_hf_dir(source)
    save_hf_dir(path, *convert_to_mla(config, tensors, kv_rank=12, key_rank=1))


CASES = {
    "q-lora": lambda p: save_random_model(deepseek_config(), p),
    "no-q-lora": lambda p: save_random_model(deepseek_config(q_lora_rank=None), p),
    "yarn": lambda p: save_random_model(deepseek_config(rope_parameters=YARN, max_position_embeddings=64), p),
    "mla-convert": _converted_llama,
}


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    CASES[request.param](path)
    return path


def _cpu(path, dtype):
    """The CPU reference, its weights rounded to `dtype` so both sides multiply the same numbers."""
    return minillm.load(str(path), dtype=dtype).model


def _ids(n, seed=1, vocab=320):
    return np.random.default_rng(seed).integers(0, vocab, n)


def logits_error(gpu, cpu, n_prompt=12, n_decode=8) -> float:
    """Largest relative logit error: every prefill position, then a prefill and n_decode decode steps."""
    ids = _ids(n_prompt + n_decode)
    err = rel_err(gpu.prefill(ids[:n_prompt], gpu.new_cache(32), all_logits=True),
                  cpu.prefill(ids[:n_prompt], cpu.new_cache(32), all_logits=True))
    gc, cc = gpu.new_cache(32), cpu.new_cache(32)
    err = max(err, rel_err(gpu.prefill(ids[:n_prompt], gc), cpu.prefill(ids[:n_prompt], cc)))
    for t in ids[n_prompt:]:
        err = max(err, rel_err(gpu.decode(int(t), gc), cpu.decode(int(t), cc)))
    return err


def assert_greedy_agrees(gpu, cpu, n=16):
    """Greedy continuations equal; a divergence is accepted only at a near-tie of the CPU's top two."""
    prompt = _ids(8, seed=2)
    want, cpu_logits = greedy(cpu, prompt, n, cpu.new_cache(32))
    got, gpu_logits = greedy(gpu, prompt, n, gpu.new_cache(32))
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            top2 = np.sort(cpu_logits[i])[-2:]
            margin, err = top2[1] - top2[0], np.abs(cpu_logits[i] - gpu_logits[i]).max()
            assert margin < 2 * err, f"diverged at token {i}: cpu {a} gpu {b}, margin {margin:.2e}, err {err:.2e}"
            return
    assert len(got) == n


# ---- the GPU code on NumPy: runs everywhere ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_run_matches_cpu_logits(model_dir, dtype):
    cpu = _cpu(model_dir, dtype)
    err = logits_error(to_device(cpu, dtype, xp=np), cpu)
    assert err <= MODEL_TOL[dtype], f"error {err:.2e} > {MODEL_TOL[dtype]:.0e}"


def test_numpy_run_greedy_matches_cpu(model_dir):
    cpu = _cpu(model_dir, "float16")
    assert_greedy_agrees(to_device(cpu, "float16", xp=np), cpu)


def test_fp32_cache_leaves_only_weight_rounding(model_dir):
    """With an fp32 latent cache both sides multiply the same numbers in fp32: only summation order
    differs, so a 16-bit cache is the one source of the fp16 tolerance above."""
    cpu = _cpu(model_dir, "bfloat16")
    gpu = to_device(cpu, "bfloat16", xp=np, cache_dtype="float32")
    assert logits_error(gpu, cpu) < 1e-5


def test_naive_and_absorbed_prefill_and_chunking_agree(model_dir):
    cpu = _cpu(model_dir, "float16")
    ids = _ids(20)
    out = {}
    for mode in ("naive-prefill", "absorbed"):   # fp32 cache: else a summation-order ulp can flip an fp16 rounding
        gpu = to_device(cpu, "float16", xp=np, cache_dtype="float32", mla_mode=mode)
        out[mode] = gpu.prefill(ids, gpu.new_cache(20), all_logits=True)
    gpu = to_device(cpu, "float16", xp=np, cache_dtype="float32").with_options(prefill_chunk=6)
    chunked = gpu.prefill(ids, gpu.new_cache(20), all_logits=True)   # 6 + 6 + 6 + 2: later chunks see a cache
    assert rel_err(out["absorbed"], out["naive-prefill"]) < 1e-5
    assert rel_err(chunked, out["naive-prefill"]) < 1e-5


def test_latent_cache_is_16_bit_and_refuses_overflow(model_dir):
    gpu = to_device(_cpu(model_dir, "float16"), "float16", xp=np)
    cache = gpu.new_cache(10)
    assert isinstance(cache, MLACache) and cache.c_kv.dtype == np.float16
    assert cache.nbytes == 10 * gpu.config.kv_bytes_per_token(2)
    gpu.prefill(_ids(10), cache)
    with pytest.raises(ValueError, match="KV cache is full"):
        gpu.decode(1, cache)


def test_quantized_weights_are_widened_and_an_int8_kv_cache_is_kept(tmp_path):
    """The Transformer on the device holds a quantized matrix as the 16-bit values it encodes (no kernel computes in
    int8/fp8/NF4/MXFP4 there): the same logits as the CPU's quantized model up to fp16 rounding. An int8 KV cache
    stays int8 there (tests/test_device_kv_cache.py)."""
    save_random_model(llama_config(), tmp_path)
    for quant in ("int8", "mxfp4"):
        cpu = minillm.load(str(tmp_path), quant=quant).model
        gpu = to_device(cpu, xp=np)
        assert gpu.layers[0].wq.dtype == np.float16
        assert logits_error(gpu, cpu) <= MODEL_TOL["float16"]
    cpu = minillm.load(str(tmp_path), kv_cache="int8").model
    gpu = to_device(cpu, xp=np)
    assert gpu.new_cache(8).k.dtype == np.int8 and logits_error(gpu, cpu) <= MODEL_TOL["float16"]


def test_gqa_models_run_the_same_way(tmp_path):
    """Nothing in to_device is MLA's: a Llama's Transformer moves the same way (lesson 11 runs it on CuPy)."""
    save_random_model(llama_config(), tmp_path)
    cpu = _cpu(tmp_path, "float16")
    assert logits_error(to_device(cpu, "float16", xp=np, cache_dtype="float32"), cpu) < 1e-5


def test_to_gpu_sends_mla_models_to_the_fast_path_or_the_transformer_on_device(model_dir, monkeypatch):
    """llm._to_gpu's dispatch, with the device module swapped for NumPy and the fast path's constructor for a
    stub (no GPU needed): gpu_mla where it runs the model, else (mla-convert's ranks of 12: not multiples of
    8) the Transformer on the device."""
    monkeypatch.setattr(device_model, "_cupy", lambda: np)
    built = []
    monkeypatch.setattr(gpu_mla.GPUMLATransformer, "from_cpu",
                        classmethod(lambda cls, model, dtype="float16": built.append((model, dtype)) or "fast path"))
    cpu_llm = minillm.load(str(model_dir))
    gpu = _to_gpu(cpu_llm.model, None, None, "auto")
    if model_dir.name.startswith("mla-convert"):
        assert "multiples of 8" in gpu_mla.unsupported(cpu_llm.model) and not built
    else:
        assert gpu_mla.unsupported(cpu_llm.model) is None
        assert gpu == "fast path" and built == [(cpu_llm.model, "float16")]
        return
    assert isinstance(gpu, Transformer) and gpu is not cpu_llm.model and gpu.dtype == "float16"
    assert gpu.mla_mode == "naive-prefill" and gpu.new_cache(4).c_kv.dtype == np.float16
    ids = _ids(10).tolist()
    got = LLM(cpu_llm.config, gpu).logits(ids)
    assert rel_err(got, cpu_llm.logits(ids)) <= MODEL_TOL["float16"]


# ---- on the GPU: CuPy, skipped without a CUDA device --------------------------------------------------

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_run_matches_cpu_logits_and_greedy(model_dir, dtype):
    import cupy
    cpu = _cpu(model_dir, dtype)
    gpu = to_device(cpu, dtype)
    assert isinstance(gpu.embed, cupy.ndarray) and isinstance(gpu.new_cache(4).c_kv, cupy.ndarray)
    err = logits_error(gpu, cpu)
    assert err <= MODEL_TOL[dtype], f"error {err:.2e} > {MODEL_TOL[dtype]:.0e}"
    assert_greedy_agrees(gpu, cpu)


@needs_gpu
def test_load_on_cuda_matches_cpu_logits(model_dir):
    ids = _ids(24).tolist()
    cpu = minillm.load(str(model_dir)).logits(ids)
    llm = minillm.load(str(model_dir), device="cuda")
    fast = gpu_mla.unsupported(minillm.load(str(model_dir)).model) is None      # else device_model's path
    assert isinstance(llm.model, gpu_mla.GPUMLATransformer if fast else Transformer)
    assert type(llm.model.embed).__module__.startswith("cupy")
    assert rel_err(llm.logits(ids), cpu) <= MODEL_TOL["float16"]
