"""`minillm serve`: an OpenAI-compatible HTTP server on the continuous-batching engine.

Two threads of control, and the line between them is the point of this file:

* ONE engine thread owns the engine. It takes the requests handlers submit, calls `engine.step()`
  while there is work, and hands every step's events to the waiting requests (`EngineLoop`).
* The asyncio event loop (uvicorn) runs the HTTP handlers. They submit and await their events; they
  never run the model, and never parse, render a chat template or tokenize either: that work runs on
  worker threads, so one huge prompt costs its own latency only. So every connected client shares one
  running batch, and neither a slow model step nor a heavy request stops the server from answering.

Before any of it, `connections` bounds what one client may hold (time for a request's headers and body,
the number of open connections), `guard` checks what costs no model time (Host, body size, API key,
Content-Type), and `ServeOptions` bounds each request (body bytes, prompt characters and tokens; stop
strings and the chat template are bounded where they run).

The same app serves a page (web.py: a chat, and the engine live from live.py's hooks in EngineLoop,
which do nothing while no page listens) and the capacity planner at /plan.

Only the engine thread calls the engine, so a handler never waits for a step to finish. Handlers talk
to it through a command queue (add, abort); results come back through one asyncio queue per request,
fed with `loop.call_soon_threadsafe` (an asyncio queue may only be touched from its loop's thread).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import AsyncIterator, Iterator

from minillm.checkpoints.chat_template import template_roles
from minillm.engine.choices import max_tokens_for_choices
from minillm.engine.reasoning import split_answer, splitter_for
from minillm.engine.structured import Grammar, GrammarError, compile_grammar
from minillm.engine.tool_calls import (ToolCallStream, ToolSyntax, check_tools, messages_with_tools,
                                       parse_tool_calls, tool_grammar, tool_syntax)
from minillm.errors import MiniLLMError
from minillm.serve.live import LiveView
from minillm.serve.logprobs import ChoiceLogprobs
from minillm.serve.metrics import Metrics
from minillm.resources import install_hint

try:
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    from minillm.serve.guard import Guard, exposure_warning, host_names, require_api_key, require_json
    from minillm.serve.web import add_web
    from minillm.serve.protocol import (SSE_DONE, ApiError, ChatCompletionRequest, CompletionRequest, chat_chunk,
                                        chat_completion, completion, error_responses, json_schema, model_list,
                                        new_id, parse, plain, sse, usage, usage_chunk, with_choices)
    from minillm.serve.protocol import DetokenizeRequest, TokenizeRequest, tokenized
except ImportError:
    raise MiniLLMError(f"minillm serve needs FastAPI and uvicorn: {install_hint('serve')}") from None

log = logging.getLogger("minillm.serve.server")

# Besides the engine's StepEvents and ApiErrors, a request's queue receives these two: the first item
# of every accepted request, and the last item of an aborted one (whose engine events are dropped).
_ACCEPTED = object()
_ABORTED = SimpleNamespace(request_id=None, token_ids=[], text="", finished=True, finish_reason="abort")


# ---- the engine thread ----------------------------------------------------------------------------

@dataclass(eq=False)
class Submission:
    """One HTTP request's handle on its engine request (n of them for n choices); its events arrive on `events`."""
    prompt_ids: list[int]
    params: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float                     # perf_counter() when the handler submitted it
    n: int = 1                         # choices of the prompt (engine.add_choices)
    rid: int | None = None             # the engine's id (of choice 0), set by the engine thread
    rids: list[int] = field(default_factory=list)     # every choice's engine id, choice i at index i
    unfinished: int = 1                # choices whose last event the handler has not seen
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
            if item.finished:              # an abort ends every choice at once
                self.unfinished = 0 if item is _ABORTED else self.unfinished - 1
            self.done = self.unfinished == 0
            yield item

    def index(self, event) -> int:
        """Which choice an event is for (0 for the abort that ends them all)."""
        return self.rids.index(event.request_id) if event.request_id in self.rids else 0


