"""The page of `minillm serve` in a real browser: Debian's Chromium driven by Playwright (issue 21).

`minillm serve` runs SmolLM2-135M (the default model) as a subprocess on a free loopback port; the tests
chat with it, watch the engine view batch two chats and take an aborted one's blocks back, and move a
planner slider. Screenshots go to the test's temporary folder. To regenerate the README's picture:

    MINILLM_README_SCREENSHOT=1 python3 -m pytest -q tests/test_web_browser.py

Needs `apt-get install chromium` and `pip install playwright` (no browser download: Playwright drives
/usr/bin/chromium); without Chromium the tests skip and say so.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
httpx = pytest.importorskip("httpx")

README_PNG = Path(__file__).resolve().parents[1] / "docs" / "serve_page.png"
# As /work/.library's notes on this machine say: a closed network, no first-run work, no sandbox as root.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    """`minillm serve` on SmolLM2, as a user starts it; its URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", "-m", str(smollm2_dir),
                                    "--port", str(port), "--served-model-name", "smollm2"], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, f"minillm serve exited: {log.read_text()[-2000:]}"
            assert time.time() < deadline, "minillm serve did not start in 120 s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium (a fresh profile) for the module."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1000})
        context.set_default_timeout(60_000)
        yield context
        context.close()


def _open(browser, url: str):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("#live-status:text('live')")
    page.errors = errors
    return page


def _chat(page, text: str, max_tokens: int, temperature: str = "0") -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", temperature)
    page.fill("#prompt", text)
    page.click("#send")


def _request_id(page) -> int:
    page.wait_for_selector(".message.assistant[data-request-id]")
    return int(page.locator(".message.assistant[data-request-id]").last.get_attribute("data-request-id"))


def test_chat_streams_two_chats_share_a_batch_and_stop_frees_the_blocks(server, browser, tmp_path):
    a = _open(browser, server)
    _chat(a, "Say hello in five words.", 12)
    a.wait_for_selector(".message.assistant .text:not(:empty)")          # streamed text arrives
    a.wait_for_selector("#chat-status:has-text('finished')")
    assert a.locator(".message.assistant .text").last.inner_text().strip()
    a.screenshot(path=tmp_path / "chat.png", full_page=True)

    b = _open(browser, server)
    a.click("#clear")                                                    # a new chat: no history
    # Greedy SmolLM2 answers both at length (checked: 100 tokens and more); both are stopped below.
    _chat(a, "Write a long story about a dragon who learns to bake bread.", 400)
    _chat(b, "Explain in detail how a steam engine works, step by step.", 400)
    id_a, id_b = _request_id(a), _request_id(b)
    b.wait_for_selector("#batch[data-rows='2']")                         # one step ran both chats
    b.wait_for_selector(f"#requests tr[data-request-id='{id_a}'][data-state='running']")
    b.wait_for_selector(f"#pool-legend li[data-id='{id_a}']")
    b.screenshot(path=tmp_path / "two_chats.png", full_page=True)
    if os.environ.get("MINILLM_README_SCREENSHOT"):
        b.wait_for_timeout(5000)                                         # a few seconds of batches on the charts
        README_PNG.parent.mkdir(exist_ok=True)
        b.screenshot(path=README_PNG)

    a.click("#stop")
    a.wait_for_selector("#chat-status:has-text('stopped')")
    # In b's engine view: a's request and its blocks are gone; every block in use is b's.
    b.wait_for_function("""([a, b]) => {
        const used = Number(document.querySelector('#pool-summary').dataset.used);
        const mine = document.querySelector(`#pool-legend li[data-id='${b}']`);
        return !document.querySelector(`#pool-legend li[data-id='${a}']`) &&
               !document.querySelector(`#requests tr[data-request-id='${a}']`) &&
               mine !== null && used === Number(mine.dataset.blocks);
    }""", arg=[id_a, id_b])
    b.click("#stop")
    b.wait_for_function("() => document.querySelector('#pool-summary').dataset.used === '0'")
    b.screenshot(path=tmp_path / "after_stop.png", full_page=True)
    metrics = httpx.get(f"{server}/metrics").text
    assert "minillm_kv_blocks_used 0" in metrics and 'finished_total{finish_reason="abort"} 2' in metrics
    assert a.errors == [] and b.errors == []


def test_a_planner_slider_shows_the_planners_own_numbers(server, browser, tmp_path):
    from minillm.tools.planner import PlannerAPI
    page = browser.new_page()
    page.goto(f"{server}/plan")
    page.wait_for_selector("#numbers dd[data-name='tok/s total']")
    before = page.get_attribute("#numbers dd[data-name='tok/s total']", "data-value")
    page.fill("#context", "14")                                           # 2^14 = 16,384 tokens a user
    page.wait_for_function("() => JSON.parse(document.body.dataset.planned || '{}').context === '16384'")
    query = json.loads(page.evaluate("() => document.body.dataset.planned"))
    want = PlannerAPI().plan(query)
    shown = lambda name: float(page.get_attribute(f"#numbers dd[data-name='{name}']", "data-value"))
    assert shown("tok/s total") == want["decode"]["tok_s_total"] != float(before)
    assert shown("decode step") == want["decode"]["step_ms"] and shown("KV cache") == want["memory_gb"]["kv"]
    assert page.locator("#ranking tbody tr").count() == len(want["ranking"])
    page.screenshot(path=tmp_path / "plan.png", full_page=True)


def test_with_an_api_key_the_page_asks_for_it_once(browser):
    import minillm
    from minillm.engine.engine import Engine
    from minillm.llm import LLM
    from minillm.serve.server import ServeOptions, create_app, serve_in_thread
    from minillm.tools.bench import random_model

    config = minillm.ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    llm = LLM(config, random_model(config))
    app = create_app(llm, Engine(llm, num_blocks=16), "tiny", ServeOptions(api_key="sesame"))
    with serve_in_thread(app) as url:
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("#key-form:not([hidden])")                 # the event stream said 401
        assert "API key" in page.inner_text("#key-message")
        page.fill("#key-input", "sesame")
        page.click("#key-form button")
        page.wait_for_selector("#live-status:text('live')")
        page.wait_for_selector("#pool-summary[data-used='0']")
        again = browser.new_page()                                         # kept in this browser: not asked again
        again.goto(url)
        again.wait_for_selector("#live-status:text('live')")
        assert again.locator("#key-form").is_hidden()
        page.close()
        again.close()
