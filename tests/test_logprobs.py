"""logprobs: the log-softmax of the raw logits (before penalties, bias and masks), per generated token and,
with completions' echo, per prompt token; checked against torch.log_softmax of HF transformers' logits on
the same SmolLM2 weights, through generate, the Engine and `minillm serve` with the official client."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import minillm
from hf_models import llama_config, save_random_model
from minillm.engine.engine import Engine
from minillm.engine.sampling import log_softmax

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ATOL = 2e-3                  # minillm's float32 forward against HF's: the same weights, other summation orders


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return minillm.load(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()


def hf_log_softmax(hf, ids: list[int]) -> np.ndarray:
    """torch.log_softmax of HF's logits at every position of ids.    -> [len(ids), vocab]"""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def _check_against_hf(hf, prompt_ids, token_ids, entries, top: int):
    ref = hf_log_softmax(hf, prompt_ids + token_ids)[len(prompt_ids) - 1:-1]        # row i predicts token i
    assert [e.token for e in entries] == token_ids
    np.testing.assert_allclose([e.logprob for e in entries], ref[np.arange(len(token_ids)), token_ids], atol=ATOL)
    for e, row in zip(entries, ref):
        assert len(e.top) == top
        np.testing.assert_allclose([lp for _, lp in e.top], np.sort(row)[::-1][:top], atol=ATOL)
        assert {t for t, _ in e.top[:1]} == {int(np.argmax(row))}


def test_generate_logprobs_are_the_raw_log_softmax_even_with_penalties_and_bias(llm, hf):
    """The controls change which tokens come (the greedy pick is banned by its bias), not the reported values."""
    prompt = "The capital of France is"
    ids = llm.prompt_ids(prompt, chat=False)
    first = llm.generate(prompt, max_tokens=1, chat=False).token_ids[0]
    g = llm.generate(prompt, max_tokens=5, chat=False, logprobs=3, presence_penalty=1.0, repetition_penalty=1.2,
                     logit_bias={first: -100.0})
    assert g.token_ids[0] != first
    _check_against_hf(hf, ids, g.token_ids, g.logprobs, top=3)
    assert g.logprobs[0].top[0][0] == first                 # the banned token is still the model's favourite


def test_engine_prompt_logprobs_through_chunked_prefill_and_preemption(tmp_path):
    """Prompt logprobs come from every row of the prompt's chunks, however the scheduler splits them and
    even when a preempted request recomputes its prompt; the prefix cache does not skip them."""
    save_random_model(llama_config(n_heads=8, n_kv_heads=2, eos_token_id=None), tmp_path)
    tiny = minillm.load(str(tmp_path))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 320, n).tolist() for n in (21, 9, 30)]
    engine = Engine(tiny, max_batch_tokens=8, num_blocks=12, block_size=4)
    engine.generate([prompts[0]], max_tokens=2)                 # its blocks now cached: a hit the next would take
    got = engine.generate(prompts, max_tokens=8, prompt_logprobs=2, logprobs=1)
    for prompt, g in zip(prompts, got):
        ref = np.stack([log_softmax(row) for row in tiny.logits(prompt + g.token_ids)])    # [L, vocab]
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(prompt)
        np.testing.assert_allclose([e.logprob for e in g.prompt_logprobs[1:]],
                                   ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
        assert [len(e.top) for e in g.prompt_logprobs[1:]] == [2] * (len(prompt) - 1)
        np.testing.assert_allclose([e.logprob for e in g.logprobs],
                                   ref[np.arange(len(prompt) - 1, len(prompt) + 7), g.token_ids], atol=1e-4)


# ---- the server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(llm):
    from minillm.serve.server import create_app, serve_in_thread
    app = create_app(llm, Engine(llm), "smollm2")
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        yield SimpleNamespace(url=url, client=client, llm=llm)


MESSAGES = [{"role": "user", "content": "Name a color."}]


def test_chat_logprobs_match_hf_streamed_or_not(served, hf):
    ids = served.llm.prompt_ids(MESSAGES)
    got = served.client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=4)
    content = got.choices[0].logprobs.content
    tokens = served.llm.generate(MESSAGES, max_tokens=5).token_ids
    ref = hf_log_softmax(hf, ids + tokens)[len(ids) - 1:-1]
    np.testing.assert_allclose([c.logprob for c in content], ref[np.arange(5), tokens], atol=ATOL)
    assert "".join(c.token for c in content) == got.choices[0].message.content
    assert [bytes(c.bytes) for c in content] == [served.llm.tokenizer.decode_bytes([t]) for t in tokens]
    for c, row in zip(content, ref):
        assert [t.bytes for t in c.top_logprobs] == [list(served.llm.tokenizer.decode_bytes([int(t)]))
                                                     for t in np.argsort(-row)[:4]]
    chunks = list(served.client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=5,
                                                        temperature=0, logprobs=True, top_logprobs=4, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    # the same tokens; the values to float32 rounding (the stream's prompt comes from the prefix cache)
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, [t.token for t in c.top_logprobs]) for c in content]
    np.testing.assert_allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=1e-4)
    plain = served.client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None                  # none unless asked for


def test_completion_echo_logprobs_cover_the_prompt_then_the_answer(served, hf):
    prompt = "The capital of France is"
    ids = served.llm.prompt_ids(prompt, chat=False)
    got = served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                           logprobs=2)
    choice, tokens = got.choices[0], served.llm.generate(prompt, max_tokens=4, chat=False).token_ids
    assert choice.text == prompt + served.llm.tokenizer.decode(tokens)
    lp = choice.logprobs
    ref = hf_log_softmax(hf, ids + tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(len(ids) + 3), (ids + tokens)[1:]], atol=ATOL)
    assert lp.tokens == [served.llm.tokenizer.decode([t]) for t in ids + tokens]
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    chunks = list(served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0,
                                                   echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    np.testing.assert_allclose([v for p in parts for v in p.token_logprobs[1 if p is parts[0] else 0:]],
                               lp.token_logprobs[1:])


def test_completion_logprobs_without_echo_are_the_answers(served, hf):
    ids = served.llm.prompt_ids("Once upon a time", chat=False)
    got = served.client.completions.create(model="smollm2", prompt=ids, max_tokens=3, temperature=0, logprobs=0)
    lp, tokens = got.choices[0].logprobs, served.llm.generate("Once upon a time", max_tokens=3, chat=False).token_ids
    ref = hf_log_softmax(hf, ids + tokens)[len(ids) - 1:-1]
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(3), tokens], atol=ATOL)
    assert lp.top_logprobs == [{}, {}, {}] and "".join(lp.tokens) == got.choices[0].text


@pytest.mark.parametrize("path,body,param,fragment", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "boolean"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "integer"),
    ("/v1/completions", {"echo": "yes"}, "echo", "boolean"),
])
def test_bad_logprobs_requests_are_400s(served, path, body, param, fragment):
    base = {"model": "smollm2", "max_tokens": 2}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"})
    r = httpx.post(f"{served.url}{path}", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]
