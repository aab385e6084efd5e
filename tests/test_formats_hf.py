"""Checkpoints shipped in a low-bit format: an HF fine-grained fp8 checkpoint (F8_E4M3 weights with a
scale per 16 x 16 tile, written here with torch's float8) loads as minillm's block-scaled fp8 and
matches HF on the same weights dequantized by torch; MXFP4 and non-Llama fp8 layouts are refused."""
import json

import numpy as np
import pytest
import torch

import minillm
from hf_models import hf_logits, llama_config, save_random_model
from minillm.errors import MiniLLMError

BLOCK = 16


def _fp8_blocks(w: torch.Tensor):
    """HF's fp8 layout of one matrix: codes [out, in] and scale_inv [out/16, in/16] (amax / 448 a tile)."""
    rows, cols = w.shape
    tiles = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0                                  # [out/16, in/16]
    codes = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    dequantized = (codes.float().reshape(tiles.shape) * scale[:, None, :, None]).reshape(rows, cols)
    return codes, scale.float(), dequantized


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    path = tmp_path_factory.mktemp("fp8")
    hf = save_random_model(llama_config(initializer_range=0.1), path)
    tensors, dense = load_file(path / "model.safetensors"), {}
    for name in list(tensors):
        if ".layers." in name and name.endswith("proj.weight"):
            codes, scale, dense[name] = _fp8_blocks(tensors[name])
            tensors[name] = codes
            tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():                                   # HF's model on the same weights, dequantized by torch
        for name, p in hf.named_parameters():
            if name in dense:
                p.copy_(dense[name])
    return hf, path


def test_hf_fp8_checkpoint_matches_hf_on_its_dequantized_weights(fp8_pair):
    hf, path = fp8_pair
    llm = minillm.load(str(path))
    assert llm.config.quantization == {"method": "fp8", "kind": "e4m3", "block": [BLOCK, BLOCK]}
    w = llm.model.layers[0].wq
    assert type(w).__name__ == "Fp8Weight" and w.qweight.dtype == np.uint8 and w.block == (BLOCK, BLOCK)
    ids = np.random.default_rng(0).integers(0, 320, 16).tolist()
    np.testing.assert_allclose(llm.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_hf_fp8_checkpoint_converts_and_reloads(fp8_pair, tmp_path):
    from minillm.checkpoints.weights import load_hf_dir, save_hf_dir
    _, path = fp8_pair
    config, tensors = load_hf_dir(path)
    save_hf_dir(tmp_path / "again", config, tensors)                 # minillm's names now: qweight / scales
    ids = [1, 5, 9, 2]
    np.testing.assert_array_equal(minillm.load(str(tmp_path / "again")).logits(ids), minillm.load(str(path)).logits(ids))


@pytest.mark.parametrize("arch,quant,says", [
    ("LlamaForCausalLM", {"quant_method": "mxfp4"}, "MXFP4 checkpoints of GptOssForCausalLM"),   # GPT-OSS's loads
    ("GptOssForCausalLM", {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.experts"]},
     "experts are all MXFP4"),
    ("DeepseekV3ForCausalLM", {"quant_method": "fp8", "weight_block_size": [128, 128]}, "not MLA"),
    ("LlamaForCausalLM", {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "dynamic"),
    ("LlamaForCausalLM", {"quant_method": "fp8"}, "weight_block_size")])
def test_other_quantized_checkpoints_are_refused_in_one_line(tmp_path, arch, quant, says):
    from minillm.checkpoints.weights import read_config
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "quantization_config": quant}))
    with pytest.raises(MiniLLMError, match=says) as e:
        read_config(tmp_path)
    assert "\n" not in str(e.value)
