"""Prefill with int8/int4 weights widened one GEMM ahead on a second stream (the lab's
LabSettings.prefill_widen_ahead, minillm/cuda/dev/widen_ahead.py) on the GPU: the same widened matrices reach
the same GEMMs, so the logits equal those of widening each matrix right before its GEMM, bit for bit: a whole prompt, a prompt in chunks, the
speculative verify pass (all rows' logits, replayed from a CUDA graph), an early exit, the int8 KV cache.
Skipped without a CUDA device."""
import numpy as np
import pytest

from gpu_skip import cupy_with_a_device

cp = cupy_with_a_device()

from minillm.cuda.dev.lab import LabTransformer  # noqa: E402
from minillm.cuda.gpu_model import GPUTransformer  # noqa: E402
from minillm.model.config import ModelConfig  # noqa: E402

CONFIG = ModelConfig(vocab_size=512, dim=256, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=704, max_seq_len=256)


def logits_of(model, prompt, chunk: int | None = None, n_layers: int | None = None):
    """The prompt's last logits, then 4 more positions' every logits through the verify pass, and whether it
    widened ahead (its second scratch buffer exists)."""
    if chunk is not None:
        model = model.with_options(prefill_chunk=chunk)
    cache = model.new_cache(64)
    first = model.prefill(prompt, cache, n_layers=n_layers)
    rows = model.prefill(np.array([3, 1, 4, 1]), cache, all_logits=True, n_layers=n_layers)
    return np.concatenate([first[None], rows]), model._ahead_parts is not None


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("kv_cache", ["auto", "int8"])
@pytest.mark.parametrize("chunk,n_layers", [(None, None), (5, None), (None, 2)])
def test_widening_ahead_changes_no_number(quant, kv_cache, chunk, n_layers):
    gpu = GPUTransformer.random(CONFIG, "float16", seed=5, quant=quant).with_options(kv_cache=kv_cache)
    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 23)
    before, widened_before = logits_of(LabTransformer.of(gpu, prefill_widen_ahead=False), prompt, chunk, n_layers)
    ahead, widened = logits_of(LabTransformer.of(gpu, prefill_widen_ahead=True), prompt, chunk, n_layers)
    assert widened and not widened_before
    np.testing.assert_array_equal(ahead, before)
