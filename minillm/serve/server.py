"""`minillm serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

Two threads of control, and the line between them is the point of this file:

* ONE engine thread owns the engine. It takes the requests handlers submit, calls `engine.step()`
  while there is work, and hands every step's events to the waiting requests (`EngineLoop`).
* The asyncio event loop (uvicorn) runs the HTTP handlers. They parse, tokenize, submit and await
  their events; they never run the model. So every connected client shares one running batch, and
  a slow model step never stops the server from accepting the next request.

Only the engine thread calls the engine, so a handler never waits for a step to finish. Handlers talk
to it through a command queue (add, abort); results come back through one asyncio queue per request,
fed with `loop.call_soon_threadsafe` (an asyncio queue may only be touched from its loop's thread).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import AsyncIterator, Iterator

from minillm.errors import MiniLLMError
from minillm.serve.metrics import Metrics

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from minillm.serve.protocol import (SSE_DONE, ApiError, ChatCompletionRequest, CompletionRequest, chat_chunk,
                                  chat_completion, completion, model_list, new_id, parse, sse, usage,
                                  usage_chunk)
except ImportError:
    raise MiniLLMError('minillm serve needs FastAPI and uvicorn: pip install "minillm[serve]"') from None

log = logging.getLogger("minillm.serve.server")

# Besides the engine's StepEvents and ApiErrors, a request's queue receives these two: the first item
# of every accepted request, and the last item of an aborted one (whose engine events are dropped).
_ACCEPTED = object()
_ABORTED = SimpleNamespace(token_ids=[], text="", finished=True, finish_reason="abort")


# ---- the engine thread ----------------------------------------------------------------------------

@dataclass(eq=False)
class Submission:
    """One HTTP request's handle on its engine request; its events arrive on `events`."""
    prompt_ids: list[int]
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float                     # perf_counter() when the handler submitted it
    rid: int | None = None             # the engine's id, set by the engine thread
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False                 # the handler has seen the last event

    async def accepted(self) -> None:
        """Wait until the engine has taken the request; raise its ApiError if it refused."""
        item = await self.events.get()
        if isinstance(item, ApiError):
            self.done = True
            raise item

    async def stream(self) -> AsyncIterator:
        """The request's step events, up to and including the finished one."""
        while not self.done:
            item = await self.events.get()
            if isinstance(item, ApiError):
                self.done = True
                raise item
            self.done = item.finished
            yield item


