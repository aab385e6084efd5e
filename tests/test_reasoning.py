"""Reasoning output: Qwen3's <think>...</think> comes back as `reasoning_content` from the chat API (whole and
streamed, read with the official `openai` client) and apart from the answer in `minillm generate`; the
splitter's rules on their own, fed one character or a few at a time."""
import random
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from hf_models import qwen3_config
from minillm.engine.reasoning import ReasoningSplitter, split_reasoning

REASONING, ANSWER = "Sum small numbers", "Four"


# ---- the rules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, opened, expected", [
    ("<think>\nplan\n</think>\n\nHi", False, ("plan", "Hi")),
    ("  <think>plan</think>Hi  ", False, ("plan", "Hi  ")),
    ("Hi <think>x</think>", False, (None, "Hi <think>x</think>")),           # only at the start
    ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),                       # empty reasoning: none
    ("<think>cut off befo", False, ("cut off befo", "")),                     # unclosed: all reasoning
    ("<thin", False, (None, "<thin")),                                        # a partial tag that never came
    ("plan</think>\n\nHi", True, ("plan", "Hi")),                             # the prompt opened it
    ("Hi there", False, (None, "Hi there")),
])
def test_split_reasoning_follows_the_rules(text, opened, expected):
    assert split_reasoning(text, opened_in_prompt=opened) == expected


def test_a_stream_cut_anywhere_splits_like_the_whole_answer():
    text = "<think>\nstep one\n  two <b>\n</think>\n\nThe answer  is 4.\n"
    expected = split_reasoning(text)
    assert expected == ("step one\n  two <b>", "The answer  is 4.\n")
    rng = random.Random(0)
    for _ in range(300):
        splitter, parts, at = ReasoningSplitter(), [], 0
        while at < len(text):
            n = rng.randint(1, 5)
            parts.append(splitter.push(text[at:at + n]))
            at += n
        parts.append(splitter.finish())
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected


# ---- a Qwen3 model that thinks on cue --------------------------------------------------------------

@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A random Qwen3 with a Qwen3 tokenizer and chat template, whose weights make greedy decoding write
    "<think>" REASONING "</think>" ANSWER then <|im_end|>: attention and MLP outputs are zeroed, so each
    next token depends on the current one only, and the LM head maps each token of the script to the next."""
    from tokenizer_corpus import qwen_tokenizer
    from hf_models import save_random_model
    path = tmp_path_factory.mktemp("thinker")
    tok = qwen_tokenizer(path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_end = tok("assistant\n", add_special_tokens=False).input_ids[-1]      # the generation prompt's last
    script = [prompt_end] + tok(f"<think>{REASONING}</think>{ANSWER}", add_special_tokens=False).input_ids + [end]
    assert len(set(script)) == len(script)           # each token has one successor
    hf = save_random_model(qwen3_config(vocab_size=len(tok), eos_token_id=end, tied=False), path / "tmp")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        h = hf.model.norm(hf.model.embed_tokens.weight)                       # [vocab, dim] what the head sees
        head = torch.zeros_like(hf.lm_head.weight)
        for token, successor in zip(script, script[1:]):
            head[successor] = 20 * h[token] / h[token].norm()
        hf.lm_head.weight.copy_(head)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(thinker):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import minillm
    from minillm.engine.engine import Engine
    from minillm.serve.server import create_app, serve_in_thread
    llm = minillm.load(str(thinker), threads=1)
    assert llm.generate([{"role": "user", "content": "2+2?"}], max_tokens=20).text == \
        f"<think>{REASONING}</think>{ANSWER}"
    with serve_in_thread(create_app(llm, Engine(llm, max_batch=4), "thinker")) as url:
        yield SimpleNamespace(client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120))


def test_chat_returns_the_reasoning_as_reasoning_content(served):
    got = served.client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": "2+2?"}],
                                                max_tokens=20, temperature=0)
    message = got.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == (ANSWER, REASONING)
    assert got.choices[0].finish_reason == "stop"


def test_streamed_chat_sends_the_reasoning_as_reasoning_content_deltas(served):
    chunks = list(served.client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "2+2?"}], max_tokens=20, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert (reasoning, "".join(d.content or "" for d in deltas)) == (REASONING, ANSWER)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])


def test_a_completion_keeps_the_raw_text(served, thinker):
    """Only the chat API splits: /v1/completions returns what the model wrote."""
    import minillm
    llm = minillm.load(str(thinker), threads=1)
    prompt = llm.tokenizer.render_chat([{"role": "user", "content": "2+2?"}])
    got = served.client.completions.create(model="thinker", prompt=prompt, max_tokens=20, temperature=0)
    assert got.choices[0].text == f"<think>{REASONING}</think>{ANSWER}"


def test_generate_prints_the_reasoning_apart_from_the_answer(thinker):
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["generate", "--model", str(thinker), "--chat", "--max-tokens", "20",
                                      "--threads", "1", "2+2?"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"thinking:\n{REASONING}\n\nanswer:\n{ANSWER}\n"
