"""The real default model, SmolLM2-135M-Instruct, converted from its GGUF, against HF transformers
loading the very same GGUF file (fp32)."""
import numpy as np
import pytest
import torch

import minillm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "1, 1, 2, 3, 5, 8,",
]


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return minillm.load(str(smollm2_dir))


def _ids(llm, text):
    return llm.prompt_ids(text, chat=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_hf(llm, hf, prompt):
    ids = _ids(llm, prompt)
    ours = llm.logits(ids)[-1]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1].numpy()
    assert np.abs(ours - theirs).max() <= 1e-3


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_continuation_matches_hf_token_for_token(llm, hf, prompt):
    ids = _ids(llm, prompt)
    ours = llm.generate(prompt, max_tokens=32, temperature=0.0, chat=False)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          eos_token_id=sorted(llm.tokenizer.eos_ids), pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    theirs = [t for t in theirs if t not in llm.tokenizer.eos_ids]
    assert ours.token_ids == theirs
    assert ours.text == llm.tokenizer.decode(ours.token_ids)


def test_chat_answers_and_stops_at_end_of_turn(llm):
    g = llm.generate([{"role": "user", "content": "What is the capital of France?"}], max_tokens=40)
    assert "Paris" in g.text
    assert g.finish_reason == "stop"
    assert g.ttft_s > 0 and g.decode_tok_s > 0


def test_stop_strings_cut_the_text(llm):
    g = llm.generate("1, 2, 3, 4, 5,", max_tokens=30, chat=False, stop=["8"])
    assert "8" not in g.text and g.finish_reason == "stop"
    assert g.text.strip().startswith("6")


def test_streamed_pieces_add_up_to_the_text(llm):
    pieces = []
    g = llm.generate("Write a haiku about the sea.", max_tokens=24, chat=True, on_text=pieces.append)
    assert "".join(pieces) == g.text and len(pieces) > 1


def test_seeded_sampling_is_reproducible(llm):
    a = llm.generate("The weather today", max_tokens=12, temperature=0.9, top_p=0.9, seed=3, chat=False)
    b = llm.generate("The weather today", max_tokens=12, temperature=0.9, top_p=0.9, seed=3, chat=False)
    assert a.token_ids == b.token_ids
