"""The engine: continuous batching over a paged KV cache, with prefix caching.

    engine = minillm.Engine(llm)
    rid = engine.add_request("Once upon a time", max_tokens=32)
    while engine.has_unfinished():
        for event in engine.step():             # one batched forward pass for every running request
            print(event.request_id, event.text, event.finished)

The step loop is the whole engine: schedule (scheduler.py), run the batch (the runner `llm.batching`
made: batched.py, or on the GPU cuda/gpu_batched.py, the pool on the device, logits [B, vocab] copied
back once a step), sample each request with its own sampler, detokenize, finish the ones that are done
(their blocks go back to the pool, or stay in the prefix cache). With a sliding window, a running request
gives back the blocks its window has passed, so its KV memory stops growing at about the window's size.
`generate(prompts)` runs the loop for a list of prompts and returns one `Generation` per prompt, like
`llm.generate` does for one. `add_choices` / `generate_choices` ask for n continuations of one prompt: it is
prefilled once and its blocks shared copy-on-write (choices.py: the scheduler says which blocks to copy, the
pool copies them before the step runs).

Greedy steps: when every request in a step samples greedily (temperature 0, and nothing else: no penalty,
logit_bias, token mask or logprobs, `Sampler.argmax_only`) and the step verifies no speculative drafts and
wants no prompt logprobs, the engine asks the runner for token ids instead of logits (`runner.forward_greedy`):
the GPU runner takes each row's argmax on the device and copies back B int32 instead of [B, vocab] fp32.
The tokens are the ones the Sampler would pick (np.argmax, NaN rule included), and go through the same
stop / max_tokens / stop-string rules. Engine(device_greedy=False) sends every step through the logits
and the samplers (to compare). A request with a grammar (structured output, engine/structured.py) never takes
that path: its mask comes first, and is filled on a worker thread while the forward pass runs (`_fill_masks`).

One client cannot slow another down: every request in a step waits for the whole step, so while more than
one request has work, a step takes every decode but only as many prompt tokens as keep it near
`target_step_ms`, measured on this machine as it runs (step_budget.py, scheduler.py).
A 7.5k-token prompt is then prefilled over many short steps while a chat beside it keeps streaming, where
512-token chunks stalled the chat a second a step, and its next turn for the whole prefill (issue 40;
`bench serve --workload mixed`, lessons/BENCHMARKS.md). A prompt with nobody beside it still takes whole
`max_batch_tokens` chunks, and beside others at least 3x a step's fixed cost, so its own first token
comes little later.

Thread safety: `add_request`, `abort`, `step` and `stats` take one lock, so a server may run `step()`
in a loop on one thread and call the others from its request handlers.
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence as Seq

import numpy as np

from minillm.engine.batched import SeqChunk
from minillm.engine.choices import blocks_for_choices, choice_seed
from minillm.errors import InvalidValue, MiniLLMError
from minillm.engine.generate import Generation, _TextCollector
from minillm.engine.paged_kv import DEFAULT_BLOCK_SIZE, BlockManager
from minillm.engine.prefix_cache import PrefixCache
from minillm.engine.structured import Grammar, GrammarState, constrained_pick, log_dead_end
from minillm.engine.sampling import Sampler, SamplingParams, token_logprob
from minillm.threads import for_rows
from minillm.engine.scheduler import Scheduler, Sequence
from minillm.engine.speculative.pooled import EngineSpeculation
from minillm.engine.step_budget import DEFAULT_TARGET_STEP_MS, StepBudget
from minillm.model.kv_cache import kv_cache_format


@dataclass
class StepEvent:
    """What one step produced for one request."""
    request_id: int
    token_ids: list[int]                # new this step (empty when it stopped at EOS, or was aborted)
    text: str                           # new text this step; text that may become a stop string is held back
    finished: bool
    finish_reason: str | None           # "stop" | "length" | "abort" | None while running
    logprobs: list | None = None        # a TokenLogprob per token in token_ids, when the request asked for them
    prompt_logprobs: list | None = None  # with the first token, when asked for: None, then one per prompt token


@dataclass(eq=False)
class Request:
    """A sequence plus what the engine keeps per request: sampler, stop rules, text, timings."""
    seq: Sequence
    sampler: Sampler
    stop_ids: set[int]
    text: _TextCollector
    arrival: float
    pieces: list[str] = field(default_factory=list)      # text produced since the last event
    sample_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    speculative: object | None = None                    # SpeculativeStats once finished, with speculation
    logprobs: list | None = None                         # TokenLogprob per output token, when asked for
    prompt_logprobs: list | None = None                  # per prompt token from the second, when asked for
    prompt_top: int = 0                                  # top alternatives per prompt token
    grammar: GrammarState | None = None                  # structured output: where it is in its grammar
    forks: list["Request"] = field(default_factory=list)  # the other choices of its prompt, off the queue until
                                                          # its prompt is computed, then forked from it (choices.py)

    @property
    def argmax_only(self) -> bool:
        """Is its next token its raw row's argmax (so the runner may pick it on the device)?"""
        return self.sampler.argmax_only and self.grammar is None

    def generation(self) -> Generation:
        """The result in `llm.generate`'s form (times measured from add_request)."""
        times, n = self.sample_times, len(self.seq.output_ids)
        ttft = times[0] - self.arrival if times else 0.0
        decode_s = times[n - 1] - times[0] if n > 1 else 0.0
        latencies = [b - a for a, b in zip([self.arrival] + times, times)]
        return Generation(self.text.text, list(self.seq.output_ids), self.seq.prompt_len, ttft, decode_s,
                          self.finish_reason or "abort", latencies, speculative=self.speculative,
                          logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)


