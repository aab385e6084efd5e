"""The live engine view behind the page of `minillm serve`: what the engine holds, pushed a few times a second.

The engine thread calls three hooks (`before_step`, `after_step`, `idle`); while no browser listens
each is one attribute test and returns, so the page costs the engine nothing then. With listeners it
notes, per step, which requests ran and with how many tokens (prefill chunk or decode row), who was
preempted, first-token and inter-token times, and at most every `interval` seconds (and whenever the
engine goes idle) it builds one update and hands the same JSON text to every listener's queue.

An update (SCHEMA_VERSION 1) holds metadata only, never text or token ids, so every user may see every
request: ids, lengths, block ids, timings. Its "stats" are `Engine.stats()` at the moment it was built,
"requests" and "pool" the engine's queues and blocks then; "steps" (and "steps_dropped", past MAX_STEPS), "finished", "events" (preemptions)
and "latency" (TTFT, inter-token gaps) what happened since the update before.

The hooks read the scheduler's queues and the block manager between two steps, on the engine thread
that alone changes them (the server's EngineLoop); nothing here writes to the engine.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque

SCHEMA_VERSION = 1
MAX_STEPS = 512         # steps kept between two updates (a tiny model takes hundreds in 0.25 s); older ones are counted
MAX_FINISHED = 64       # finished requests kept between two updates, newest last
QUEUE_SIZE = 8          # updates a slow listener may fall behind before the oldest are dropped


class LiveView:
    """Collects what the page draws from the engine thread; listeners get it as JSON text on asyncio queues."""

    def __init__(self, engine, interval: float = 0.25):
        self.engine, self.interval = engine, interval
        self.active = False                  # any listener: the hooks' one test (a plain bool, read unlocked)
        self._listeners: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}
        self._lock = threading.Lock()        # listeners come and go on the event loop's thread
        self._start = time.perf_counter()
        self._reset()

    def _reset(self) -> None:
        """Forget what was collected: a view that nobody watched keeps nothing."""
        self._steps: deque = deque(maxlen=MAX_STEPS)
        self._finished: deque = deque(maxlen=MAX_FINISHED)
        self._events: deque = deque(maxlen=MAX_STEPS)
        self._steps_dropped = 0
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._before: list[tuple] = []     # (sequence, its queue, computed tokens) before the step
        self._last: dict = {}                # request id -> sequence, of the last step's queues
        self._fresh = False
        self._seen: dict[int, dict] = {}     # request id -> {"arrival", "first", "last"} (perf_counter s)
        self._last_push = 0.0
        self._dirty = True

    # ---- listeners (the event loop's thread) -----------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        """A queue that receives every update as JSON text from now on."""
        q: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_SIZE)
        with self._lock:
            self._listeners[q] = asyncio.get_running_loop()
            self._fresh = self._fresh or not self.active    # the engine thread resets what it kept, then starts
            self._dirty = True               # the newcomer needs a first picture, even of an idle engine
            self.active = True
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._listeners.pop(q, None)
            self.active = bool(self._listeners)

    # ---- hooks (the engine thread) ------------------------------------------------------------------
    def before_step(self) -> None:
        """Remember where every queued request stands, to tell after the step who ran and how far."""
        if not self.active:
            return
        if self._fresh:
            self._reset()
        s = self.engine.scheduler
        self._before = ([(seq, "running", seq.num_computed) for seq in s.running] +
                        [(seq, "waiting", seq.num_computed) for seq in s.waiting])

    def after_step(self, events) -> None:
        """Record the step that just ran (`events`: its StepEvents); push an update if the last one
        is `interval` old."""
        if not self.active or self._fresh:
            return
        now, s = time.perf_counter(), self.engine.scheduler
        running = {id(seq) for seq in s.running}
        rows = []
        for seq, state, computed in self._before:
            # A newcomer's computed tokens start at its prefix-cache hit, set when it was admitted.
            start = computed if state == "running" else seq.cached_tokens
            ran = seq.num_computed - start
            if ran > 0 and (seq.finished or id(seq) in running):
                kind = "prefill" if start < seq.prompt_len else "decode"
                rows.append({"id": seq.request_id, "tokens": ran, "kind": kind})
                self._note_tokens(seq, now)
            elif state == "running" and not seq.finished and id(seq) not in running:
                self._events.append({"t": self._t(now), "kind": "preempt", "id": seq.request_id})
        known = {seq.request_id: seq for seq, _, _ in self._before} | self._last
        for event in events:                 # finished this step, or aborted since the last one
            if event.finished and event.request_id in known:
                self._note_finished(known[event.request_id], event.finish_reason, now)
        self._last = {seq.request_id: seq for seq, _, _ in self._before if not seq.finished}
        self._before = []
        if len(self._steps) == MAX_STEPS:
            self._steps_dropped += 1
        self._steps.append({"step": self.engine.stats()["steps"], "t": self._t(now), "rows": rows})
        self._dirty = True
        if now - self._last_push >= self.interval:
            self.push()

    def idle(self) -> None:
        """The engine is about to wait for work: show the last state (a finished or aborted request's
        blocks back in the pool) without waiting for another step."""
        if not self.active:
            return
        if self._fresh:
            self._reset()
        if self._dirty:
            self.push()

    def _note_tokens(self, seq, now: float) -> None:
        info = self._seen.setdefault(seq.request_id, {"arrival": self._arrival(seq, now), "first": None, "last": None})
        n_out = len(seq.tokens) - seq.prompt_len
        if n_out <= 0 or seq.num_pending > 1:
            return                                  # still prefilling: no token yet
        if info["first"] is None:
            info["first"] = now
            self._ttft.append(now - info["arrival"])
        elif info["last"] is not None:
            self._itl.append(now - info["last"])
        info["last"] = now

    def _arrival(self, seq, now: float) -> float:
        request = self.engine.requests.get(seq.request_id)
        return request.arrival if request is not None else now

    def _note_finished(self, seq, reason: str | None, now: float) -> None:
        info = self._seen.pop(seq.request_id, None) or {}
        first, arrival = info.get("first"), info.get("arrival")
        self._finished.append({"id": seq.request_id, "reason": reason, "prompt_tokens": seq.prompt_len,
                               "output_tokens": len(seq.tokens) - seq.prompt_len, "t": self._t(now),
                               "ttft_s": None if first is None or arrival is None else first - arrival,
                               "duration_s": None if arrival is None else now - arrival})

    def _t(self, now: float) -> float:
        return round(now - self._start, 4)

    # ---- the update -----------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The update as a dict (SCHEMA_VERSION): the engine now, plus what happened since the last one."""
        now, e = time.perf_counter(), self.engine
        s, blocks = e.scheduler, e.blocks
        requests = [self._request(seq, state, now) for state, queue in (("running", s.running), ("waiting", s.waiting))
                    for seq in queue]
        cache = e.prefix_cache
        update = {
            "version": SCHEMA_VERSION, "t": self._t(now), "stats": e.stats(),
            "requests": requests, "finished": list(self._finished), "steps": list(self._steps),
            "steps_dropped": self._steps_dropped, "events": list(self._events),
            "pool": {"total": blocks.num_blocks, "block_size": e.pool.block_size,
                     "shared": [b for b, n in enumerate(blocks.refcount) if n > 1],
                     "cached": list(cache.unused) if cache is not None else []},
            "latency": {"ttft_s": self._ttft, "itl_s": self._itl},
        }
        live = {r["id"] for r in requests}
        self._seen = {rid: info for rid, info in self._seen.items() if rid in live}
        self._steps.clear()
        self._steps_dropped = 0
        self._finished.clear()
        self._events.clear()
        self._ttft, self._itl = [], []
        return update

    def _request(self, seq, state: str, now: float) -> dict:
        info = self._seen.get(seq.request_id, {})
        arrival = info.get("arrival") or self._arrival(seq, now)
        first = info.get("first")
        return {"id": seq.request_id, "state": state, "prompt_tokens": seq.prompt_len,
                "output_tokens": len(seq.tokens) - seq.prompt_len, "computed": seq.num_computed,
                "cached_tokens": seq.cached_tokens, "blocks": [b for b in seq.block_table if b >= 0],
                "age_s": round(now - arrival, 4), "ttft_s": None if first is None else round(first - arrival, 4)}

    def push(self) -> None:
        """Build one update and hand its JSON to every listener (on each one's event loop)."""
        text = json.dumps(self.snapshot(), separators=(",", ":"))
        self._last_push, self._dirty = time.perf_counter(), False
        with self._lock:
            listeners = list(self._listeners.items())
        for q, loop in listeners:
            try:
                loop.call_soon_threadsafe(_offer, q, text)
            except RuntimeError:             # that loop has closed (shutdown): nobody to tell
                pass


def _offer(q: asyncio.Queue, text: str) -> None:
    """Put an update on a listener's queue; a listener that fell behind loses its oldest update."""
    if q.full():
        q.get_nowait()
    q.put_nowait(text)
