"""KV-head pooling (MHA -> GQA -> MQA): the result is a real checkpoint that HF and minillm agree on,
and the pooling groups the heads the way query heads use them."""
import numpy as np
import pytest
import torch

import minillm
from hf_models import hf_logits, llama_config, save_random_model
from minillm.tools.evaluate import eval_text, perplexity
from minillm.checkpoints.kv_heads import convert_kv_heads, convert_kv_heads_dir
from minillm.llm import LLM
from minillm.model.transformer import Transformer
from minillm.checkpoints.weights import load_hf_dir

TOL = 1e-4
# initializer_range 0.1 (not 0.02) makes attention peaked enough that keys routed to the wrong
# query heads move the logits visibly, not by ~1e-5.
PEAKED = dict(initializer_range=0.1)

CASES = {   # name: (HF config, n_kv_heads after conversion)
    "mha-to-gqa2": (lambda: llama_config(n_heads=8, n_kv_heads=8, **PEAKED), 2),
    "mha-to-mqa": (lambda: llama_config(n_heads=8, n_kv_heads=8, **PEAKED), 1),
    "smollm2-shape-to-mqa": (lambda: llama_config(n_heads=9, n_kv_heads=3, head_dim=8, hidden_size=72, tied=True, **PEAKED), 1),
}


def _ids(n=24, vocab=320, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _logits(config, tensors, ids):
    return LLM(config, Transformer(config, tensors)).logits(ids)


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_checkpoint_loads_in_hf_and_minillm_with_equal_logits(case, tmp_path):
    make_config, n_new = CASES[case]
    save_random_model(make_config(), tmp_path / "src")
    convert_kv_heads_dir(tmp_path / "src", tmp_path / "dst", n_new)

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == n_new
    ids = _ids()
    converted = minillm.load(str(tmp_path / "dst"))
    assert converted.config.n_kv_heads == n_new
    np.testing.assert_allclose(converted.logits(ids), hf_logits(hf, ids), atol=TOL, rtol=0)
    # Pooling distinct random heads is lossy: the converted model is a different model.
    original = minillm.load(str(tmp_path / "src")).logits(ids)
    assert np.abs(converted.logits(ids) - original).max() > 1e-2


def test_converting_to_the_same_number_of_kv_heads_is_the_identity(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=2), tmp_path)
    config, tensors = load_hf_dir(tmp_path)
    new_config, new_tensors = convert_kv_heads(config, tensors, 2)
    assert new_config == config
    assert new_tensors.keys() == tensors.keys()
    for name, a in tensors.items():
        np.testing.assert_array_equal(new_tensors[name], a, err_msg=name)


@pytest.mark.parametrize("n_heads, n_kv, n_new", [(8, 8, 2), (8, 4, 2), (9, 3, 1)])
def test_pooling_groups_of_equal_heads_changes_nothing(n_heads, n_kv, n_new, tmp_path):
    """If each group's heads are already equal, their mean is each of them, so the pooled model must
    be the same function. Grouping the wrong heads (e.g. j % n_new instead of j // group) or routing
    query heads to the wrong pooled head would average or pick unequal heads and change the logits."""
    hd = 8
    save_random_model(llama_config(n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                                  hidden_size=n_heads * hd, **PEAKED), tmp_path)
    config, tensors = load_hf_dir(tmp_path)
    tensors = dict(tensors)
    group = n_kv // n_new
    for i in range(config.n_layers):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            heads = np.array(tensors[key]).reshape(n_new, group, hd, -1)       # [n_new, group, hd, dim]
            heads[:] = heads[:, :1]                                             # every head = its group's first
            tensors[key] = heads.reshape(n_kv * hd, -1)
    new_config, new_tensors = convert_kv_heads(config, tensors, n_new)
    ids = _ids()
    np.testing.assert_allclose(_logits(new_config, new_tensors, ids), _logits(config, tensors, ids),
                               atol=1e-5, rtol=0)


