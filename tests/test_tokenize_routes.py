"""/tokenize and /detokenize in vLLM's shape, behind the API key like every model route; ids checked against
HF's tokenizer (AutoTokenizer on the same files: its encode, its chat template, its decode)."""
from types import SimpleNamespace

import pytest

import minillm

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

KEY = "sk-test-tokenize"
TEXTS = ["Hello world", "  spaces, émojis 🙂 and\nnewlines\t", "<|im_start|> is text here, not a control token"]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    from minillm.engine.engine import Engine
    from minillm.serve.server import ServeOptions, create_app, serve_in_thread
    from transformers import AutoTokenizer
    llm = minillm.load(smollm2_dir)
    app = create_app(llm, Engine(llm), "smollm2", ServeOptions(api_key=KEY))
    with serve_in_thread(app) as url:
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        yield SimpleNamespace(url=url, client=client, llm=llm, hf=AutoTokenizer.from_pretrained(smollm2_dir))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [None, True, False])
def test_tokenize_a_text_gives_hfs_ids(served, text, special):
    body = {"model": "smollm2", "prompt": text, **({} if special is None else {"add_special_tokens": special})}
    r = served.client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    want = served.hf(text, add_special_tokens=special is not False, split_special_tokens=True)["input_ids"]
    assert r.json() == {"tokens": want, "count": len(want), "max_model_len": served.llm.config.max_seq_len}


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tokenize_messages_gives_hfs_chat_template_ids(served, generation_prompt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    r = served.client.post("/tokenize", json={"model": "smollm2", "messages": messages,
                                              "add_generation_prompt": generation_prompt})
    assert r.status_code == 200, r.text
    want = served.hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert r.json()["tokens"] == list(want) and r.json()["count"] == len(want)


def test_tokenize_messages_with_tools_counts_the_chat_requests_prompt(served):
    """vLLM's shape: `tools` beside `messages` are rendered into the prompt as a chat request renders them
    (SmolLM2's template renders none: minillm's injected tools block), so the count is the chat's prompt_tokens."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    weather = {"type": "function",
               "function": {"name": "get_weather", "description": "The weather in a city", "parameters": city}}
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    chat = served.client.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                            "tools": [weather], "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    with_tools = served.client.post("/tokenize", json={"model": "smollm2", "messages": messages, "tools": [weather]})
    without = served.client.post("/tokenize", json={"model": "smollm2", "messages": messages})
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["count"] == chat.json()["usage"]["prompt_tokens"] > without.json()["count"]
    assert "get_weather" in served.hf.decode(with_tools.json()["tokens"])
    bad = dict(weather, function=dict(weather["function"], parameters={"type": "strin"}))
    refused = served.client.post("/tokenize", json={"model": "smollm2", "messages": messages, "tools": [bad]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert "Invalid type: strin" in refused.json()["error"]["message"]                    # as the chat refuses it


@pytest.mark.parametrize("text", TEXTS)
def test_detokenize_gives_hfs_text(served, text):
    ids = served.hf(text, add_special_tokens=False)["input_ids"]
    for body in ({"model": "smollm2", "tokens": ids}, {"tokens": ids}):          # the model is optional
        r = served.client.post("/detokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": served.hf.decode(ids)} == {"prompt": text}


def test_the_routes_want_the_api_key(served):
    for path, body in (("/tokenize", {"model": "smollm2", "prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(f"{served.url}{path}", json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "smollm2"}, 400, "prompt"),
    ("/tokenize", {"model": "smollm2", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "Hi"}, 400, "model"),
    ("/tokenize", {"model": "other", "prompt": "Hi"}, 404, "model"),
    ("/tokenize", {"model": "smollm2", "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "smollm2", "prompt": "Hi", "truncate": 4}, 400, "truncate"),
    ("/tokenize", {"model": "smollm2", "messages": [{"role": "user", "content": "b", "name": "x"}]}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
])
def test_bad_input_is_an_openai_style_error_naming_the_field(served, path, body, status, param):
    r = served.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert served.client.post("/tokenize", json={"model": "smollm2", "prompt": "ok"}).status_code == 200
