"""generation_config.json's eos_token_id: the ids HF's generate stops on, which minillm stops on too."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

import minillm
from minillm.cli import cli
from hf_models import llama_config, save_random_model

PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def checkpoint(smollm2_dir, tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer, config.json's eos_token_id 2 (<|im_end|>), and the HF
    model itself (which reads the folder's generation_config.json at from_pretrained)."""
    path = tmp_path_factory.mktemp("generation-config")
    save_random_model(llama_config(vocab_size=49152, num_hidden_layers=2, eos_token_id=2, bos_token_id=1), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2_dir / name, path / name)
    return path


def _extra_stop(llm) -> tuple[list[int], int]:
    """(the prompt's ids, a token the greedy answer reaches at its 5th step or later, and not before)."""
    ids = llm.prompt_ids(PROMPT, chat=False)
    tokens = llm.generate(PROMPT, max_tokens=24, chat=False).token_ids
    for k in range(4, len(tokens)):
        if tokens[k] not in tokens[:k] and tokens[k] not in llm.tokenizer.eos_ids:
            return ids, tokens[k]
    pytest.fail(f"the random model's greedy answer repeats itself: {tokens}")


def test_generation_stops_on_generation_config_eos_like_hf_generate(checkpoint):
    """A generation_config.json whose eos_token_id list names one id more than config.json: minillm stops
    before it, as HF's generate (reading the same file) does, with the same tokens up to there."""
    from transformers import AutoModelForCausalLM
    ids, extra = _extra_stop(minillm.load(str(checkpoint)))
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra], "bos_token_id": 1}))
    try:
        ours = minillm.load(str(checkpoint)).generate(PROMPT, max_tokens=24, chat=False)
        hf = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        assert hf.generation_config.eos_token_id == [2, extra]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()
    finally:
        (checkpoint / "generation_config.json").unlink()
    assert theirs[-1] == extra and len(theirs) < 24          # HF stopped on the extra id ...
    assert ours.token_ids == theirs[:-1]                      # ... and minillm at the same place
    assert ours.finish_reason == "stop"


def test_the_int4_copy_kept_beside_the_weights_stops_on_them_too(checkpoint, monkeypatch):
    """`--quant int4`'s copy (checkpoints/quant_cache.py) has no generation_config.json: the first load and the
    one from the kept copy both stop on the source's."""
    from minillm.checkpoints import quant_cache
    real = quant_cache.quantize_checkpoint
    monkeypatch.setattr(quant_cache, "quantize_checkpoint",     # 64 calibration tokens: what is tested is the ids
                        lambda *args, **kwargs: real(*args, **kwargs, calibration_tokens=64))
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    try:
        first = minillm.load(str(checkpoint), quant="int4", group_size=32).config.eos_token_ids
        again = minillm.load(str(checkpoint), quant="int4", group_size=32).config.eos_token_ids
    finally:
        (checkpoint / "generation_config.json").unlink()
        shutil.rmtree(checkpoint / ".quantized")
    assert first == again == [2, 7]


def test_info_shows_each_files_stop_ids(checkpoint):
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    try:
        result = CliRunner().invoke(cli, ["info", "--model", str(checkpoint)])
    finally:
        (checkpoint / "generation_config.json").unlink()
    assert result.exit_code == 0, result.output
    assert "2 (config.json); 2 7 9 (generation_config.json)" in result.output


@pytest.mark.parametrize("text, error", [('{"eos_token_id": "x"}', "eos_token_id='x': expected an integer"),
                                         ("[1]", "not a JSON object")])
def test_a_bad_generation_config_is_refused_in_one_line(checkpoint, text, error):
    (checkpoint / "generation_config.json").write_text(text)
    try:
        result = CliRunner().invoke(cli, ["info", "--model", str(checkpoint)])
    finally:
        (checkpoint / "generation_config.json").unlink()
    assert result.exit_code != 0 and error in result.output and "Traceback" not in result.output