class EngineLoop:
    """The one thread that runs the engine: apply commands, step, hand out events, repeat."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Submission] = {}       # engine request id -> its submission
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
        self._snapshot_stats()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- called from the event loop's thread --
    def submit(self, prompt_ids: list[int], **params) -> Submission:
        sub = Submission(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        self._send("add", sub)
        return sub

    def abort(self, sub: Submission) -> None:
        self._send("abort", sub)

    def _send(self, command: str, sub: Submission) -> None:
        self._commands.put((command, sub))
        self._wake.set()

    # -- the engine thread --
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._apply_commands()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._wake.wait()
                    self._wake.clear()   # commands sent before this line are applied next iteration
            except Exception as e:       # a bug in the engine must not take the server down: fail who was in it
                log.exception("engine step failed")
                self._fail_all(ApiError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command, sub = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                self._add(sub)
            elif sub.rid in self._live:
                self.engine.abort(sub.rid)           # frees its KV blocks now
                self._end(sub, "abort")
                self._post(sub, _ABORTED)
        self._snapshot_stats()

    def _add(self, sub: Submission) -> None:
        try:
            sub.rid = self.engine.add_request(sub.prompt_ids, **sub.params)
        except (MiniLLMError, ValueError) as e:      # the engine's own checks: the request's fault
            self._post(sub, ApiError(400, str(e)))
            return
        except Exception as e:
            log.exception("add_request failed")
            self._post(sub, ApiError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error"))
            return
        self._live[sub.rid] = sub
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(sub.prompt_ids)
        self._post(sub, _ACCEPTED)

    def _step(self) -> None:
        events = self.engine.step()
        now = time.perf_counter()
        for event in events:
            sub = self._live.get(event.request_id)
            if sub is None:                          # aborted between its last step and this one
                continue
            self._record_latency(sub, len(event.token_ids), now)
            if event.finished:
                self._end(sub, event.finish_reason)
            self._post(sub, event)
        self._snapshot_stats()

    def _record_latency(self, sub: Submission, n_new: int, now: float) -> None:
        if n_new == 0:
            return
        with self.metrics.lock:
            m = self.metrics
            m.generation_tokens += n_new
            if sub.first_token_at is None:           # the first token's wait is TTFT, not ITL
                sub.first_token_at = now
                m.ttft.observe(now - sub.arrived)
            else:
                gap = (now - sub.last_token_at) / n_new   # tokens that arrive together split the gap
                for _ in range(n_new):
                    m.itl.observe(gap)
        sub.last_token_at = now

    def _end(self, sub: Submission, reason: str | None) -> None:
        self._live.pop(sub.rid, None)
        with self.metrics.lock:
            self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1

    def _fail_all(self, error: ApiError) -> None:
        for rid, sub in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort after a failed step failed too")
            self._end(sub, "error")
            self._post(sub, error)

    def _snapshot_stats(self) -> None:
        stats = dict(self.engine.stats())
        with self.metrics.lock:
            self.metrics.engine = stats
            self.metrics.max_batch = max(self.metrics.max_batch, stats.get("batch_size", 0))

    @staticmethod
    def _post(sub: Submission, item) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.events.put_nowait, item)
        except RuntimeError:             # its event loop has closed (server shutdown): nobody to tell
            pass


# ---- the HTTP side ---------------------------------------------------------------------------------

class OpenAIServer:
    """The route handlers: validate, turn the request into prompt ids, submit, answer or stream."""

    def __init__(self, llm, engine, model_name: str):
        self.llm, self.model_name = llm, model_name
        # The most positions one request can ever hold: the context, or the whole KV pool if smaller.
        self.max_positions = min(llm.config.max_seq_len, engine.pool.num_blocks * engine.pool.block_size)
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.created = int(time.time())

    async def models(self) -> dict:
        return model_list(self.model_name, self.created, self.llm.config.max_seq_len, self.llm.config.vocab_size)

    async def metrics_text(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request):
        body = parse(CompletionRequest, await request.body())
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            try:
                ids = self.llm.prompt_ids(body.prompt, chat=False)
            except MiniLLMError as e:                         # e.g. a model without a tokenizer
                raise ApiError(400, str(e), param="prompt") from None
        else:
            ids = body.prompt
            bad = [i for i in ids if not 0 <= i < self.llm.config.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.llm.config.vocab_size - 1})",
                               param="prompt")
        return await self._answer(request, body, ids, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request):
        body = parse(ChatCompletionRequest, await request.body())
        self._check_model(body.model)
        try:
            ids = self.llm.prompt_ids(body.plain_messages())     # the model's own chat template
        except MiniLLMError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await self._answer(request, body, ids, body.token_limit(), chat=True)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _token_budget(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        """max_tokens, checked against the context (like OpenAI: an error, not a silent cut)."""
        context = self.llm.config.max_seq_len
        if n_prompt >= context:
            raise ApiError(400, f"the prompt is {n_prompt} tokens; this model's context is {context}",
                           param=param, code="context_length_exceeded")
        if max_tokens is None:                   # "as long as it takes": up to what memory holds
            return max(1, self.max_positions - n_prompt)
        if n_prompt + max_tokens > context:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) exceed this "
                           f"model's context of {context}", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def _answer(self, request: Request, body, ids: list[int], max_tokens: int | None, chat: bool):
        budget = self._token_budget(len(ids), max_tokens, "messages" if chat else "prompt")
        sub = self.loop.submit(ids, max_tokens=budget, temperature=body.temperature, top_p=body.top_p,
                               top_k=body.top_k, stop=tuple(body.stop), seed=body.seed, ignore_eos=body.ignore_eos)
        watcher = asyncio.create_task(self._abort_on_disconnect(request, sub))
        try:
            await sub.accepted()
        except BaseException:
            watcher.cancel()
            raise
        if body.stream:
            return StreamingResponse(self._sse(sub, body, chat, watcher), media_type="text/event-stream")
        try:
            pieces, n_tokens, finish = [], 0, None
            async for event in sub.stream():
                pieces.append(event.text)
                n_tokens += len(event.token_ids)
                finish = event.finish_reason
        finally:
            watcher.cancel()
        counts = usage(len(ids), n_tokens)
        if chat:
            return chat_completion(new_id("chatcmpl"), self.model_name, "".join(pieces), finish, counts)
        return completion(new_id("cmpl"), self.model_name, "".join(pieces), finish, counts)

    async def _sse(self, sub: Submission, body, chat: bool, watcher: asyncio.Task) -> AsyncIterator[str]:
        """The streamed answer: one chunk per step that produced text, a last chunk with the finish
        reason, optionally one with the usage, then [DONE]."""
        id, model = new_id("chatcmpl" if chat else "cmpl"), self.model_name

        def chunk(text: str | None, finish: str | None) -> dict:
            if chat:
                return chat_chunk(id, model, {} if text is None else {"content": text}, finish)
            return completion(id, model, text or "", finish, None)
        try:
            if chat:
                yield sse(chat_chunk(id, model, {"role": "assistant", "content": ""}, None))
            n_tokens = 0
            async for event in sub.stream():
                n_tokens += len(event.token_ids)
                if event.text:
                    yield sse(chunk(event.text, None))
                if event.finished:
                    yield sse(chunk(None, event.finish_reason))
            if body.include_usage():
                yield sse(usage_chunk(id, model, "chat.completion.chunk" if chat else "text_completion",
                                      usage(len(sub.prompt_ids), n_tokens)))
            yield SSE_DONE
        except ApiError as e:            # the engine failed mid-stream: the status line is long gone
            yield sse(e.body())
        finally:                         # also when the client went away and the stream was cancelled
            watcher.cancel()
            if not sub.done:
                self.loop.abort(sub)

    async def _abort_on_disconnect(self, request: Request, sub: Submission) -> None:
        """Abort the engine request as soon as its client hangs up, streaming or not (frees its blocks)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not sub.done:
            self.loop.abort(sub)


def create_app(llm, engine, model_name: str) -> FastAPI:
    """The ASGI app: OpenAI's routes plus /metrics and /health, one engine thread for its lifetime."""
    server = OpenAIServer(llm, engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server
    app.get("/v1/models")(server.models)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/metrics")(server.metrics_text)
    app.get("/health")(lambda: {"status": "ok"})

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)            # unknown routes, wrong methods: OpenAI's shape too
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)                # a bug: still JSON (uvicorn logs the traceback)
    async def server_error(request: Request, e: Exception):
        error = ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    return app


# ---- `minillm serve` ----------------------------------------------------------------------------------

def check_address(host: str, port: int) -> None:
    """Fail in one line before the model loads if the address cannot be listened on."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise MiniLLMError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread (port 0: any free port) and yield its URL; for tests and
    lessons, which need the server and its client in one process."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="minillm-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise MiniLLMError(f"the server could not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000, **engine_options) -> None:
    """Run the server until Ctrl-C. engine_options go to `Engine` (max_batch, kv_cache, ...)."""
    import uvicorn

    from minillm.engine.engine import Engine
    engine = Engine(llm, **engine_options)
    uvicorn.run(create_app(llm, engine, model_name), host=host, port=port, log_level="info")
