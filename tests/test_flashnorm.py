"""FlashNorm: folded checkpoints give HF transformers the same logits, the deferred normalization gives
minillm the same logits and the same greedy text, and `minillm convert --flashnorm` works end to end."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import minillm
from hf_models import hf_logits, llama_config, save_random_model
from minillm.model import flashnorm
from minillm.model import transformer as model_module
from minillm.cli import cli
from minillm.model.layers import rmsnorm
from minillm.model.transformer import Transformer
from minillm.checkpoints.weights import load_hf_dir

TOL = 1e-4
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def _ids(n=24, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def convert(src, dst, *flags):
    result = CliRunner().invoke(cli, ["convert", str(src), str(dst), "--flashnorm", *flags])
    assert result.exit_code == 0, result.output
    return result.output


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def norms(path) -> dict[str, np.ndarray]:
    _, tensors = load_hf_dir(path)
    return {k: np.asarray(v, np.float32) for k, v in tensors.items() if k.endswith("norm.weight")}


# ---- Prop. 1 on one matrix ------------------------------------------------------------------------

def test_fold_moves_the_gain_into_the_columns():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((48, 64)).astype(np.float32)
    gain = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
    w_before = w.copy()
    folded = flashnorm.fold_rmsnorm_into_linear(gain, w)
    np.testing.assert_allclose(rmsnorm(x, np.ones(64, np.float32), 1e-5) @ folded.T,
                               rmsnorm(x, gain, 1e-5) @ w.T, atol=1e-5, rtol=0)
    assert np.array_equal(w, w_before)
    assert not np.allclose(folded, w)                       # the columns really were scaled


def test_fold_keeps_bf16_storage():
    from minillm.backend import as_f32, to_dtype
    w = to_dtype(np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32), "bfloat16")
    gain = to_dtype(np.full(8, 2.0, np.float32), "bfloat16")
    folded = flashnorm.fold_rmsnorm_into_linear(gain, w)
    assert folded.dtype == np.uint16 and np.array_equal(as_f32(folded), 2 * as_f32(w))   # x2 is exact in bf16


# ---- folded checkpoints under HF transformers ---------------------------------------------------------

@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-untied")
    return save_random_model(llama_config(n_heads=8, n_kv_heads=2), path), path


def test_folded_untied_llama_gives_hf_the_same_logits(untied_llama, tmp_path):
    hf, src = untied_llama
    out = convert(src, tmp_path / "fn")
    got = norms(tmp_path / "fn")
    assert got and all(np.all(g == 1.0) for g in got.values())        # every norm weightless, the final one too
    assert "kept" not in out
    ids = _ids()
    np.testing.assert_allclose(hf_logits(hf_model(tmp_path / "fn"), ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_hf_dir):
    return hf_model(smollm2_hf_dir)


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_dir):
    return minillm.load_tokenizer(smollm2_dir / "tokenizer.json").encode("The capital of France is Paris, and the")


def test_folded_smollm2_keeps_the_tied_heads_final_norm(smollm2_dir, smollm2_hf, smollm2_ids, tmp_path):
    out = convert(smollm2_dir, tmp_path / "fn")
    assert "kept model.norm.weight" in out and "MB" in out
    got = norms(tmp_path / "fn")
    assert all(np.all(g == 1.0) for k, g in got.items() if k.endswith(LAYER_NORMS))
    assert not np.all(got["model.norm.weight"] == 1.0)
    config = json.loads((tmp_path / "fn" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    np.testing.assert_allclose(hf_logits(hf_model(tmp_path / "fn"), smollm2_ids),
                               hf_logits(smollm2_hf, smollm2_ids), atol=TOL, rtol=0)


def test_folded_smollm2_with_untie_folds_the_final_norm_too(smollm2_dir, smollm2_hf, smollm2_ids, tmp_path):
    out = convert(smollm2_dir, tmp_path / "fn", "--untie")
    assert "untied the LM head: +113.2 MB" in out                    # 49152 x 576 fp32
    assert all(np.all(g == 1.0) for g in norms(tmp_path / "fn").values())
    assert json.loads((tmp_path / "fn" / "config.json").read_text())["tie_word_embeddings"] is False
    np.testing.assert_allclose(hf_logits(hf_model(tmp_path / "fn"), smollm2_ids),
                               hf_logits(smollm2_hf, smollm2_ids), atol=TOL, rtol=0)


def test_folded_mla_model_gives_hf_the_same_logits(tmp_path):
    from test_mla import deepseek_config
    hf = save_random_model(deepseek_config(), tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "fn")
    got = norms(tmp_path / "fn")
    assert {k.split(".", 3)[3] for k in got if ".layers.0." in k} == {
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight"}
    assert all(np.all(g == 1.0) for g in got.values())              # the latent norms fold too
    ids = _ids()
    np.testing.assert_allclose(hf_logits(hf_model(tmp_path / "fn"), ids), hf_logits(hf, ids), atol=TOL, rtol=0)


# ---- Prop. 2 in minillm: load(..., flashnorm=True) -----------------------------------------------------

def test_deferred_norm_matches_the_standard_path(untied_llama):
    _, src = untied_llama
    plain, fn = minillm.load(str(src)), minillm.load(str(src), flashnorm=True)
    assert fn.model.flashnorm and fn.model.defer_head
    ids = _ids(30)
    np.testing.assert_allclose(fn.logits(ids), plain.logits(ids), atol=TOL, rtol=0)
    cache = fn.model.new_cache(len(ids))                              # decode, one position at a time
    fn.model.prefill(ids[:5], cache)
    stepped = np.stack([fn.model.decode(t, cache) for t in ids[5:]])
    np.testing.assert_allclose(stepped, plain.logits(ids)[5:], atol=TOL, rtol=0)


def test_deferred_path_is_the_one_that_runs(untied_llama, monkeypatch):
    """Not vacuous: every layer's MLP and the head go through flashnorm's deferred functions."""
    _, src = untied_llama
    calls = []
    for name in ("deferred_swiglu", "deferred_linear", "inv_rms"):
        real = getattr(model_module, name)
        monkeypatch.setattr(model_module, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    minillm.load(str(src), flashnorm=True, threads=1).logits(_ids(4))   # threads=1: no timing passes at load
    assert calls.count("deferred_swiglu") == 3 and calls.count("inv_rms") == 3 and calls.count("deferred_linear") == 1


def test_deferred_norm_on_mla_matches(tmp_path):
    from test_mla import deepseek_config
    save_random_model(deepseek_config(), tmp_path)
    ids = _ids()
    np.testing.assert_allclose(minillm.load(str(tmp_path), flashnorm=True).logits(ids),
                               minillm.load(str(tmp_path)).logits(ids), atol=TOL, rtol=0)


def test_fold_then_quantize_at_load(untied_llama):
    _, src = untied_llama
    ids = _ids()
    ref = minillm.load(str(src)).logits(ids)
    got = minillm.load(str(src), flashnorm=True, quant="int8").logits(ids)
    assert np.abs(got - ref).max() < 0.05                           # int8's own error, no more


def test_smollm2_flashnorm_logits_and_greedy_text(smollm2_dir):
    plain, fn = minillm.load(str(smollm2_dir)), minillm.load(str(smollm2_dir), flashnorm=True)
    assert fn.model.flashnorm and not fn.model.defer_head            # tied head: final norm kept
    ids = plain.prompt_ids("The capital of France is", chat=False)
    np.testing.assert_allclose(fn.logits(ids), plain.logits(ids), atol=TOL, rtol=0)
    prompt = "Once upon a time, in a land far away, there lived a"
    a, b = plain.generate(prompt, max_tokens=24), fn.generate(prompt, max_tokens=24)
    assert len(a.token_ids) > 8 and a.token_ids == b.token_ids


def test_unfolded_weights_refuse_the_deferred_path(untied_llama):
    _, src = untied_llama
    config, tensors = load_hf_dir(src)
    with pytest.raises(ValueError, match="layer 0's input_layernorm has a gain"):
        Transformer(config, tensors, flashnorm=True)


def test_fold_is_idempotent(untied_llama):
    _, src = untied_llama
    config, tensors = load_hf_dir(src)
    _, once, _ = flashnorm.fold_checkpoint(config, tensors)
    _, twice, report = flashnorm.fold_checkpoint(config, once)
    assert all(np.array_equal(once[k], twice[k]) for k in once) and len(report.folded) == 3 * 2 + 1


# ---- the command line: one-line errors -----------------------------------------------------------------

def _one_line_error(result, *fragments):
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("minillm: error:"), result.output
    for f in fragments:
        assert f in lines[0], lines[0]


def test_convert_flashnorm_user_errors(untied_llama, tmp_path):
    _, src = untied_llama
    run = lambda *a: CliRunner().invoke(cli, ["convert", *map(str, a)])
    _one_line_error(run(tmp_path / "missing", tmp_path / "x", "--flashnorm"), "missing': not a file or folder")
    _one_line_error(run(src, tmp_path / "x", "--untie"), "--untie only goes with --flashnorm")
    _one_line_error(run(src, src, "--flashnorm"), "must differ from the source")
    _one_line_error(run(src, tmp_path / "x", "--flashnorm", "--kv-heads", "1"), "--kv-heads first")
    (tmp_path / "empty").mkdir()
    _one_line_error(run(tmp_path / "empty", tmp_path / "x", "--flashnorm"), "config.json")
    assert run(src, tmp_path / "q", "--quant", "int8").exit_code == 0
    _one_line_error(run(tmp_path / "q", tmp_path / "x", "--flashnorm"), "stored quantized")


def test_convert_flashnorm_then_quantize_loads_weightless(untied_llama, tmp_path):
    _, src = untied_llama
    convert(src, tmp_path / "fn8", "--quant", "int8")
    llm = minillm.load(str(tmp_path / "fn8"), flashnorm=True)       # stored quantized, already folded: fine
    assert llm.config.quantization["method"] == "int8" and llm.model.flashnorm
    ids = _ids()
    assert np.abs(llm.logits(ids) - minillm.load(str(src)).logits(ids)).max() < 0.05
