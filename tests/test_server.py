"""`minillm serve`: the OpenAI API over the continuous-batching engine, driven by the official client.

One server for the module (SmolLM2-135M on the CPU, uvicorn in a thread on a free loopback port);
every answer is checked against `llm.generate` on the same prompt ids, the only reference there is.
"""
import json
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

WORDS = ["apple", "river", "violin", "cactus", "lantern", "glacier", "pepper", "saddle", "orbit", "walnut",
         "harbor", "meadow", "copper", "falcon", "tunnel", "pillow", "thunder", "candle", "marble", "rocket",
         "garden", "silver", "ladder", "compass", "velvet", "anchor", "pebble", "basket", "island", "kettle",
         "mirror", "forest"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    """A running server: .url, .client (openai), .llm, .server (the app's OpenAIServer)."""
    import minillm
    from minillm.engine.engine import Engine
    from minillm.serve.server import create_app, serve_in_thread

    llm = minillm.load(smollm2_dir)
    app = create_app(llm, Engine(llm, max_batch=32), "smollm2")
    with serve_in_thread(app) as url:               # uvicorn on a free loopback port, in a thread
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        yield SimpleNamespace(url=url, client=client, llm=llm, server=app.state.server)


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed: 'name' or 'name{labels}' -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def wait_for(condition, timeout: float = 60.0, what: str = "condition"):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# ---- answers -----------------------------------------------------------------------------------------

def test_models_lists_the_served_model(served):
    assert [m.id for m in served.client.models.list().data] == ["smollm2"]


def test_greedy_completion_equals_generate(served):
    prompt = "Once upon a time"
    want = served.llm.generate(prompt, max_tokens=8, chat=False)
    got = served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason == "length"
    assert got.usage.prompt_tokens == len(served.llm.prompt_ids(prompt, chat=False))
    assert got.usage.completion_tokens == len(want.token_ids) == 8
    assert got.usage.total_tokens == got.usage.prompt_tokens + 8


def test_completion_of_token_ids_equals_generate(served):
    ids = served.llm.prompt_ids("The capital of France is", chat=False)
    want = served.llm.generate("The capital of France is", max_tokens=5, chat=False)
    got = served.client.completions.create(model="smollm2", prompt=ids, max_tokens=5, temperature=0)
    assert got.choices[0].text == want.text


def test_greedy_chat_equals_generate_with_the_chat_template(served):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    want = served.llm.generate(messages, max_tokens=6)
    got = served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(served.llm.prompt_ids(messages))   # the template's tokens count


def test_streamed_completion_joins_to_the_greedy_text(served):
    want = served.llm.generate("The sun is", max_tokens=6, chat=False)
    chunks = list(served.client.completions.create(model="smollm2", prompt="The sun is", max_tokens=6,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert len(text_chunks) >= 3                                  # it streamed, not one lump at the end
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_streamed_chat_sends_role_then_text_then_finish(served):
    messages = [{"role": "user", "content": "Say hi."}]
    want = served.llm.generate(messages, max_tokens=5)
    chunks = list(served.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=5,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert len({c.id for c in chunks}) == 1


def test_stream_is_server_sent_events_ending_in_done(served):
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_text_like_generate(served):
    prompt = "Once upon a time"
    full = served.llm.generate(prompt, max_tokens=8, chat=False).text
    stop = full.split()[2]                                       # a word the greedy text reaches
    want = served.llm.generate(prompt, max_tokens=8, chat=False, stop=[stop])
    for stream in (False, True):
        got = served.client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0,
                                               stop=stop, stream=stream)
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == want.text == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(served):
    def sample(seed):
        return served.client.completions.create(model="smollm2", prompt="Colors:", max_tokens=6, temperature=1.0,
                                                top_p=0.95, seed=seed).choices[0].text
    assert sample(7) == sample(7)


# ---- many clients, one batch -------------------------------------------------------------------------

def test_32_concurrent_streams_are_batched_and_not_interleaved(served):
    prompts = [f"{w} {w} {w}" for w in WORDS]
    want = [served.llm.generate(p, max_tokens=4, chat=False).text for p in prompts]
    assert len(set(want)) > len(want) // 2          # distinct answers, so a mix-up could not pass unseen
    got, errors = [None] * len(prompts), []
    start = threading.Barrier(len(prompts))

    def client(i):
        try:
            start.wait()
            stream = served.client.completions.create(model="smollm2", prompt=prompts[i], max_tokens=4,
                                                      temperature=0, stream=True)
            got[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as e:                      # reported below, with the request that failed
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    before = metrics(served.url)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    after = metrics(served.url)
    assert not errors, errors
    assert got == want
    assert after["minillm_batch_size_max"] > 1
    # One request at a time would take a step per token (128); shared steps prove the batch was shared.
    tokens = after["minillm_generation_tokens_total"] - before["minillm_generation_tokens_total"]
    steps = after["minillm_engine_steps_total"] - before["minillm_engine_steps_total"]
    assert tokens == 32 * 4 and steps < tokens / 4


# ---- /metrics ----------------------------------------------------------------------------------------

def test_metrics_are_prometheus_text_with_the_serving_numbers(served):
    served.client.completions.create(model="smollm2", prompt="One", max_tokens=3, temperature=0)
    text = httpx.get(f"{served.url}/metrics").text
    assert httpx.get(f"{served.url}/metrics").headers["content-type"].startswith("text/plain")
    for name in ["minillm_requests_running", "minillm_requests_waiting", "minillm_kv_blocks_used",
                 "minillm_kv_blocks_total", "minillm_generation_tokens_total", "minillm_batch_size"]:
        assert re.search(rf"^# TYPE {name} (gauge|counter)$", text, re.M), name
    for name in ["minillm_time_to_first_token_seconds", "minillm_inter_token_latency_seconds"]:
        assert f"# TYPE {name} histogram" in text
    m = metrics(served.url)
    assert m["minillm_kv_blocks_total"] > 0
    assert m["minillm_generation_tokens_total"] >= 3
    ttft = "minillm_time_to_first_token_seconds"
    assert m[f'{ttft}_bucket{{le="+Inf"}}'] == m[f"{ttft}_count"] >= 1
    assert m[f"{ttft}_sum"] > 0
    itl = "minillm_inter_token_latency_seconds"
    assert m[f"{itl}_count"] >= 2                   # 3 tokens: 2 gaps at least, from this request alone
    buckets = [v for k, v in m.items() if k.startswith(f"{itl}_bucket")]
    assert buckets == sorted(buckets)               # cumulative


# ---- errors ------------------------------------------------------------------------------------------

def _post(served, path, body, raw=None):
    r = httpx.post(f"{served.url}{path}", json=None if raw else body, content=raw, timeout=300,
                   headers={"content-type": "application/json"})
    return r.status_code, r.json()


@pytest.mark.parametrize("change,param,code", [
    ({"temperature": -0.5}, "temperature", None),
    ({"temperature": 3}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"n": 0}, "n", None),
    ({"n": 17}, "n", None),                       # past MAX_CHOICES
    ({"logprobs": 21}, "logprobs", None),                             # 0..20 alternatives per token
    ({"prompt": ""}, "prompt", None),
    ({"prompt": ["one", "two"]}, "prompt", None),
    ({"prompt": [1, 2, 10 ** 9]}, "prompt", None),
    ({"prompt": None}, "prompt", None),
    ({"max_tokens": 8192}, "max_tokens", "context_length_exceeded"),   # the context is 8192
])
def test_bad_completion_parameters_are_openai_400s(served, change, param, code):
    status, body = _post(served, "/v1/completions", {"model": "smollm2", "prompt": "Hi", **change})
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param and body["error"]["code"] == code
    assert body["error"]["message"]


def test_prompt_over_the_context_is_a_400(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model="smollm2", prompt="word " * 9000, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "context is 8192" in e.value.body["message"]


def test_unknown_model_is_a_404(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found" and "smollm2" in e.value.body["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_invalid_json_is_a_400(served, raw):
    status, body = _post(served, "/v1/chat/completions", None, raw=raw)
    assert status == 400 and body["error"]["code"] == "invalid_json"


def test_bad_chat_messages_are_400s(served):
    status, body = _post(served, "/v1/chat/completions", {"model": "smollm2", "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = _post(served, "/v1/chat/completions", {"model": "smollm2", "messages": [{"content": "no role"}]})
    assert status == 400 and body["error"]["param"] == "messages"


def test_unknown_route_is_an_openai_style_404(served):
    r = httpx.get(f"{served.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# ---- clients that leave, and an engine that fails ------------------------------------------------------

def _blocks_used(served) -> float:
    return metrics(served.url)["minillm_kv_blocks_used"]


def _aborted(served) -> float:
    return metrics(served.url).get('minillm_requests_finished_total{finish_reason="abort"}', 0.0)


def test_client_disconnect_mid_stream_frees_its_blocks(served):
    wait_for(lambda: metrics(served.url)["minillm_requests_running"] == 0, what="an idle server")
    baseline, aborted = _blocks_used(served), _aborted(served)
    stream = served.client.completions.create(model="smollm2", prompt="1, 2, 3, 4, 5, 6, 7,",  # counts on
                                              max_tokens=2000, temperature=0, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert _blocks_used(served) > baseline          # the request holds KV blocks while it runs
    stream.close()                                  # hang up mid-stream
    wait_for(lambda: _blocks_used(served) == baseline, what="the blocks to be freed")
    assert _aborted(served) == aborted + 1
    again = served.client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2       # and the server keeps serving


def test_client_that_times_out_on_a_plain_request_frees_its_blocks(served):
    wait_for(lambda: metrics(served.url)["minillm_requests_running"] == 0, what="an idle server")
    baseline, aborted = _blocks_used(served), _aborted(served)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", timeout=2,     # ignore_eos: no early end on a fast machine
                   json={"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 4000,
                         "temperature": 0, "ignore_eos": True})
    wait_for(lambda: _aborted(served) == aborted + 1 and _blocks_used(served) == baseline,
             what="the abort to free the blocks")


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(served, monkeypatch):
    engine = served.server.loop.engine
    wait_for(lambda: not engine.has_unfinished(), what="an idle engine")   # the failure must hit our request
    real_step = engine.step

    def broken_step():
        monkeypatch.setattr(engine, "step", real_step)      # fail once, then work again
        raise RuntimeError("simulated kernel crash")
    monkeypatch.setattr(engine, "step", broken_step)
    status, body = _post(served, "/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "simulated kernel crash" in body["error"]["message"]
    again = served.client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2


# ---- the HTTP benchmark client (minillm bench serve --url) ---------------------------------------------

def test_bench_client_runs_the_serving_workload_over_http(served):
    from minillm.tools.serve_client_bench import run_cli
    lines = []
    results = run_cli(served.url, n_requests=4, concurrency=2, prefix_share=0.75, workload="agentic",
                      prompt_len=32, output_len=3, echo=lines.append)
    from minillm.tools.serve_bench import agentic_workload
    sent = agentic_workload(4, served.llm.config.vocab_size, 32, 3, 0.75, seed=0)   # what run_cli built
    (r,) = results
    assert r.mode == "HTTP server" and len(r.ttft_s) == 4
    assert r.output_tokens == sum(sent.output_lens)            # ignore_eos: every request ran to its length
    assert all(t > 0 for t in r.ttft_s) and r.wall_s > 0
    assert r.prefix_hit_tokens >= 16            # the shared 24-token system prompt: a full block reused
    table = "\n".join(lines)
    assert "HTTP server" in table and "TTFT p90" in table and "through http://127.0.0.1" in table


def test_bench_serve_cli_drives_a_running_server(served):
    from click.testing import CliRunner
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["bench", "serve", "--url", served.url, "--requests", "2", "--concurrency", "2",
                                      "--workload", "random", "--prompt-len", "16", "--output-len", "2"])
    assert result.exit_code == 0, result.output
    assert "HTTP server" in result.output and "TTFT p90" in result.output


def test_bench_client_counts_every_token_with_ignore_eos(served):
    from minillm.tools.serve_bench import Workload
    from minillm.tools.serve_client_bench import run_http
    eos = served.llm.tokenizer.eos_ids[0]
    w = Workload("eos prompts", [[eos, eos, eos], [eos] * 5], [5, 3])    # likely to stop at once without it
    r = run_http(served.url, "smollm2", w, concurrency=2)
    assert r.output_tokens == 8 and len(r.itl_s) == 2


def test_sse_stream_text_reads_completions_and_chat_streams():
    from minillm.tools.serve_client_bench import stream_text
    completion = ('data: {"choices": [{"text": "Hel", "finish_reason": null}]}\n\n'
                  'data: {"choices": [{"text": "lo", "finish_reason": "length"}]}\n\n'
                  'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    assert stream_text(completion) == ("Hello", "length")
    chat = (': keep-alive\r\n\r\ndata: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\r\n\r\n'
            'data: {"choices": [{"delta": {"content": "Hi \\u00e9"}}]}\r\n\r\n'
            'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\r\n\r\ndata: [DONE]\r\n\r\n')
    assert stream_text(chat) == ("Hi \u00e9", "stop")


def test_bench_client_without_a_server_is_one_clear_error():
    from minillm.errors import MiniLLMError
    from minillm.tools.serve_client_bench import run_cli
    with pytest.raises(MiniLLMError, match="no OpenAI-compatible server answers at http://127.0.0.1:"):
        run_cli(f"http://127.0.0.1:{_free_port()}")


# ---- the command line ----------------------------------------------------------------------------------

def test_serve_help_lists_its_options():
    from click.testing import CliRunner
    from minillm.cli import cli
    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ["--model", "--host", "--port", "--max-concurrency", "--device", "--quant"]:
        assert option in result.output


def test_serve_without_fastapi_says_what_to_install(monkeypatch):
    import sys
    from click.testing import CliRunner
    from minillm.cli import cli
    from minillm.resources import install_hint
    import minillm.serve
    monkeypatch.setitem(sys.modules, "fastapi", None)           # as if it were not installed
    monkeypatch.delitem(sys.modules, "minillm.serve.server", raising=False)
    monkeypatch.delattr(minillm.serve, "server", raising=False)  # else `from minillm.serve import server` finds it
    result = CliRunner().invoke(cli, ["serve", "--port", str(_free_port())])
    assert result.exit_code == 1
    # the hint installs minillm's serve extra, never PyPI's unrelated `minillm` (tests/test_install_hints.py)
    assert result.output.strip() == f"minillm: error: minillm serve needs FastAPI and uvicorn: {install_hint('serve')}"


def test_serve_on_a_busy_port_is_one_line():
    from click.testing import CliRunner
    from minillm.cli import cli
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = CliRunner().invoke(cli, ["serve", "--port", str(busy.getsockname()[1])])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillm: error: cannot listen on 127.0.0.1:")
