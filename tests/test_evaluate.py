"""Perplexity equals HF transformers' loss on the same windows, and is the vocabulary size for a
model that knows nothing."""
import math
import shutil

import numpy as np
import pytest
import torch

import minillm
from hf_models import save_random_model
from minillm.errors import MiniLLMError
from minillm.tools.evaluate import _windows, eval_text, perplexity, run_cli

VOCAB = 49152   # SmolLM2's tokenizer, so the random model can read real text


@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory):
    """(HF model, minillm LLM, dir): a random 2-layer Llama with SmolLM2's tokenizer. initializer_range
    0.3 spreads the logits (std ~1.5, not ~0.1), so the NLL varies from token to token and an
    off-by-one between logits and targets shows."""
    from transformers import LlamaConfig
    path = tmp_path_factory.mktemp("tiny-smol-vocab")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, tie_word_embeddings=True)
    hf = save_random_model(config, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2_dir / name, path / name)
    return hf, minillm.load(str(path)), path


def _hf_nll(hf, ids, context, stride):
    """HF's recipe (docs: "Perplexity of fixed-length models"): mask the labels earlier windows
    already scored with -100, sum the cross-entropy of the rest."""
    total, count, scored_to = 0.0, 0, 0
    for start in range(0, len(ids), stride):
        end = min(start + context, len(ids))
        labels = torch.tensor([ids[start:end]])
        labels[:, :-(end - scored_to)] = -100
        with torch.no_grad():
            logits = hf(torch.tensor([ids[start:end]])).logits[0, :-1].double()
        total += torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100,
                                                   reduction="sum").item()
        count += int((labels[0, 1:] != -100).sum())
        scored_to = end
        if end == len(ids):
            break
    return total / count, count


def test_non_overlapping_windows_match_hf_loss(tiny):
    hf, llm, _ = tiny
    text = eval_text(1200)
    ids = llm.prompt_ids(text, chat=False)
    got = perplexity(llm, text, context=64)
    # HF's mean loss of each window, weighted by the tokens it scores (all but the window's first).
    losses, weights = [], []
    for start in range(0, len(ids), 64):
        window = torch.tensor([ids[start:start + 64]])
        if window.shape[1] < 2:
            continue
        with torch.no_grad():
            losses.append(hf(window, labels=window).loss.item())
        weights.append(window.shape[1] - 1)
    expected = float(np.average(losses, weights=weights))
    assert got.n_tokens == sum(weights)
    assert got.nll_mean == pytest.approx(expected, rel=1e-4)
    assert got.ppl == pytest.approx(math.exp(expected), rel=1e-4)


def test_sliding_windows_match_hf_recipe(tiny):
    hf, llm, _ = tiny
    text = eval_text(800)
    ids = llm.prompt_ids(text, chat=False)
    got = perplexity(llm, text, context=64, stride=24)
    expected, count = _hf_nll(hf, ids, 64, 24)
    assert got.n_tokens == count == len(ids) - 1
    assert got.nll_mean == pytest.approx(expected, rel=1e-4)


def test_uniform_logits_give_the_vocabulary_size(tiny, monkeypatch):
    _, llm, _ = tiny
    monkeypatch.setattr(llm, "logits", lambda ids: np.zeros((len(ids), VOCAB), np.float32))
    got = perplexity(llm, eval_text(500), context=32)
    assert got.ppl == pytest.approx(VOCAB, rel=1e-9)


@pytest.mark.parametrize("n, context, stride", [(10, 4, 4), (9, 4, 4), (2, 4, 4), (50, 16, 5), (17, 16, 16)])
def test_windows_score_every_token_but_the_first_once(n, context, stride):
    scored = sorted(t for _, first, end in _windows(n, context, stride) for t in range(first, end))
    if stride < context:     # sliding: every token after the first, once
        assert scored == list(range(1, n))
    else:                    # back to back: all but each window's first token
        assert scored == [t for t in range(1, n) if t % context]
    for start, first, end in _windows(n, context, stride):
        assert start < first < end <= start + context


def test_max_tokens_and_too_short_text(tiny):
    _, llm, _ = tiny
    assert perplexity(llm, eval_text(2000), context=32, max_tokens=40).n_tokens == 38   # 31 + 7
    with pytest.raises(MiniLLMError, match="at least 2"):
        perplexity(llm, "a", context=32)


def test_eval_text_is_a_fixed_prefix():
    whole = eval_text()
    assert len(whole) > 100_000
    assert eval_text(1000) == whole[:1000] == eval_text(1000)


def test_run_cli_reports_perplexity_and_the_change_from_baseline(tiny):
    _, llm, path = tiny
    plain = run_cli(str(path), n_chars=400, context=32)
    assert "perplexity" in plain and "baseline" not in plain
    for option in [dict(dtype="bfloat16"), dict(quant="int8")]:
        narrow = run_cli(str(path), n_chars=400, context=32, **option)
        assert "baseline" in narrow and "%" in narrow, option
    with pytest.raises(MiniLLMError, match="quant"):
        run_cli(str(path), quant="int3")


def test_run_cli_reads_a_text_file(tiny, tmp_path):
    _, _, path = tiny
    (tmp_path / "t.txt").write_text("The quick brown fox jumps over the lazy dog. " * 10)
    out = run_cli(str(path), text_file=tmp_path / "t.txt", context=32)
    assert "t.txt" in out and "perplexity" in out
    with pytest.raises(MiniLLMError, match="not found"):
        run_cli(str(path), text_file=tmp_path / "missing.txt")


def test_smollm2_perplexity_is_in_a_sane_range(smollm2_dir):
    llm = minillm.load(str(smollm2_dir))
    got = perplexity(llm, eval_text(2000), context=256)
    print(f"\nSmolLM2-135M perplexity on 2000 chars ({got.n_tokens} tokens, context 256): "
          f"{got.ppl:.2f} in {got.seconds:.1f} s")
    assert 2 < got.ppl < 100
