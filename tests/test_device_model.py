"""The GPU runs everything the CPU runs (issue 44): a checkpoint with a piece the kernels lack (gpu_model.unsupported)
runs as device_model, the engine's own Transformer with its arrays on the device. Mixtral and DeepSeek-V3 MoE,
Qwen2's biases, Qwen3 (QK-norm), Qwen3-MoE, Gemma 3, Phi-3 (partial RoPE, LongRoPE), GPT-OSS (sinks, YaRN,
MXFP4 experts) and fp8/NF4/MXFP4 weights.

The first tests run the conversion with NumPy as the array module, everywhere: the routing, what is uploaded in
which dtype, and the logits of the converted model against the CPU engine's on the same 16-bit weights. The last
one runs it on CuPy (skipped without a CUDA device): logits within the fp16 tolerance and greedy tokens equal over
32 tokens, up to a near-tie of the CPU's top two."""
import numpy as np
import pytest

import minillm
from hf_models import gemma3_config, llama_config, qwen2_config, qwen3_config, qwen3_moe_config, save_random_model
from minillm import llm
from minillm.cuda import available as gpu_available
from minillm.cuda import device_model
from minillm.cuda.dev.model import MODEL_TOL, greedy
from minillm.cuda.selfcheck import rel_err
from minillm.model.transformer import Transformer
from test_gpt_oss import gpt_oss_config, save_gpt_oss
from test_moe import deepseek_moe_config, mixtral_config, save_moe_model
from test_phi3 import phi3_config, save_phi3

CASES = {   # name -> (writes the checkpoint, the quant load() is asked for)
    "qwen2-biases": (lambda p: save_random_model(qwen2_config(), p), None),
    "qwen3": (lambda p: save_random_model(qwen3_config(), p), None),
    "qwen3-moe": (lambda p: save_random_model(qwen3_moe_config(), p), None),
    "gemma3": (lambda p: save_random_model(gemma3_config(), p), None),
    "phi3": (lambda p: save_phi3(phi3_config(num_hidden_layers=2), p), None),
    "gpt-oss": (lambda p: save_gpt_oss(gpt_oss_config(num_hidden_layers=2), p), None),
    "mixtral": (lambda p: save_moe_model(mixtral_config(), p), None),
    "deepseek-moe": (lambda p: save_moe_model(deepseek_moe_config(), p), None),
    "qwen3-mxfp4": (lambda p: save_random_model(qwen3_config(), p), "mxfp4"),
    "qwen3-fp8": (lambda p: save_random_model(qwen3_config(), p), "fp8"),
    "qwen3-nf4": (lambda p: save_random_model(qwen3_config(), p), "nf4"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write, quant = CASES[request.param]
    write(path)
    return path, quant


def _cpu(path, quant):
    """The CPU reference on the weights the device will hold: 16-bit, or quantized as the device widens them."""
    return minillm.load(str(path), dtype="float16", quant=quant).model


def _ids(n, vocab, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n)


def logits_error(gpu, cpu, n_prompt=10, n_decode=6) -> float:
    """Largest relative logit error: every prefill position, then n_decode decode steps through the cache."""
    ids = _ids(n_prompt + n_decode, cpu.config.vocab_size)
    err = rel_err(np.asarray(gpu.prefill(ids[:n_prompt], gpu.new_cache(32), all_logits=True)),
                  cpu.prefill(ids[:n_prompt], cpu.new_cache(32), all_logits=True))
    gc, cc = gpu.new_cache(32), cpu.new_cache(32)
    gpu.prefill(ids[:n_prompt], gc), cpu.prefill(ids[:n_prompt], cc)
    for t in ids[n_prompt:]:
        err = max(err, rel_err(np.asarray(gpu.decode(int(t), gc)), cpu.decode(int(t), cc)))
    return err


def test_the_kernels_lack_a_piece_of_each_so_device_model_runs_it(checkpoint):
    cpu = _cpu(*checkpoint)
    assert llm.gpu_path(cpu) == "device_model"


def test_on_numpy_the_converted_model_gives_the_cpu_logits(checkpoint, monkeypatch):
    """llm._to_gpu with the device module swapped for NumPy: a Transformer whose matrices are 16-bit (quantized ones
    widened), whose gains, sinks and biases are fp32, and whose logits are the CPU engine's up to fp16 rounding."""
    monkeypatch.setattr(device_model, "_cupy", lambda: np)
    cpu = _cpu(*checkpoint)
    gpu = llm._to_gpu(cpu, None, None, "auto")
    assert isinstance(gpu, Transformer) and gpu is not cpu and gpu.dtype == "float16"
    L = gpu.layers[-1]
    matrices = [L.wq] if L.moe is None else [L.moe.experts[0].w_up]
    assert all(m.dtype == np.float16 for m in matrices)
    assert L.attn_norm.dtype == np.float32 and (L.sinks is None or L.sinks.dtype == np.float32)
    assert logits_error(gpu, cpu) <= MODEL_TOL["float16"]


needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")


@needs_gpu
def test_on_the_gpu_logits_and_32_greedy_tokens_follow_the_cpu(checkpoint):
    cpu = _cpu(*checkpoint)
    gpu = llm._to_gpu(cpu, None, None, "auto")
    assert logits_error(gpu, cpu) <= MODEL_TOL["float16"]
    prompt = _ids(8, cpu.config.vocab_size, seed=2)
    want, cpu_logits = greedy(cpu, prompt, 32, cpu.new_cache(48))
    got, gpu_logits = greedy(gpu, prompt, 32, gpu.new_cache(48))
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:         # a flip is accepted only where the CPU's top two are closer than the logits' error
            top2 = np.sort(cpu_logits[i])[-2:]
            margin, err = top2[1] - top2[0], np.abs(cpu_logits[i] - np.asarray(gpu_logits[i])).max()
            assert margin < 2 * err, f"token {i}: cpu {a} gpu {b}, margin {margin:.2e}, err {err:.2e}"
            return
    assert len(got) == 32


def test_info_says_which_gpu_path_runs_a_checkpoint_and_why(tmp_path):
    from minillm.tools.info import describe
    save_random_model(qwen3_config(), tmp_path / "qwen3")
    save_random_model(llama_config(), tmp_path / "plain")
    line = next(row for row in describe(str(tmp_path / "qwen3")).splitlines() if row.startswith("on --device cuda"))
    assert "device_model" in line and "qk_norm" in line
    line = next(row for row in describe(str(tmp_path / "plain")).splitlines() if row.startswith("on --device cuda"))
    assert "GPUTransformer" in line


def test_serving_a_device_model_on_the_gpu_is_refused_in_one_line(checkpoint, monkeypatch):
    """The batching engine's pool and runner are host NumPy (engine/batched.py): a Transformer whose arrays are on
    the device is refused by the Engine in one line, not run into a type error mid-step. (The arrays are made to
    look like the device's by the array_module the check reads.)"""
    from minillm.errors import MiniLLMError
    cpu = _cpu(*checkpoint)
    monkeypatch.setattr(llm, "array_module", lambda a: object())
    with pytest.raises(MiniLLMError, match="device_model") as e:
        llm.batching_for(cpu)
    assert "\n" not in str(e.value)