def test_cache_bytes_per_token_shrink_by_the_head_ratio(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=8), tmp_path)
    config, tensors = load_hf_dir(tmp_path)
    for n_new in (4, 2, 1):
        new_config, new_tensors = convert_kv_heads(config, tensors, n_new)
        assert new_config.kv_bytes_per_token() * 8 == config.kv_bytes_per_token() * n_new
        cache = Transformer(new_config, new_tensors).new_cache(16)
        assert cache.nbytes * 8 == Transformer(config, tensors).new_cache(16).nbytes * n_new


@pytest.mark.parametrize("n_new", [0, 3, 16])
def test_a_count_that_does_not_divide_the_kv_heads_is_a_clear_error(n_new, tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=8), tmp_path / "src")
    with pytest.raises(ValueError, match="cannot pool 8 KV heads into .*choose one of 1, 2, 4, 8"):
        convert_kv_heads_dir(tmp_path / "src", tmp_path / "dst", n_new)
    assert not (tmp_path / "dst").exists()      # nothing half-written


def test_bf16_checkpoints_stay_bf16(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=4), tmp_path / "src")
    config, tensors = load_hf_dir(tmp_path / "src")
    minillm.checkpoints.weights.save_hf_dir(tmp_path / "bf16", config, tensors, dtype="bfloat16")
    convert_kv_heads_dir(tmp_path / "bf16", tmp_path / "dst", 2)
    new_config, new_tensors = load_hf_dir(tmp_path / "dst")
    assert new_config.torch_dtype == "bfloat16"
    assert {a.dtype for a in new_tensors.values()} == {np.dtype(np.uint16)}


def test_smollm2_pooled_to_one_kv_head_is_worse_but_finite(smollm2_dir):
    """The real 3 -> 1 conversion, in memory: quality drops without uptraining, but stays a model."""
    llm = minillm.load(str(smollm2_dir))
    config, tensors = load_hf_dir(smollm2_dir)
    mqa_config, mqa_tensors = convert_kv_heads(config, tensors, 1)
    mqa = LLM(mqa_config, Transformer(mqa_config, mqa_tensors), llm.tokenizer)
    text = eval_text(400)
    before = perplexity(llm, text, context=64, max_tokens=64)
    after = perplexity(mqa, text, context=64, max_tokens=64)
    print(f"\nSmolLM2 ppl over {before.n_tokens} tokens: 3 KV heads {before.ppl:.2f}, 1 KV head {after.ppl:.2f}")
    assert np.isfinite(after.ppl)
    assert after.ppl > before.ppl


def test_quantized_weights_are_refused(tmp_path):
    save_random_model(llama_config(n_heads=8, n_kv_heads=4), tmp_path)
    config, tensors = load_hf_dir(tmp_path)
    if not hasattr(config, "quantization"):
        pytest.skip("this ModelConfig has no quantization field")
    quantized = config.replace(quantization={"method": "int8"})
    with pytest.raises(ValueError, match="stored quantized"):
        convert_kv_heads(quantized, tensors, 2)


@pytest.mark.parametrize("kind", ["kv-heads", "flashnorm", "quant"])
def test_every_hf_dir_conversion_carries_the_tokenizer_and_chat_template(kind, tmp_path):
    """A converted dir is a whole model: tokenizer, its config, the chat template (also as the newer
    separate chat_template.jinja) and the generation config come along, byte for byte."""
    from minillm.checkpoints.convert import convert_flashnorm
    from minillm.checkpoints.convert import convert
    from minillm.checkpoints.weights import TOKENIZER_FILES
    save_random_model(llama_config(n_heads=8, n_kv_heads=4), tmp_path / "src")
    def text(name):          # generation_config.json is read (its stop ids), so it must be JSON; the rest is opaque
        return '{"eos_token_id": [2, 7], "_note": "of the source"}' if name == "generation_config.json" else \
            f"{name} of the source"
    for name in TOKENIZER_FILES:
        (tmp_path / "src" / name).write_text(text(name))
    {"kv-heads": lambda: convert_kv_heads_dir(tmp_path / "src", tmp_path / "dst", 2),
     "flashnorm": lambda: convert_flashnorm(tmp_path / "src", tmp_path / "dst"),
     "quant": lambda: convert(tmp_path / "src", tmp_path / "dst", progress=False, quant="int8")}[kind]()
    for name in TOKENIZER_FILES:
        assert (tmp_path / "dst" / name).read_text() == text(name)
