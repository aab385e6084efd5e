"""The live engine view's event stream (/api/live), the page's routes and their guards (issue 21).

A random 2-layer model behind the real server in a thread; requests are token ids, so no tokenizer and
no text anywhere: what the stream reports is checked against the engine itself."""
import json
import threading
from contextlib import contextmanager
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

REQUEST_KEYS = {"id", "state", "prompt_tokens", "output_tokens", "computed", "cached_tokens", "blocks", "age_s", "ttft_s"}
N_NEW = 40                  # tokens a request
FINISHED_KEYS = {"id", "reason", "prompt_tokens", "output_tokens", "t", "ttft_s", "duration_s"}


def _serve(**options):
    """A server in a thread on a random 2-layer model (no tokenizer: prompts are token ids)."""
    import minillm
    from minillm.engine.engine import Engine
    from minillm.llm import LLM
    from minillm.serve.server import ServeOptions, create_app, serve_in_thread
    from minillm.tools.bench import random_model
    from minillm.tools.planner import PlannerAPI

    config = minillm.ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                 max_seq_len=256)
    llm = LLM(config, random_model(config))
    engine = Engine(llm, max_batch=8, num_blocks=128, block_size=4)
    app = create_app(llm, engine, "tiny", ServeOptions(**options), planner=PlannerAPI())
    return serve_in_thread(app), engine, app


@pytest.fixture(scope="module")
def served():
    server, engine, app = _serve()
    with server as url:
        yield SimpleNamespace(url=url, engine=engine, live=app.state.server.loop.live, loop=app.state.server.loop)


class Stream:
    """/api/live, read on the test's own thread: `until(condition)` reads updates until one meets it."""

    def __init__(self, response):
        self.response, self.items = response, []
        self._lines = response.iter_lines()

    def until(self, condition, what: str) -> dict:
        for line in self._lines:
            if line.startswith("data: "):
                self.items.append(json.loads(line[6:]))
                if condition(self.items[-1]):
                    return self.items[-1]
        raise AssertionError(f"the stream ended before an update with {what}")


@contextmanager
def live(url: str, headers: dict | None = None):
    with httpx.Client(timeout=httpx.Timeout(30, read=30)) as client:
        with client.stream("GET", f"{url}/api/live", headers=headers or {}) as response:
            yield Stream(response)


def _complete(url: str, prompt: list[int], n: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()


def test_an_update_has_the_schema_and_its_stats_are_the_engines(served):
    with live(served.url) as stream:
        first = stream.until(lambda u: True, "anything")        # an idle engine still sends a first picture
        assert stream.response.status_code == 200
        assert stream.response.headers["content-type"].startswith("text/event-stream")
        assert set(first) == {"version", "t", "stats", "requests", "finished", "steps", "steps_dropped", "events", "pool",
                          "latency"}
        assert first["version"] == 1 and first["requests"] == [] and first["stats"] == served.engine.stats()
        assert first["pool"]["total"] == 128 and first["pool"]["block_size"] == 4

        prompts = [list(range(1, 14)), list(range(20, 31))]     # 13 and 11 tokens: 4 and 3 blocks of 4
        answers = [None, None]
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _complete(served.url, prompts[i], N_NEW)))
                   for i in range(2)]
        # Hold the engine's lock while both arrive: the engine thread waits in its first add_request and then
        # takes the second from its queue before it steps again, so one step batches both (white-box, for a
        # test that must not depend on timing).
        with served.engine._lock:
            for t in threads:
                t.start()
            deadline = time.time() + 30
            while served.loop._commands.qsize() < 1 and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
        n_finished = lambda: len({f["id"] for u in stream.items for f in u["finished"]})
        last = stream.until(lambda u: n_finished() >= 2 and not u["requests"], "both requests finished")
        for t in threads:
            t.join(timeout=60)
        assert all(a["usage"]["completion_tokens"] == N_NEW for a in answers)
        assert last["stats"] == served.engine.stats()            # the engine is idle: nothing changed since
        assert last["stats"]["blocks_used"] == 0
    updates = stream.items
    finished = {f["id"]: f for u in updates for f in u["finished"]}
    assert len(finished) == sum(len(u["finished"]) for u in updates) == 2      # each finish reported once
    for f in finished.values():
        assert set(f) == FINISHED_KEYS and f["reason"] == "length" and f["output_tokens"] == N_NEW
        assert f["prompt_tokens"] in (13, 11) and 0 < f["ttft_s"] <= f["duration_s"]
    steps = [s for u in updates for s in u["steps"]]
    ids = set(finished)
    assert any({r["id"] for r in s["rows"]} == ids for s in steps), "no step batched both requests"
    assert all(u["steps_dropped"] == 0 for u in updates)
    rows = [r for s in steps for r in s["rows"]]
    computed = sorted(sum(r["tokens"] for r in rows if r["id"] == rid) for rid in ids)
    assert computed == sorted(len(p) + N_NEW - 1 for p in prompts)     # each prompt once, then a decode row a new token but the last
    assert {r["kind"] for r in rows} == {"prefill", "decode"}
    assert sum(len(u["latency"]["ttft_s"]) for u in updates) == 2
    for u in updates:                                            # metadata only: ids, lengths, blocks, timings
        for r in u["requests"]:
            assert set(r) == REQUEST_KEYS
    both = [u for u in updates if len(u["requests"]) == 2]
    assert both, "no update showed both requests in the engine"
    blocks = [b for r in both[-1]["requests"] for b in r["blocks"]]
    assert len(blocks) == len(set(blocks)) and both[-1]["stats"]["blocks_used"] >= len(blocks)
    deadline = time.time() + 10
    while served.live.active:                                    # the closed stream's listener goes away
        assert time.time() < deadline, "the live view still has a listener after the stream closed"
        time.sleep(0.05)


