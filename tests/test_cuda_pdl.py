"""Programmatic dependent launch on the GPU: the decode graph with PDL (KernelSettings.pdl) gives the same
tokens and the same logits, bit for bit, as without it (the same kernels; only when each may start
changes), for 16-bit, int8 and int4 weights and both KV caches; so does int8's q|k|v GEMV at 3 blocks an SM
against the lab's 2-blocks build. Skipped without a CUDA device."""
import numpy as np
import pytest

from gpu_skip import cupy_with_a_device

cp = cupy_with_a_device()

from minillm.cuda.dev.lab import LabTransformer  # noqa: E402
from minillm.cuda.dev.model import greedy  # noqa: E402
from minillm.cuda.gpu_model import GPUTransformer  # noqa: E402
from minillm.model.config import ModelConfig  # noqa: E402

CONFIG = ModelConfig(vocab_size=512, dim=256, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=704, max_seq_len=256,
                     family="mistral")


def greedy_run(model, prompt, n_new: int):
    """Tokens and every step's logits (the prefill's and n_new decodes'), stacked."""
    tokens, logits = greedy(model, prompt, n_new + 1, model.new_cache(len(prompt) + n_new + 4))
    return tokens, np.stack(logits)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
@pytest.mark.parametrize("kv_cache", ["auto", "int8"])
def test_pdl_changes_no_number(quant, kv_cache):
    gpu = GPUTransformer.random(CONFIG, "float16", seed=3, quant=quant).with_options(kv_cache=kv_cache)
    prompt = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 9)
    tokens, logits = greedy_run(gpu.with_settings(pdl=False), prompt, 12)   # (PDL is on by default)
    tokens_pdl, logits_pdl = greedy_run(gpu.with_settings(pdl=True), prompt, 12)
    assert tokens_pdl == tokens
    np.testing.assert_array_equal(logits_pdl, logits)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_cache", ["auto", "int8"])
def test_the_int8_qkv_gemvs_3_blocks_build_changes_no_number(dtype, kv_cache):
    """gemv_quant.cu's _3b q|k|v kernels (int8's shipped build) walk each lane's chunks in the order the
    2-blocks-an-SM build (the lab's qkv_one_round=False) does, 4 a step instead of 8, over another grid: the same
    sums, bit for bit."""
    gpu = GPUTransformer.random(CONFIG, dtype, seed=3, quant="int8").with_options(kv_cache=kv_cache)
    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 9)
    tokens, logits = greedy_run(gpu, prompt, 12)
    tokens_2, logits_2 = greedy_run(LabTransformer.of(gpu, qkv_one_round=False), prompt, 12)
    assert tokens_2 == tokens
    np.testing.assert_array_equal(logits_2, logits)
