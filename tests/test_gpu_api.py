"""Issue 43's API on the GPU engine (GPUTransformer and its batching runner), through the official `openai` client
against a real server; skipped without a CUDA device (the CPU side of each feature has its own tests).

The model: a random Llama shape (head_dim 64: the tensor-core prefill) with a Qwen-style byte-level tokenizer
trained here and Qwen3's chat template (it renders tools). Random weights say nothing sensible, which is the
point for a mask: whatever the model prefers, the grammar decides what may come out."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.cuda import available as gpu_available

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA device")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from hf_models import llama_config, save_random_model
    from tokenizer_corpus import qwen_tokenizer
    path = tmp_path_factory.mktemp("gpu-api")
    tok = qwen_tokenizer(path)
    save_random_model(llama_config(n_heads=4, n_kv_heads=2, vocab_size=-(-len(tok) // 64) * 64, hidden_size=256,
                                   intermediate_size=512, head_dim=64, initializer_range=0.2, max_position_embeddings=2048,
                                   eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")), path)
    return path


@pytest.fixture(scope="module")
def served(folder):
    import minillm
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.engine.engine import Engine
    from minillm.serve.server import create_app, serve_in_thread
    llm = minillm.load(str(folder), device="cuda")
    assert isinstance(llm.model, GPUTransformer)
    engine = Engine(llm, max_kv_bytes=64 << 20)
    with serve_in_thread(create_app(llm, engine, "tiny")) as url:
        yield SimpleNamespace(client=openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120),
                              llm=llm, engine=engine)


ASK = [{"role": "user", "content": "Pick one."}]


def test_grammars_hold_on_the_gpu_engine_at_temperature_1(served):
    """A choice and a regex, whose answers end on their own (JSON on real SmolLM2: test_structured_output.py)."""
    c = served.client.chat.completions
    for seed in range(3):
        color = c.create(model="tiny", messages=ASK, temperature=1.0, seed=seed, max_tokens=16,
                         extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}).choices[0]
        assert color.message.content in ("red", "green", "blue") and color.finish_reason == "stop"
        number = c.create(model="tiny", messages=ASK, temperature=1.0, seed=seed, max_tokens=16,
                          extra_body={"structured_outputs": {"regex": "[0-9]{1,3} (kg|g)"}}).choices[0].message.content
        head, unit = number.split(" ")
        assert head.isdigit() and len(head) <= 3 and unit in ("kg", "g")


def test_logprobs_on_the_gpu_are_the_cpu_models_log_softmax(served, folder):
    """The first answer token's logprob and top 5, against the CPU model's log-softmax on the same 16-bit weights."""
    import minillm
    prompt = [5, 17, 42, 99, 3, 250]
    got = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=5)
    first = got.choices[0].logprobs
    cpu = minillm.load(str(folder), dtype="float16")
    logits = cpu.logits(prompt)[-1].astype(np.float64)                  # the next token's, after the prompt
    log_softmax = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert abs(first.token_logprobs[0] - log_softmax.max()) < 2e-2
    want = np.sort(log_softmax)[-5:][::-1]
    assert np.allclose(sorted(first.top_logprobs[0].values(), reverse=True), want, atol=2e-2)


def test_a_bias_and_penalties_at_temperature_0_never_take_the_device_greedy_path(served):
    """Banning the greedy token by logit_bias changes the answer: the device argmax, which never sees the bias,
    would have picked it."""
    c = served.client.completions
    plain = c.create(model="tiny", prompt=[5, 17, 42], max_tokens=1, temperature=0, logprobs=1)
    top = plain.choices[0].logprobs.tokens[0]
    token_id = served.llm.tokenizer.encode(top, allow_special=True)
    assert len(token_id) == 1
    banned = c.create(model="tiny", prompt=[5, 17, 42], max_tokens=1, temperature=0, frequency_penalty=1.0,
                      logit_bias={str(token_id[0]): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_n_choices_share_the_prompt_differ_and_repeat_with_a_seed(served):
    ask = dict(model="tiny", prompt="the model thinks", max_tokens=12, temperature=1.0, seed=7, n=3,
               extra_body={"ignore_eos": True})
    first = [ch.text for ch in served.client.completions.create(**ask).choices]
    again = [ch.text for ch in served.client.completions.create(**ask).choices]
    assert first == again and len(set(first)) > 1


def test_a_required_tool_call_comes_back_as_tool_calls(served):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 12}},
                                                   "required": ["city"], "additionalProperties": False}}}]
    answer = served.client.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                                   temperature=1.0, seed=3, max_tokens=64).choices[0]
    calls = answer.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
