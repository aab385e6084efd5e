"""The public API on the GPU: minillm.load(..., device="cuda") runs the same checkpoint as the CPU.
Skipped where CuPy or a CUDA device is missing (CI); run on the GPU machine."""
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no CUDA device", allow_module_level=True)
except cupy.cuda.runtime.CUDARuntimeError:
    pytest.skip("no CUDA device", allow_module_level=True)

import minillm
from hf_models import llama_config, mistral_config, save_random_model

GPT2_VOCAB = Path(__file__).parent / "data" / "tokenizers" / "ggml-vocab-gpt-2.gguf"


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model_dir(request, tmp_path_factory):
    from minillm.checkpoints.tokenizer_files import load_tokenizer, save_hf
    path = tmp_path_factory.mktemp(request.param)
    make = llama_config if request.param == "llama" else mistral_config
    save_random_model(make(vocab_size=50257), path)
    save_hf(load_tokenizer(GPT2_VOCAB), path)
    return path


@pytest.mark.parametrize("dtype,tol", [("float16", 5e-3), ("bfloat16", 3e-2)])
def test_gpu_logits_match_cpu(model_dir, dtype, tol):
    ids = np.random.default_rng(0).integers(0, 50257, 40).tolist()
    cpu = minillm.load(str(model_dir), dtype=dtype).logits(ids)
    gpu = minillm.load(str(model_dir), device="cuda", dtype=dtype).logits(ids)
    assert np.abs(gpu - cpu).max() <= tol * np.abs(cpu).max()


def test_gpu_generate_streams_text(model_dir):
    llm = minillm.load(str(model_dir), device="cuda")
    pieces = []
    g = llm.generate("Hello there", max_tokens=12, chat=False, on_text=pieces.append)
    assert len(g.token_ids) == 12 and "".join(pieces) == g.text
    assert g.decode_tok_s > 0