class EngineLoop:
    """The one thread that runs the engine: apply commands, step, hand out events, repeat."""

    def __init__(self, engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Submission] = {}       # engine request id -> its submission
        self.live = LiveView(engine)                 # the page's engine view: idle while nobody watches
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
    def submit(self, prompt_ids: list[int], n: int = 1, **params) -> Submission:
        sub = Submission(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter(), n,
                         unfinished=n)
        self._send("add", sub)
        return sub

    def abort(self, sub: Submission) -> None:
        self._send("abort", sub)

    def watch(self) -> asyncio.Queue:
        """A queue of live-view updates (JSON text); the engine thread wakes to send the first one."""
        queue = self.live.subscribe()
        self._send("watch", None)
        return queue

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
                    self.live.idle()             # the last picture: finished requests' blocks back in the pool
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
            elif command == "watch":
                pass                                 # only woke the thread: live.idle() sends the picture
            elif any(rid in self._live for rid in sub.rids):
                for rid in reversed(sub.rids):       # the last choices first: none becomes the one to prefill
                    if rid in self._live:
                        self.engine.abort(rid)       # frees its KV blocks now
                        self._end(rid, "abort")
                self._post(sub, _ABORTED)
        self._snapshot_stats()

    def _add(self, sub: Submission) -> None:
        try:
            if sub.n == 1:
                sub.rids = [self.engine.add_request(sub.prompt_ids, **sub.params)]
            else:                                    # the prompt prefilled once, its blocks shared
                sub.rids = self.engine.add_choices(sub.prompt_ids, sub.n, **sub.params)
        except (MiniLLMError, ValueError) as e:      # the engine's own checks: the request's fault
            self._post(sub, ApiError(400, str(e), param=getattr(e, "param", None)))
            return
        except Exception as e:
            log.exception("add_request failed")
            self._post(sub, ApiError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error"))
            return
        sub.rid = sub.rids[0]
        self._live.update(dict.fromkeys(sub.rids, sub))
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(sub.prompt_ids)
        self._post(sub, _ACCEPTED)

    def _step(self) -> None:
        self.live.before_step()
        events = self.engine.step()
        self.live.after_step(events)
        now = time.perf_counter()
        for event in events:
            sub = self._live.get(event.request_id)
            if sub is None:                          # aborted between its last step and this one
                continue
            self._record_latency(sub, event, now)
            if event.finished:
                self._end(event.request_id, event.finish_reason)
            self._post(sub, event)
        self._snapshot_stats()

    def _record_latency(self, sub: Submission, event, now: float) -> None:
        n_new = len(event.token_ids)
        if n_new == 0:
            return
        with self.metrics.lock:
            m = self.metrics
            m.generation_tokens += n_new
            if event.request_id != sub.rid:          # the latencies are choice 0's (n > 1: all come together)
                return
            if sub.first_token_at is None:           # the first token's wait is TTFT, not ITL
                sub.first_token_at = now
                m.ttft.observe(now - sub.arrived)
            else:
                gap = (now - sub.last_token_at) / n_new   # tokens that arrive together split the gap
                for _ in range(n_new):
                    m.itl.observe(gap)
        sub.last_token_at = now

    def _end(self, rid: int, reason: str | None) -> None:
        self._live.pop(rid, None)
        with self.metrics.lock:
            self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1

    def _fail_all(self, error: ApiError) -> None:
        for rid, sub in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort after a failed step failed too")
            self._end(rid, "error")
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

@dataclass(frozen=True)
class ServeOptions:
    """How the server guards itself and bounds each request; each is a flag of `minillm serve`."""
    api_key: str | None = None                 # required as `Authorization: Bearer` on /v1, /api, /metrics when set
    public_metrics: bool = False               # /metrics without the key (a Prometheus that cannot send one)
    allowed_hosts: tuple[str, ...] = ()        # Host names to answer besides loopback and the bound one; "*": any
    cors_origin: str | None = None             # the one browser origin allowed to read replies; None: CORS off
    max_body_bytes: int = 8 * 2 ** 20          # a 5 MB prompt gets through (then is too long); 20 MB is not read
    max_prompt_chars: int = 8_000_000          # the prompt's text (all messages together), before tokenizing
    max_prompt_tokens: int | None = None       # None: the model's context minus one position to answer in
    header_timeout_s: float = 10.0             # a request's headers, from its first byte (connections.py)
    body_timeout_s: float = 60.0               # its body, from its headers: 8 MiB at 140 kB/s
    max_connections: int = 512                 # open at once; past it a new one is answered 503


# Requests with bodies over this many bytes parse and tokenize on the one "heavy" worker thread: a few
# such requests take turns there, and ordinary ones keep the other workers to themselves.
HEAVY_BODY_BYTES = 64 * 1024


class OpenAIServer:
    """The route handlers: validate, turn the request into prompt ids, submit, answer or stream.

    Parsing, chat-template rendering and tokenizing run on worker threads, never on the event loop:
    a 5 MB prompt costs its own request seconds, while every other stream and /health go on."""

    def __init__(self, llm, engine, model_name: str, options: ServeOptions | None = None):
        self.llm, self.model_name = llm, model_name
        self.options = options or ServeOptions()
        # The most positions one request can ever hold: the context, or the whole KV pool if smaller.
        self.max_positions = min(llm.config.max_seq_len, engine.pool.num_blocks * engine.pool.block_size)
        context = llm.config.max_seq_len
        self.max_prompt_tokens = min(self.options.max_prompt_tokens or context - 1, context - 1)
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics)
        self.created = int(time.time())
        self._light = ThreadPoolExecutor(4, thread_name_prefix="minillm-prompt")
        self._heavy = ThreadPoolExecutor(1, thread_name_prefix="minillm-prompt-heavy")

    def close(self) -> None:
        self._light.shutdown(wait=False, cancel_futures=True)
        self._heavy.shutdown(wait=False, cancel_futures=True)

    def served_facts(self) -> dict:
        """What the request schemas cannot know and the OpenAPI document says (protocol.served): this
        model's name, the roles its chat template renders, the ids its vocabulary has."""
        try:
            template = self.llm.tokenizer.chat_template
        except MiniLLMError:                         # no tokenizer: token-id prompts only
            template = None
        # A template that renders no tool turn still takes tool results: as user turns (engine/tool_calls.py).
        roles = list(dict.fromkeys([*template_roles(template), "tool"])) if template else list(template_roles(template))
        return {"model": {"enum": [self.model_name]}, "role": {"enum": roles},
                "token_id": {"maximum": self.llm.config.vocab_size - 1}}

    async def models(self) -> dict:
        return model_list(self.model_name, self.created, self.llm.config.max_seq_len, self.llm.config.vocab_size)

    async def metrics_text(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self) -> dict:
        return {"status": "ok"}

    async def completions(self, request: Request):
        raw = await self._body(request)
        body, ids = await self._off_loop(len(raw), self._completion_ids, raw)
        return await self._answer(request, body, ids, body.max_tokens, chat=False)

    async def chat_completions(self, request: Request):
        raw = await self._body(request)
        body, ids = await self._off_loop(len(raw), self._chat_ids, raw)
        return await self._answer(request, body, ids, body.token_limit(), chat=True)

    async def tokenize(self, request: Request) -> dict:
        raw = await self._body(request)
        return await self._off_loop(len(raw), self._tokenize, raw)

    async def detokenize(self, request: Request) -> dict:
        raw = await self._body(request)
        return await self._off_loop(len(raw), self._detokenize, raw)

    async def _body(self, request: Request) -> bytes:
        require_json(request)
        return await request.body()         # bounded by the Guard: past max_body_bytes it raises the 413

    async def _off_loop(self, size: int, work, *args):
        """Run `work` on a worker thread (the heavy one for big bodies) and wait without blocking the loop."""
        pool = self._heavy if size > HEAVY_BODY_BYTES else self._light
        return await asyncio.get_running_loop().run_in_executor(pool, work, *args)

    # -- on a worker thread --
    def _completion_ids(self, raw: bytes) -> tuple[CompletionRequest, list[int]]:
        body = parse(CompletionRequest, raw)
        self._check_model(body.model)
        if not isinstance(body.prompt, str):
            ids = body.prompt
            bad = [i for i in ids if not 0 <= i < self.llm.config.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.llm.config.vocab_size - 1})",
                               param="prompt")
            self._check_prompt_tokens(len(ids), "prompt")
            return body, ids
        self._check_prompt_chars(len(body.prompt), "prompt")
        return body, self._encode(lambda: body.prompt, lambda: self.llm.prompt_ids(body.prompt, chat=False), "prompt")

    def _tokenize(self, raw: bytes) -> dict:
        """/tokenize: a text's ids (its BOS as a completion would get it, unless add_special_tokens is false),
        or messages' through the chat template."""
        body = parse(TokenizeRequest, raw)
        self._check_model(body.model)
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
            self._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
            # as a chat request renders them: the tools in the prompt, tool results as text turns where the
            # template has no tool role
            try:
                tools, _ = check_tools([plain(t) for t in body.tools or []])
            except GrammarError as e:
                raise ApiError(400, str(e), param=e.field, code="invalid_grammar") from None
            messages, extra = messages_with_tools(self.llm.tokenizer.chat_template, messages, tools)
            encode, param = lambda: self.llm.tokenizer.encode_chat(messages, body.add_generation_prompt, **extra), \
                "messages"
        else:
            self._check_prompt_chars(len(body.prompt), "prompt")
            no_bos = body.add_special_tokens is False
            encode = (lambda: self.llm.tokenizer.encode(body.prompt)) if no_bos else \
                (lambda: self.llm.prompt_ids(body.prompt, chat=False))
            param = "prompt"
        try:
            ids = encode()
        except (MiniLLMError, ValueError) as e:      # no tokenizer, a template that refused, ...
            raise ApiError(400, str(e), param=param) from None
        return tokenized(ids, self.llm.config.max_seq_len)

    def _detokenize(self, raw: bytes) -> dict:
        """/detokenize: token ids' text."""
        body = parse(DetokenizeRequest, raw)
        if body.model is not None:
            self._check_model(body.model)
        vocab = self.llm.config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        try:
            return {"prompt": self.llm.tokenizer.decode(body.tokens)}
        except MiniLLMError as e:                    # no tokenizer
            raise ApiError(400, str(e), param="tokens") from None

    def _chat_ids(self, raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        body = parse(ChatCompletionRequest, raw)
        self._check_model(body.model)
        messages = body.plain_messages()
        self._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        tokenizer = self.llm.tokenizer
        tools, _ = self._checked_tools(body)
        messages, extra = messages_with_tools(tokenizer.chat_template, messages, tools)   # tools into the prompt
        # The template's rendering is bounded (chat_template.TemplateLimits); the ids come from the
        # same template, its text as control tokens and the messages' as text only.
        return body, self._encode(lambda: tokenizer.render_chat(messages, **extra),
                                  lambda: tokenizer.encode_chat(messages, True, **extra), "messages")

    def _checked_tools(self, body) -> tuple[list[dict], object]:
        """(the tools the prompt shows, tool_choice), checked; tool_choice "none" shows none (engine/tool_calls.py)."""
        try:
            tools, choice = check_tools(*body.plain_tools(), body.parallel_tool_calls)
        except GrammarError as e:
            raise ApiError(400, str(e), param=e.field, code="invalid_grammar") from None
        return (tools if choice != "none" else []), choice

    def _tool_syntax(self, body, chat: bool) -> ToolSyntax | None:
        """The model's tool-call syntax when this answer is to be parsed for calls, else None."""
        if not chat or not body.tools or body.tool_choice == "none":
            return None
        return tool_syntax(self.llm.tokenizer)

    def _grammar(self, body) -> Grammar | None:
        """The grammar the request's output must follow (engine/structured.py), compiled here, off the event
        loop and the engine thread (capped at COMPILE_TIMEOUT_S); a bad one is a 400 naming its field."""
        if not (body.response_format or body.structured_outputs or getattr(body, "tools", None)):
            return None                 # nothing to follow: a request of token ids needs no tokenizer
        try:
            tokenizer, vocab, calls = self.llm.tokenizer, self.llm.config.vocab_size, None
            if isinstance(body, ChatCompletionRequest):       # tool_choice "required" or a named function
                tools, choice = self._checked_tools(body)
                calls = tool_grammar(tools, choice, body.parallel_tool_calls is not False, tool_syntax(tokenizer),
                                     tokenizer.special_tokens)
            if calls is not None and (body.response_format or body.structured_outputs):
                raise GrammarError("tool_choice requires a tool call; it cannot also require response_format or "
                                   "structured_outputs", "tool_choice")
            if calls is not None:
                return compile_grammar(tokenizer, vocab, calls)
            return self.llm.grammar(plain(body.response_format), plain(body.structured_outputs))
        except GrammarError as e:
            raise ApiError(400, str(e), param=e.field, code="invalid_grammar") from None

    def _encode(self, text, ids, param: str) -> list[int]:
        """The prompt ids, after a one-pass lower bound on their number has not already refused them."""
        try:
            lower = self.llm.tokenizer.min_tokens(text())
            if lower > self.max_prompt_tokens:
                self._check_prompt_tokens(lower, param, at_least=True)
            prompt_ids = ids()
        except (MiniLLMError, ValueError) as e:      # no tokenizer, a template that refused, ...
            raise ApiError(400, str(e), param=param) from None
        self._check_prompt_tokens(len(prompt_ids), param)
        return prompt_ids

    def _check_prompt_chars(self, n_chars: int, param: str) -> None:
        limit = self.options.max_prompt_chars
        if n_chars > limit:
            raise ApiError(400, f"the prompt is {n_chars} characters; this server accepts at most {limit} "
                                "(minillm serve --max-prompt-chars)", param=param, code="prompt_too_long")

    def _check_prompt_tokens(self, n_tokens: int, param: str, at_least: bool = False) -> None:
        if n_tokens <= self.max_prompt_tokens:
            return
        size = f"at least {n_tokens}" if at_least else f"{n_tokens}"
        context = self.llm.config.max_seq_len
        if self.max_prompt_tokens == context - 1:
            raise ApiError(400, f"the prompt is {size} tokens; this model's context is {context}",
                           param=param, code="context_length_exceeded")
        raise ApiError(400, f"the prompt is {size} tokens; this server accepts at most {self.max_prompt_tokens} "
                            "(minillm serve --max-prompt-tokens)", param=param, code="context_length_exceeded")

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # -- on the event loop --
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
        if body.n > 1 and max_tokens is None:      # "as long as it takes" for n choices: what the pool holds of each
            pool = self.loop.engine.pool
            budget = max(1, min(budget, max_tokens_for_choices(len(ids), body.n, pool.block_size, pool.num_blocks)))
        grammar = await self._off_loop(0, self._grammar, body)
        sub = self.loop.submit(ids, n=body.n, max_tokens=budget, temperature=body.temperature, top_p=body.top_p,
                               top_k=body.top_k, stop=tuple(body.stop), seed=body.seed, ignore_eos=body.ignore_eos,
                               grammar=grammar, **self._controls(body, chat))
        watcher = asyncio.create_task(self._abort_on_disconnect(request, sub))
        try:
            await sub.accepted()
        except BaseException:
            watcher.cancel()
            raise
        if body.stream:
            # The engine's id lets the page find its own request in the live view (which shows ids only).
            return StreamingResponse(self._sse(sub, body, chat, watcher), media_type="text/event-stream",
                                     headers={"x-minillm-request-id": str(sub.rid)})
        logprobs = [self._logprobs(body, chat, ids) for _ in range(sub.n)]                 # per choice
        try:
            pieces, n_tokens, finish = [[self._echo(body, chat, ids)] for _ in range(sub.n)], 0, [None] * sub.n
            async for event in sub.stream():
                i = sub.index(event)
                pieces[i].append(event.text)
                n_tokens += len(event.token_ids)
                finish[i] = event.finish_reason
                if logprobs[i] is not None:
                    logprobs[i].chunk(event)
        finally:
            watcher.cancel()
        counts = usage(len(ids), n_tokens)                # the prompt once, every choice's tokens
        id, answer = (new_id("chatcmpl"), chat_completion) if chat else (new_id("cmpl"), completion)
        texts, reasoning = ["".join(p) for p in pieces], [None] * sub.n
        if chat:                                          # a thinking model's <think>...</think>: reasoning_content
            reasoning, texts = map(list, zip(*(split_answer(self.llm.tokenizer, ids, t) for t in texts)))
        syntax = self._tool_syntax(body, chat)
        if syntax is not None:                            # the model's tool-call syntax -> OpenAI's tool_calls
            calls = [parse_tool_calls(t, syntax) for t in texts]
            return with_choices([chat_completion(id, self.model_name, content, "tool_calls" if tc else f, counts,
                                                 lp and lp.total(), tool_calls=tc, reasoning=r)
                                 for (content, tc), f, lp, r in zip(calls, finish, logprobs, reasoning)])
        if chat:
            return with_choices([chat_completion(id, self.model_name, t, f, counts, lp and lp.total(), reasoning=r)
                                 for t, f, lp, r in zip(texts, finish, logprobs, reasoning)])
        return with_choices([answer(id, self.model_name, t, f, counts, lp and lp.total())
                             for t, f, lp in zip(texts, finish, logprobs)])

    def _controls(self, body, chat: bool) -> dict:
        """The request's sampling controls for the engine (engine/sampling.py), their token ids checked
        against the vocabulary here, where the 400 can name the field."""
        controls, vocab = body.controls(), self.llm.config.vocab_size
        for name in ("logit_bias", "stop_token_ids"):
            bad = [t for t in controls.get(name, ()) if t >= vocab]
            if bad:
                raise ApiError(400, f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param=name)
        if not chat and body.echo and body.logprobs is not None:
            controls["prompt_logprobs"] = body.logprobs
        return controls

    def _logprobs(self, body, chat: bool, ids: list[int]) -> ChoiceLogprobs | None:
        """What turns a choice's TokenLogprobs into OpenAI's shape, when the request asked for logprobs."""
        if body.token_logprobs() is None:
            return None
        return ChoiceLogprobs(self.llm.tokenizer, chat, ids if not chat and body.echo else None)

    def _echo(self, body, chat: bool, ids: list[int]) -> str:
        """The prompt's text, before the answer's, when a completion asks for echo."""
        if chat or not body.echo:
            return ""
        return body.prompt if isinstance(body.prompt, str) else self.llm.tokenizer.decode(ids)

    async def _sse(self, sub: Submission, body, chat: bool, watcher: asyncio.Task) -> AsyncIterator[str]:
        """The streamed answer: one chunk per step that produced text, a last chunk with the finish
        reason, optionally one with the usage, then [DONE]."""
        id, model = new_id("chatcmpl" if chat else "cmpl"), self.model_name

        def chunk(text: str | None, finish: str | None, index: int, delta: dict | None = None,
                  logprobs: dict | None = None) -> dict:
            if chat:
                body = chat_chunk(id, model, delta or ({} if text is None else {"content": text}), finish, logprobs)
            else:
                body = completion(id, model, text or "", finish, None, logprobs)
            return {**body, "choices": [{**body["choices"][0], "index": index}]}     # choice `index`'s chunk
        logprobs = [self._logprobs(body, chat, sub.prompt_ids) for _ in range(sub.n)]     # per choice
        echo = [self._echo(body, chat, sub.prompt_ids)] * sub.n                          # before each one's text
        syntax = self._tool_syntax(body, chat)
        calls = [ToolCallStream(syntax) if syntax else None for _ in range(sub.n)]      # holds back tool calls
        thinking = [splitter_for(self.llm.tokenizer, sub.prompt_ids) if chat else None for _ in range(sub.n)]
        try:
            if chat:
                for i in range(sub.n):
                    yield sse(chunk(None, None, i, delta={"role": "assistant", "content": ""}))
            n_tokens = 0
            async for event in sub.stream():
                n_tokens += len(event.token_ids)
                i = sub.index(event)
                text, echo[i] = echo[i] + event.text, ""
                if thinking[i] is not None:                  # the reasoning goes out as reasoning_content
                    said, text = thinking[i].push(text)
                    if event.finished:
                        said, text = (a + b for a, b in zip((said, text), thinking[i].finish()))
                    if said:
                        yield sse(chunk(None, None, i, delta={"reasoning_content": said}))
                if calls[i] is not None:
                    text = calls[i].push(text)
                part = logprobs[i].chunk(event) if logprobs[i] is not None else None
                if text or part is not None:
                    yield sse(chunk(text, None, i, logprobs=part))
                if calls[i] is not None and (pieces := calls[i].deltas()):    # a call's name, its arguments' text
                    yield sse(chunk(None, None, i, delta={"tool_calls": pieces}))
                if event.finished:
                    finish = event.finish_reason
                    if calls[i] is not None:                 # what was held back: content, or the calls' rest
                        rest, pieces = calls[i].finish_deltas()
                        if rest:
                            yield sse(chunk(rest, None, i))
                        if pieces or calls[i].called:
                            finish = "tool_calls"
                        if pieces:
                            yield sse(chunk(None, None, i, delta={"tool_calls": pieces}))
                    yield sse(chunk(None, finish, i))
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


def create_app(llm, engine, model_name: str, options: ServeOptions | None = None,
               host: str = "127.0.0.1", planner=None) -> FastAPI:
    """The ASGI app: OpenAI's routes plus /metrics and /health, one engine thread for its lifetime.
    `host` is the address it will listen on: the Host header must name it (or `options.allowed_hosts`).
    The page at / and /plan comes too (web.py); `planner` backs /plan's numbers (tools/planner.py's
    PlannerAPI, passed in: serve may not import tools)."""
    options = options or ServeOptions()
    server = OpenAIServer(llm, engine, model_name, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        yield
        server.loop.stop()
        server.close()

    # Any route may meet the Guard's refusals (Host, Content-Length) and the connection's (connections.py).
    app = FastAPI(title="minillm", lifespan=lifespan, responses=error_responses(400, 408, 413, 503))
    app.state.server = server
    app.include_router(api_routes(server))
    app.include_router(tokenizer_routes(server))
    app.include_router(ops_routes(server))
    add_web(app, server, planner)
    add_error_handlers(app)
    # Middleware added last runs first: the Guard (Host, body size) sees every request, then CORS.
    if options.cors_origin:
        app.add_middleware(CORSMiddleware, allow_origins=[options.cors_origin], allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(Guard, hosts=host_names(host, options.allowed_hosts), max_body_bytes=options.max_body_bytes,
                       on_refusal=server.metrics.count_refusal)
    return app


# A completion is JSON, or server-sent events when the request asks to stream.
ANSWER = {200: {"description": "The answer", "content": {"application/json": {}, "text/event-stream": {}}}}


def api_routes(server: OpenAIServer) -> APIRouter:
    """OpenAI's routes under /v1, behind the API key when one is set."""
    key = server.options.api_key
    api = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key(key))],
                    responses=error_responses(401) if key else {})
    api.get("/models")(server.models)
    answers = {**ANSWER, **error_responses(400, 404, 415)}
    facts = server.served_facts()
    api.post("/completions", openapi_extra=request_body(CompletionRequest, facts),
             responses=answers)(server.completions)
    api.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest, facts),
             responses=answers)(server.chat_completions)
    return api