def test_without_a_listener_the_hooks_never_touch_the_engine():
    from minillm.serve.live import LiveView

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the live view read engine.{name} with nobody watching")

    view = LiveView(Untouchable())
    for _ in range(3):
        view.before_step()
        view.after_step([])
        view.idle()
    assert not view.active


def test_the_page_and_planner_routes(served):
    page = httpx.get(f"{served.url}/")
    assert page.status_code == 200 and 'src="/static/app.js"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "cdn" not in page.text.lower() and "http" not in page.text.replace("http://www.w3.org", "")
    assert httpx.get(f"{served.url}/plan").status_code == 200
    for name in ("app.js", "plan.js", "common.js", "style.css"):
        assert httpx.get(f"{served.url}/static/{name}").status_code == 200
    assert httpx.get(f"{served.url}/static/../server.py").status_code == 404
    info = httpx.get(f"{served.url}/api/info").json()
    assert info == {"model": "tiny", "context": served.engine.config.max_seq_len, "block_size": 4, "blocks": 128,
                    "max_batch": 8, "planner": True}
    from minillm.tools.planner import PlannerAPI
    query = {"model": "mistral-7b", "gpu": "l40s", "context": "2048", "users": "8", "weight_dtype": "int4",
             "kv_dtype": "int8", "latency_ms": "30"}
    assert httpx.get(f"{served.url}/api/plan", params=query).json() == json.loads(json.dumps(PlannerAPI().plan(query)))
    bad = httpx.get(f"{served.url}/api/plan", params=query | {"gpu": "v100"})
    assert bad.status_code == 400 and "unknown GPU" in bad.json()["error"]["message"]


def test_with_an_api_key_the_stream_and_the_planner_need_it_and_the_host_is_checked():
    server, engine, app = _serve(api_key="sesame")
    with server as url:
        assert httpx.get(f"{url}/").status_code == 200           # the page's code is open: it asks for the key
        for path in ("/api/live", "/api/plan", "/api/plan/options", "/api/info"):
            refused = httpx.get(f"{url}{path}")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/api/plan/options", headers={"Authorization": "Bearer sesame"}).status_code == 200
        with live(url, {"Authorization": "Bearer sesame"}) as stream:
            assert stream.until(lambda u: True, "a first update")["stats"] == engine.stats()
        for path in ("/", "/api/live"):
            rebound = httpx.get(f"{url}{path}", headers={"Host": "evil.example", "Authorization": "Bearer sesame"})
            assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"


def test_a_preemption_is_an_event_and_the_rows_add_up():
    """The engine thread's view of a pool too small for two requests: the newest is preempted."""
    import minillm
    from minillm.engine.engine import Engine
    from minillm.llm import LLM
    from minillm.serve.live import LiveView
    from minillm.tools.bench import random_model

    config = minillm.ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                 max_seq_len=64)
    engine = Engine(LLM(config, random_model(config)), num_blocks=8, block_size=4)   # 32 positions in all
    view = LiveView(engine, interval=float("inf"))     # no push of its own: the test takes every snapshot
    view.active = True                                  # a listener, without an event loop to deliver to
    ids = [engine.add_request(list(range(1, 14)), max_tokens=12, ignore_eos=True),
           engine.add_request(list(range(30, 43)), max_tokens=12, ignore_eos=True)]
    updates = []
    while engine.has_unfinished():
        view.before_step()
        events = engine.step()
        view.after_step(events)
        updates.append(view.snapshot())
    preempted = [e for u in updates for e in u["events"]]
    assert preempted and {e["kind"] for e in preempted} == {"preempt"} and preempted[0]["id"] == ids[1]
    assert engine.stats()["preemptions"] == len(preempted)
    finished = [f for u in updates for f in u["finished"]]
    assert sorted(f["id"] for f in finished) == ids and all(f["output_tokens"] == 12 for f in finished)
    assert all(len(u["requests"]) <= 2 and sum(len(r["blocks"]) for r in u["requests"]) <= 8 for u in updates)
    rows = [r for u in updates for step in u["steps"] for r in step["rows"]]
    assert sum(r["tokens"] for r in rows) == engine.stats()["tokens_computed"]     # recomputation included