class Engine:
    """Continuous batching for one model: many requests, one batched forward pass per step."""

    def __init__(self, llm, block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None,
                 max_kv_bytes: int | None = None, max_batch: int = 32, max_batch_tokens: int | None = None,
                 prefix_caching: bool = True, kv_cache: str | None = None, chunked_prefill: bool = True,
                 speculative=None, draft_tokens: int | None = None, device_greedy: bool = True,
                 target_step_ms: float | None = DEFAULT_TARGET_STEP_MS):
        """kv_cache: "auto" (the model's float type: fp32 here, the weights' 16 bits on the GPU) or "int8"
        (codes with a scale per position and head); default: as the model was loaded. The pool holds
        `num_blocks` blocks of `block_size` tokens, or as many as fit in `max_kv_bytes`. The backend comes
        with the LLM: `llm.batching` makes the pool and the runner (engine.batched.CPUBatching, or the
        GPU's for an llm loaded with device="cuda"); the engine never imports a backend. speculative:
        a drafter or its name, as llm.generate takes it ("ngram", "int4", "layers:N", a draft model), with
        `draft_tokens` drafts per request and step (default: the drafter's; engine/speculative/pooled.py; a draft model's KV
        takes a share of every block). max_batch_tokens: the tokens one step computes at most, decodes first,
        then prompt chunks (a fixed budget); default: the backend's (512 on the CPU, 2048 on the GPU), and a
        step beside other requests takes only the prompt tokens that keep it near target_step_ms (measured as
        it runs; None: no target). max_batch_tokens=0: the backend's, shared in arrival order, no budget (the
        scheduler before issue 40, for comparisons: a prompt's chunk can stall the decodes). device_greedy: a step
        whose requests are all greedy takes token ids from the runner (picked on the device by the GPU's)
        rather than logits (default on)."""
        self.llm, self.config = llm, llm.config
        backend = llm.batching                           # checks the model: GQA, a model it can batch
        if block_size < 1 or max_batch < 1 or (max_batch_tokens is not None and max_batch_tokens < 0):
            raise MiniLLMError("block_size and max_batch must be >= 1, max_batch_tokens >= 0")
        if target_step_ms is not None and not target_step_ms > 0:
            raise MiniLLMError(f"target_step_ms must be > 0, got {target_step_ms}")
        budget = None                                    # a fixed max_batch_tokens: no budget to adapt
        if max_batch_tokens is None and target_step_ms is not None:
            budget = StepBudget(target_step_ms / 1e3, backend.default_batch_tokens)
        arrival_order, max_batch_tokens = max_batch_tokens == 0, max_batch_tokens or backend.default_batch_tokens
        if kv_cache is None:                             # as the model was loaded
            kv_cache = llm.model.kv_cache if llm.model.kv_cache in ("int8", "fp8") else "auto"
        try:
            kv_cache = kv_cache_format(kv_cache, backend.device)
        except ValueError as e:
            raise MiniLLMError(str(e)) from None
        if kv_cache == "fp8":                           # the paged pool has float and int8 blocks only
            raise MiniLLMError("kv_cache='fp8' is a contiguous cache (llm.generate, llm.logits): the engine's paged "
                               "KV pool holds auto or int8 blocks")
        drafter = self._drafter(speculative, backend) if speculative is not None else None
        draft_tokens = draft_tokens if draft_tokens is not None or drafter is None else drafter.default_k
        if draft_tokens is not None and draft_tokens < 1:
            raise MiniLLMError(f"draft_tokens must be >= 1, got {draft_tokens}")
        storage = "int8" if kv_cache == "int8" else "float32"
        if num_blocks is None:
            per_block = backend.bytes_per_block(self.config, block_size, kv_cache)
            if drafter is not None:
                per_block += EngineSpeculation.draft_bytes_per_block(drafter, block_size, storage)
            num_blocks = (max_kv_bytes or backend.default_kv_bytes) // per_block
            if backend.cap_to_max_batch and max_kv_bytes is None:   # no more than max_batch full contexts
                num_blocks = min(num_blocks, max_batch * math.ceil(self.config.max_seq_len / block_size))
        if num_blocks < 1:
            raise MiniLLMError(f"max_kv_bytes={max_kv_bytes} holds no KV block of {block_size} tokens")
        self.pool = backend.new_pool(self.config, num_blocks, block_size, kv_cache)
        self.runner = backend.new_runner(self.pool)
        self.device_greedy = device_greedy and hasattr(self.runner, "forward_greedy")
        self.spec = None if drafter is None else EngineSpeculation(drafter, draft_tokens, num_blocks, block_size,
                                                                   storage, self.config.sliding_window)
        self.prefix_cache = PrefixCache() if prefix_caching else None
        self.blocks = BlockManager(num_blocks, self.prefix_cache)
        self.scheduler = Scheduler(self.blocks, block_size, max_batch, max_batch_tokens, self.prefix_cache,
                                   chunked_prefill, window=self.config.sliding_window, budget=budget,
                                   arrival_order=arrival_order)
        self.requests: dict[int, Request] = {}           # unfinished ones
        self._events: list[StepEvent] = []               # aborts, reported by the next step
        self._lock = threading.RLock()
        self._next_id = 0
        self._mask_worker: ThreadPoolExecutor | None = None     # fills grammar masks beside the forward pass
        self._counters = dict(tokens_generated=0, tokens_computed=0, prompt_tokens_computed=0, steps=0,
                              batch_size=0, peak_blocks_used=0)

    def _drafter(self, speculative, backend):
        """The drafter for `speculative` (the LLM builds it), checked for what the engine can run."""
        if backend.device != "cpu":
            raise MiniLLMError("speculative decoding in the engine runs on the CPU only for now")
        drafter = self.llm.drafter(speculative)
        draft_model = getattr(drafter, "model", None)
        if draft_model is not None and (draft_model.config.attention != "gqa" or
                                        draft_model.config.sliding_window != self.config.sliding_window):
            raise MiniLLMError("the engine's draft model must be GQA with the target's sliding window (it "
                               "shares the target's block tables)")
        return drafter

    # ---- requests in ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | list[dict], max_tokens: int = 64, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, stop: Seq[str] = (), seed: int | None = None,
                    chat: bool = False, ignore_eos: bool = False, prompt_logprobs: int | None = None,
                    grammar: Grammar | None = None, **controls) -> int:
        """Queue a request (text, token ids, or chat messages); -> its request id. top_k=0 and
        top_p=1.0 mean no filter; ignore_eos runs to max_tokens (benchmarks: fixed output lengths).
        controls: the other SamplingParams fields (min_p, penalties, logit_bias, stop_token_ids, logprobs);
        prompt_logprobs: the logprob of every prompt token after the first, with this many alternatives
        (its prompt is then computed whole: no prefix-cache hit). grammar: every token follows it
        (structured output: `llm.grammar(response_format=...)`, engine/structured.py)."""
        return self._add(prompt, max_tokens, temperature, top_p, top_k, stop, seed, chat, ignore_eos,
                         prompt_logprobs, grammar=grammar, **controls).seq.request_id

    def add_choices(self, prompt: str | list[int] | list[dict], n: int, max_tokens: int = 64,
                    seed: int | None = None, chat: bool = False, **options) -> list[int]:
        """Queue n choices of one prompt (OpenAI's `n`); -> their request ids, choice i at index i. The prompt
        is prefilled once and its KV blocks are shared copy-on-write by the n continuations (engine/choices.py);
        with a seed, choice i samples with choice_seed(seed, i). options: add_request's."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InvalidValue(f"n must be an integer >= 1, got {n!r}", param="n")
        if n > 1 and self.spec is not None:
            raise InvalidValue("n > 1 does not run with speculative decoding (--speculative)", param="n")
        if n > 1 and getattr(self.llm.model, "comm", None) is not None:
            raise InvalidValue("n > 1 does not run with tensor parallelism (--tp): the other ranks' pools "
                               "would not copy the shared blocks", param="n")
        with self._lock:                                 # no step between the choices: the first one is prefilled
            ids = self._prompt_ids(prompt, chat)
            self._check_choices_fit(len(ids), min(max_tokens, self.config.max_seq_len - len(ids)), n)
            rids: list[int] = []
            try:
                for i in range(n):
                    rids.append(self.add_request(ids, max_tokens=max_tokens, seed=choice_seed(seed, i), **options))
            except MiniLLMError:
                for rid in rids:
                    self.abort(rid)
                raise
            first, *others = [self.requests[rid] for rid in rids]
            for request in others:                       # off the queue: they fork from the first (_fork)
                self.scheduler.waiting.remove(request.seq)
            first.forks = others
        return rids

    def _check_choices_fit(self, n_prompt: int, max_tokens: int, n: int) -> None:
        """n choices run together: more blocks than the pool holds at once is refused, naming n."""
        if n == 1:
            return                                       # _add's _check_fits says it for one request
        bs = self.pool.block_size
        need = blocks_for_choices(n_prompt, max_tokens, n, bs)
        if self.config.sliding_window:                   # each choice holds about a window's blocks at most
            need = min(need, n * math.ceil((self.config.sliding_window + self.scheduler.max_batch_tokens) / bs))
        if need > self.pool.num_blocks:
            raise InvalidValue(f"n={n} choices of up to {max_tokens} new tokens need {need} KV blocks of {bs} tokens "
                               f"at once (the prompt's full blocks shared); the pool has {self.pool.num_blocks}: "
                               "lower n or max_tokens", param="n")

    def _add(self, prompt, max_tokens, temperature, top_p, top_k, stop, seed, chat, ignore_eos=False,
             prompt_logprobs=None, grammar: Grammar | None = None, **controls) -> Request:
        if max_tokens < 1:
            raise MiniLLMError(f"max_tokens must be >= 1, got {max_tokens}")
        try:
            params = SamplingParams(temperature, top_k or None, None if top_p == 1.0 else top_p, seed, **controls)
            params.check_vocab(self.config.vocab_size)
            if prompt_logprobs is not None:
                SamplingParams(logprobs=prompt_logprobs)             # the same range as logprobs
        except ValueError as e:
            raise MiniLLMError(str(e)) from None
        if self.spec is not None:
            params.check_speculative()
            if prompt_logprobs is not None:
                raise MiniLLMError("prompt logprobs do not run with speculative decoding (--speculative) yet")
            if grammar is not None:
                raise MiniLLMError("structured output does not run with speculative decoding (--speculative) yet")
        if grammar is not None and grammar.vocab_size != self.config.vocab_size:
            raise MiniLLMError("this grammar was compiled for another model's vocabulary")
        ids = self._prompt_ids(prompt, chat)
        max_tokens = min(max_tokens, self.config.max_seq_len - len(ids))
        self._check_fits(len(ids) + max_tokens - 1)
        tokenizer = self._tokenizer()
        stop_ids = set() if ignore_eos else set(self.config.eos_token_ids) | set(tokenizer.eos_ids if tokenizer else ())
        stop_ids |= set(params.stop_token_ids)                   # asked for by name: they stop even with ignore_eos
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            pieces: list[str] = []
            request = Request(Sequence(rid, list(ids), len(ids), max_tokens, whole_prompt=prompt_logprobs is not None),
                              Sampler(params, ids), stop_ids, _TextCollector(tokenizer, list(stop), pieces.append),
                              time.perf_counter(), pieces, logprobs=[] if params.logprobs is not None else None,
                              prompt_logprobs=[None] if prompt_logprobs is not None else None,
                              prompt_top=prompt_logprobs or 0, grammar=grammar.start() if grammar else None)
            self.requests[rid] = request
            self.scheduler.add(request.seq)
        return request

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        if not prompt:
            raise MiniLLMError("the prompt is empty")
        if isinstance(prompt, (list, tuple)) and not isinstance(prompt[0], dict):
            ids = [int(t) for t in prompt]
            if min(ids) < 0 or max(ids) >= self.config.vocab_size:
                raise MiniLLMError(f"token ids must be in [0, {self.config.vocab_size})")
        else:
            ids = self.llm.prompt_ids(prompt, chat=chat or None)
        if not ids:
            raise MiniLLMError("the prompt is empty")
        if len(ids) >= self.config.max_seq_len:
            raise MiniLLMError(f"the prompt is {len(ids)} tokens; this model's context is {self.config.max_seq_len}")
        return ids

    def _check_fits(self, n_positions: int) -> None:
        """A request that needs more blocks at once than the whole pool could never finish: refuse it now.
        With a sliding window it holds at most the window's blocks plus one step's tokens (the scheduler
        gives back the blocks behind the window), however long it runs."""
        bs, window, s = self.pool.block_size, self.config.sliding_window, self.scheduler
        need = math.ceil(n_positions / bs)
        if window:
            step = min(n_positions, s.max_batch_tokens) if s.chunked_prefill else n_positions
            need = min(need, math.ceil((window - 1 + step) / bs) + 1)
        if need > self.pool.num_blocks:
            raise MiniLLMError(f"this request needs {need} KV blocks of {self.pool.block_size} tokens; the pool "
                               f"has {self.pool.num_blocks}: lower max_tokens or give the engine more KV memory")

    def _tokenizer(self):
        try:
            return self.llm.tokenizer
        except MiniLLMError:
            return None                      # token-id prompts still work; texts stay empty

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free its blocks; its final event comes with the next step.
        False if it is unknown or already finished."""
        with self._lock:
            request = self.requests.get(request_id)
            if request is None:
                return False
            self._finish(request, "abort")
            self._events.append(StepEvent(request_id, [], "".join(request.pieces), True, "abort"))
            request.pieces.clear()
            return True

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Schedule, run one batched forward pass, sample; -> what each request produced."""
        with self._lock:
            budget = self.scheduler.budget
            if budget is None:
                return self._step()
            started = budget.clock()
            events = self._step()
            budget.record(*self.scheduler.last_step, budget.clock() - started)    # sizes the next steps
            return events

    def _step(self) -> list[StepEvent]:
        events, self._events = self._events, []
        if self.spec is not None:                                # drafts ride along as pending tokens
            self.spec.draft(self.scheduler.running, self.requests)
        batch = self.scheduler.schedule()
        self.pool.copy_blocks(self.scheduler.copies)              # copy-on-write of shared blocks (choices.py)
        if self.spec is not None:
            self.spec.fill(batch, self.requests)
        self._count_step(batch)
        if not batch:
            return events
        for_rows(sum(n for _, n in batch))                       # decode or prefill: its BLAS threads (threads.py)
        chunks = [SeqChunk(seq.tokens[seq.num_computed:seq.num_computed + n], seq.num_computed,
                           seq.block_table) for seq, n in batch]
        verify = self.spec.rows(batch) if self.spec is not None else None
        if verify is not None:                                   # a verify chunk needs all its rows
            logits = self.runner.forward(chunks, rows=verify[0])
            for (seq, n), rows in zip(batch, verify[1]):
                request = self.requests[seq.request_id]
                if seq.request_id in self.spec.pending:
                    events.append(self._emit(request, self.spec.verify(request, logits[rows], self.scheduler)))
                else:
                    self._advance_and_sample(seq, n, logits[rows][-1], events)
            return events
        wanted = self._prompt_rows(batch)                        # prompt logprobs: every row of those chunks
        if wanted is None and self.device_greedy and all(self.requests[seq.request_id].argmax_only
                                                         for seq, _ in batch):
            self._greedy_step(batch, chunks, events)             # token ids back, not logits
            return events
        masks = self._fill_masks(batch)                          # grammar masks, filled while the model runs
        if wanted is None:
            logits = self.runner.forward(chunks)                 # [len(batch), vocab]
            slices = [slice(i, i + 1) for i in range(len(batch))]
        else:
            logits = self.runner.forward(chunks, rows=wanted[0])  # [len(rows), vocab]
            slices = wanted[1]
        if masks is not None:
            masks.result()
        for (seq, n), rows in zip(batch, slices):
            self._record_prompt_logprobs(self.requests[seq.request_id], logits[rows])
            self._advance_and_sample(seq, n, logits[rows][-1], events)
        return events

    def _prompt_rows(self, batch) -> tuple[list[int], list[slice]] | None:
        """Which rows of the packed batch need logits when a chunk still owes prompt logprobs: every row of
        such a chunk, the last of the rest. -> (rows, each sequence's slice of them), or None."""
        def owes(seq) -> bool:
            done = self.requests[seq.request_id].prompt_logprobs
            return done is not None and len(done) < seq.prompt_len
        if not any(owes(seq) for seq, _ in batch):
            return None
        rows, slices, start = [], [], 0
        for seq, n in batch:
            first = len(rows)
            rows.extend(range(start, start + n) if owes(seq) else [start + n - 1])
            slices.append(slice(first, len(rows)))
            start += n
        return rows, slices

    def _record_prompt_logprobs(self, request: Request, logits: np.ndarray) -> None:
        """The logprobs of the prompt tokens these rows predict (row j: the token at position j + 1), the ones
        not recorded yet (a preempted request recomputes its prompt).    logits: [rows, vocab]"""
        seq, done = request.seq, request.prompt_logprobs
        if done is None or len(done) >= seq.prompt_len:          # its slice is one row: nothing owed
            return
        start = seq.num_computed                                 # before `advance`: the chunk's first position
        for j, row in enumerate(logits, start):
            if len(done) == j + 1 and j + 1 < seq.prompt_len:
                done.append(token_logprob(row, seq.tokens[j + 1], request.prompt_top))

    def _fill_masks(self, batch):
        """Start filling the grammar masks of the requests that sample this step, on a worker thread (llguidance
        drops the GIL), so they cost no time beside the forward pass; -> a future, or None without grammars."""
        states = [self.requests[seq.request_id].grammar for seq, n in batch
                  if self.requests[seq.request_id].grammar is not None and seq.num_computed + n == len(seq.tokens)]
        if not states:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="minillm-masks")
        return self._mask_worker.submit(lambda: [state.prepare() for state in states])

    def _greedy_step(self, batch, chunks: list[SeqChunk], events: list) -> None:
        """A step whose requests all sample greedily: the runner returns each row's argmax (on the GPU, picked
        on the device: B int32 copied back, not [B, vocab] fp32), the token each Sampler would pick."""
        ids = self.runner.forward_greedy(chunks)                     # [len(batch)] int32
        for (seq, n), token in zip(batch, ids.tolist()):
            request = self._advance(seq, n)
            if request is not None:
                events.extend(self._emit(r, [token]) for r in self._fork(request))

    def _advance(self, seq, n: int) -> Request | None:
        """Count seq's n computed tokens; -> its request if its next token is due now (caught up), else None."""
        self.scheduler.advance(seq, n)
        return self.requests[seq.request_id] if seq.num_pending == 0 else None

    def _advance_and_sample(self, seq, n: int, row: np.ndarray, events: list) -> None:
        request = self._advance(seq, n)
        if request is not None:
            events.extend(self._sample(r, row) for r in self._fork(request))

    def _fork(self, request: Request) -> list[Request]:
        """request's first token is due: the other choices of its prompt join it now, sharing its blocks
        (Scheduler.fork), to sample from the same logits. -> the requests to sample this row for."""
        if not request.forks:
            return [request]
        waiting, request.forks = [r for r in request.forks if not r.seq.finished], []   # not the aborted ones
        for r in waiting:
            if request.prompt_logprobs is not None:          # computed once, for every choice
                r.prompt_logprobs = list(request.prompt_logprobs)
        joined = self.scheduler.fork(request.seq, [r.seq for r in waiting])
        return [request] + waiting[:joined]

    def _sample(self, request: Request, logits: np.ndarray) -> StepEvent:
        """The same rules as generate.generate_ids: EOS stops (and is not output), then stop strings,
        then max_tokens."""
        token = constrained_pick(request.sampler, logits, request.grammar)
        if token is None:                                            # its grammar allows no token: it ends here
            log_dead_end(len(request.seq.output_ids))
            self._finish(request, "stop")
            text = "".join(request.pieces)
            request.pieces.clear()
            return StepEvent(request.seq.request_id, [], text, True, "stop", [] if request.logprobs is not None else None)
        event = self._emit(request, [token])
        if request.logprobs is not None:
            event.logprobs = [request.sampler.last_logprob] if event.token_ids else []
            request.logprobs += event.logprobs
        if len(request.sample_times) == 1:                           # its first token: the prompt is all computed
            event.prompt_logprobs = request.prompt_logprobs
        return event

    def _emit(self, request: Request, tokens: list[int]) -> StepEvent:
        """Append sampled tokens (one, or a speculative run) under those rules, one token at a time."""
        seq, now = request.seq, time.perf_counter()
        new, reason = [], None
        for token in tokens:
            request.sample_times.append(now)
            if token in request.stop_ids:
                reason = "stop"
                break
            new.append(token)
            seq.tokens.append(token)
            self._counters["tokens_generated"] += 1
            if request.text.push(token):
                reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            self._finish(request, reason)
        text = "".join(request.pieces)
        request.pieces.clear()
        return StepEvent(seq.request_id, new, text, reason is not None, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        if self.spec is not None:
            request.speculative = self.spec.stats.pop(request.seq.request_id, None)
            self.spec.forget(request.seq.request_id)
        request.text.finish()                                        # release held-back text
        self.scheduler.finish(request.seq)
        del self.requests[request.seq.request_id]
        waiting = [r for r in request.forks if not r.seq.finished]
        if waiting:                          # it ended before its prompt was computed: the next choice leads
            waiting[0].forks = waiting[1:]
            self.scheduler.waiting.appendleft(waiting[0].seq)

    def _count_step(self, batch) -> None:
        c = self._counters
        c["steps"] += 1
        c["batch_size"] = len(batch)
        c["tokens_computed"] += sum(n for _, n in batch)
        c["prompt_tokens_computed"] += sum(max(0, min(seq.num_computed + n, seq.prompt_len) - seq.num_computed)
                                           for seq, n in batch)      # before `advance`: num_computed is old
        c["peak_blocks_used"] = max(c["peak_blocks_used"], self.blocks.num_used)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests or self._events)

    def stats(self) -> dict:
        """Counters for monitoring: queue lengths, blocks, tokens, the last batch, prefix-cache hits.
        Blocks: used (held by requests) + cached (unused, kept for their prefix) + free = total."""
        with self._lock:
            c, cache = self._counters, self.prefix_cache
            return dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                        blocks_used=self.blocks.num_used, blocks_total=self.blocks.num_blocks,
                        blocks_cached=cache.num_unused if cache else 0, blocks_free=len(self.blocks.free),
                        tokens_generated=c["tokens_generated"],
                        batch_size=c["batch_size"], prefix_hit_tokens=cache.hit_tokens if cache else 0,
                        prompt_tokens_computed=c["prompt_tokens_computed"], tokens_computed=c["tokens_computed"],
                        preemptions=self.scheduler.preemptions,
                        steps=c["steps"], kv_bytes_per_block=self.pool.bytes_per_block,
                        peak_kv_bytes=c["peak_blocks_used"] * self.pool.bytes_per_block, **self._spec_stats())

    def _spec_stats(self) -> dict:
        """Speculative decoding's counters (none without it): drafted, accepted, verify passes, and the two
        ratios users compare (acceptance rate; tokens per target pass, accepted + 1)."""
        if self.spec is None:
            return {}
        t = self.spec.totals
        return dict(spec_draft_tokens=t.draft_tokens, spec_accepted_tokens=t.accepted_tokens,
                    spec_verify_passes=t.target_forwards, spec_acceptance_rate=t.acceptance_rate,
                    spec_mean_accepted_length=t.mean_accepted_length)

    # ---- the convenience loop ------------------------------------------------------------------
    def generate_choices(self, prompt: str | list[int] | list[dict], n: int, max_tokens: int = 64,
                         **options) -> list[Generation]:
        """n continuations of one prompt, its prefill done once (add_choices); -> one Generation per choice,
        choice i at index i. options: add_request's (temperature, seed, ...)."""
        requests = [self.requests[rid] for rid in self.add_choices(prompt, n, max_tokens, **options)]
        while not all(r.seq.finished for r in requests):
            self.step()
        return [r.generation() for r in requests]

    def generate(self, prompts: list, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop: Seq[str] = (), seed: int | None = None,
                 chat: bool = False, **controls) -> list[Generation]:
        """Run every prompt through the engine together; -> one Generation per prompt, in order.
        It drives `step()` itself: other requests in the engine advance too, their events unseen.
        controls: as add_request's."""
        if isinstance(prompts, str) or any(isinstance(p, int) for p in prompts):
            raise MiniLLMError("Engine.generate takes a list of prompts (texts, token-id lists or message lists)")
        requests = []
        try:
            for prompt in prompts:
                requests.append(self._add(prompt, max_tokens, temperature, top_p, top_k, stop, seed, chat,
                                          **controls))
        except MiniLLMError:
            for request in requests:
                self.abort(request.seq.request_id)
            raise
        while not all(r.seq.finished for r in requests):
            self.step()
        return [r.generation() for r in requests]