def tokenizer_routes(server: OpenAIServer) -> APIRouter:
    """vLLM's /tokenize and /detokenize (at the root, as vLLM serves them), behind the API key when one is set."""
    key = server.options.api_key
    routes = APIRouter(dependencies=[Depends(require_api_key(key))],
                       responses={**error_responses(400, 404, 415), **(error_responses(401) if key else {})})
    facts = server.served_facts()
    routes.post("/tokenize", openapi_extra=request_body(TokenizeRequest, facts))(server.tokenize)
    routes.post("/detokenize", openapi_extra=request_body(DetokenizeRequest, facts))(server.detokenize)
    return routes


def ops_routes(server: OpenAIServer) -> APIRouter:
    """What operators and load balancers poll: /health is open, like vLLM's; /metrics (the traffic, the
    queue, the memory) wants the API key when one is set, unless --public-metrics."""
    ops = APIRouter()
    metrics_key = None if server.options.public_metrics else server.options.api_key
    ops.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(require_api_key(metrics_key))],
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                       **(error_responses(401) if metrics_key else {})})(server.metrics_text)
    ops.get("/health")(server.health)
    return ops


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal and every failure is OpenAI's error JSON."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        if e.status < 500:
            request.app.state.server.metrics.count_refusal(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)            # unknown routes, wrong methods: OpenAI's shape too
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)          # a 405's Allow: the methods the path takes

    @app.exception_handler(ClientDisconnect)         # hung up mid-upload: connections.py logs its one line
    async def client_gone(request: Request, e: ClientDisconnect):
        return Response(status_code=499)             # never sent: nobody is there to read it

    @app.exception_handler(Exception)                # a bug: still JSON (uvicorn logs the traceback)
    async def server_error(request: Request, e: Exception):
        error = ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
        return JSONResponse(error.body(), status_code=500)


