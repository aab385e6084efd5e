"""`minillm bench serve --url URL`: the serving benchmark's workload, sent over HTTP to a running server.

The same closed loop as serve_bench.py (`concurrency` clients, each sending its next request when its
last one has finished), the same random-token workloads, the same table; only the engine is behind
an API now: `minillm serve`, or any OpenAI-compatible server. Every request is a streamed
/v1/completions call with a token-id prompt and `ignore_eos`, so the server does exactly the work the
in-process run does, and the difference between the two tables is the price of the API.

Times are the client's: TTFT runs from sending the request to the first streamed text (HTTP, JSON
and both event loops included), ITL is a request's (last text - first text) / (tokens - 1), and the
token count is the server's own (`usage`, asked for with stream_options.include_usage).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from minillm.errors import MiniLLMError
from minillm.tools.serve_bench import Result, Workload, agentic_workload, format_table, random_workload, write_csv

DONE = "[DONE]"
FALLBACK_VOCAB = 32000     # a server that does not say its vocabulary: ids below Llama-2's 32k are safe


# ---- reading a server-sent event stream -----------------------------------------------------------

def sse_data(line: str) -> dict | str | None:
    """One line of an SSE stream: its JSON payload (a dict), DONE for `data: [DONE]`, None for
    anything else (blank separators, `: keep-alive` comments, other fields)."""
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    return DONE if payload == DONE else json.loads(payload)


def chunk_text(data: dict) -> str:
    """The new text in one streamed chunk: `text` for completions, `delta.content` for chat."""
    choices = data.get("choices") or []         # the usage chunk has none
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def stream_text(body: str) -> tuple[str, str | None]:
    """The whole answer in a streamed response body: (text, finish_reason)."""
    pieces, finish = [], None
    for line in body.splitlines():
        data = sse_data(line)
        if data == DONE:
            break
        if data is None:
            continue
        pieces.append(chunk_text(data))
        for choice in data.get("choices") or []:
            finish = choice.get("finish_reason") or finish
    return "".join(pieces), finish


# ---- one request, timed -----------------------------------------------------------------------------

@dataclass
class Timing:
    sent: float                      # seconds since the run started
    first: float | None = None       # first streamed text
    last: float | None = None        # last streamed text
    tokens: int = 0                  # the server's usage.completion_tokens


async def _timed_request(client, model: str, prompt: list[int], max_tokens: int, t0: float) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    timing = Timing(time.perf_counter() - t0)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise MiniLLMError(f"the server answered {response.status_code}: {_error_message(response)}")
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data is None or data == DONE:
                continue
            if "error" in data:
                raise MiniLLMError(f"the server failed mid-stream: {data['error'].get('message')}")
            if chunk_text(data):
                timing.last = time.perf_counter() - t0
                timing.first = timing.first if timing.first is not None else timing.last
            if data.get("usage"):
                timing.tokens = data["usage"]["completion_tokens"]
    return timing


def _error_message(response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


# ---- the closed loop --------------------------------------------------------------------------------

def _headers(api_key: str | None) -> dict[str, str]:
    """What a server started with --api-key wants on every /v1 request."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _closed_loop(url: str, model: str, w: Workload, concurrency: int,
                       api_key: str | None = None) -> tuple[float, list[Timing]]:
    import httpx
    timings: list[Timing | None] = [None] * len(w.prompts)
    todo = iter(range(len(w.prompts)))          # shared by the clients: each takes the next request

    async def client_loop(client):
        for i in todo:
            timings[i] = await _timed_request(client, model, w.prompts[i], w.output_lens[i], t0)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=_headers(api_key)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return time.perf_counter() - t0, timings


def run_http(url: str, model: str, w: Workload, concurrency: int, mode: str = "HTTP server",
             api_key: str | None = None) -> Result:
    """The workload through the server at `url`, as one row of serve_bench's table."""
    before = server_metrics(url, api_key)
    wall, timings = asyncio.run(_closed_loop(url, model, w, concurrency, api_key))
    after = server_metrics(url, api_key)
    ttft = [(t.first if t.first is not None else wall) - t.sent for t in timings]
    itl = [(t.last - t.first) / (t.tokens - 1) if t.tokens > 1 and t.first is not None else 0.0 for t in timings]
    hits = after.get("minillm_prefix_cache_hit_tokens_total", 0) - before.get("minillm_prefix_cache_hit_tokens_total", 0)
    # The server's peak since it started (a gauge cannot be reset from here): an upper bound for this run.
    peak = after.get("minillm_kv_peak_bytes", 0)
    return Result(w.name, mode, wall, sum(t.tokens for t in timings), ttft, itl, int(peak), int(hits))


def server_metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics as name -> value ({} if it has none)."""
    import httpx
    try:
        response = httpx.get(f"{url}/metrics", timeout=10, headers=_headers(api_key))
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    out = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def served_model(url: str, api_key: str | None = None) -> dict:
    """The first model card of GET /v1/models, or a one-line error if nothing answers there."""
    import httpx
    try:
        response = httpx.get(f"{url}/v1/models", timeout=30, headers=_headers(api_key))
        if response.status_code == 401:
            raise MiniLLMError(f"the server at {url} refused the API key (401): give its key with --api-key KEY "
                               f"or MINILLM_API_KEY" if api_key else
                               f"the server at {url} wants an API key (401): --api-key KEY or MINILLM_API_KEY")
        response.raise_for_status()
        return response.json()["data"][0]
    except httpx.HTTPError as e:
        raise MiniLLMError(f"no OpenAI-compatible server answers at {url} ({type(e).__name__}); "
                           f"start one with: minillm serve --port PORT") from None
    except (ValueError, KeyError, IndexError):
        raise MiniLLMError(f"{url}/v1/models did not list a model") from None


def run_cli(url: str, n_requests: int = 16, concurrency: int = 8, prefix_share: float = 0.75,
            workload: str = "both", prompt_len: int = 128, output_len: int = 32, csv_path=None, seed: int = 0,
            api_key: str | None = None, echo=print) -> list[Result]:
    """What `minillm bench serve --url URL` does: serve_bench's workloads, sent to a running server."""
    url = url.rstrip("/")
    card = served_model(url, api_key)
    vocab = card.get("vocab_size") or FALLBACK_VOCAB
    context = card.get("max_model_len")
    longest = prompt_len * 3 // 2 + output_len * 3 // 2
    if context and longest >= context:
        raise MiniLLMError(f"prompts and outputs of up to {longest} tokens do not fit the served model's context "
                           f"of {context}: lower --prompt-len or --output-len")
    workloads = []
    if workload in ("random", "both"):
        workloads.append(random_workload(n_requests, vocab, prompt_len, output_len, seed))
    if workload in ("agentic", "both"):
        workloads.append(agentic_workload(n_requests, vocab, prompt_len, output_len, prefix_share, seed))
    warm = Workload("warm-up", [workloads[0].prompts[0][:8]], [2])     # first calls are slow everywhere
    run_http(url, card["id"], warm, 1, api_key=api_key)
    results = []
    for w in workloads:
        echo(f"\n{w.name}: {len(w.prompts)} requests, {concurrency} concurrent, through {url} ({card['id']})")
        result = run_http(url, card["id"], w, concurrency, api_key=api_key)
        echo(format_table([result]))
        results.append(result)
    echo("(peak KV: the server's peak since it started; TTFT and ITL: as the client saw them)")
    if csv_path:
        echo(f"csv: {write_csv(results, csv_path)}")
    return results