def request_body(schema, facts: dict) -> dict:
    """The OpenAPI requestBody of a route that parses its own body (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": json_schema(schema, facts)}}}}


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
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **uvicorn_settings(app)))
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


# An open page keeps its event stream open for good: shutdown waits this long for it, then closes it.
GRACEFUL_SHUTDOWN_S = 3


def uvicorn_settings(app: FastAPI) -> dict:
    """uvicorn's settings for `app`: the h11 protocol with the connection limits of the app's options
    (connections.py), and a short graceful shutdown."""
    from minillm.serve.connections import LimitedH11Protocol
    options = app.state.server.options
    http = functools.partial(LimitedH11Protocol, header_timeout_s=options.header_timeout_s,
                             body_timeout_s=options.body_timeout_s, max_connections=options.max_connections)
    return {"http": http, "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S}


def serve(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions | None = None,
          planner=None, **engine_options) -> None:
    """Run the server until Ctrl-C. engine_options go to `Engine` (max_batch, kv_cache, ...); planner
    backs the /plan page (create_app)."""
    import uvicorn

    from minillm.engine.engine import Engine
    engine = Engine(llm, **engine_options)
    app = create_app(llm, engine, model_name, options, host, planner)
    uvicorn.run(app, host=host, port=port, log_level="info", **uvicorn_settings(app))
