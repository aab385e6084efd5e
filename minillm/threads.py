"""Threads: how many BLAS threads each phase runs on (chosen by measuring), and a small pool for the
NumPy work that BLAS does not parallelize.

BLAS threads. OpenBLAS runs a matmul on one worker per core and, after each call, lets the workers
spin for a while waiting for the next one. On an idle machine that is free. Next to a busy process
it is not: on a 2-core machine with a neighbour on one core, decode on two threads ran an order of
magnitude slower than on one (lessons/BENCHMARKS.md, "BLAS threads on a busy machine"), because each small
decode matmul waits for a worker the OS has not scheduled. Which count is faster depends on the
machine and on what else runs, so `choose` measures it: a decode step (1 row) and a prefill
(PREFILL_ROWS rows) through the model's first layers, a few interleaved rounds at each count, a
fraction of a second at `minillm.load` (llm.thread_policy). The result is a ThreadPolicy(decode, prefill); `install` makes it the process's,
and the generation loop, the batching engine and the benchmark call `for_rows(rows)` before each
forward pass; `pinned(n)` holds one count for both phases a while (bench compares minillm with HF at
equal counts). The count is set through threadpoolctl in the BLAS library NumPy already loaded
($OPENBLAS_NUM_THREADS is read only once, when NumPy is imported).

Whether the count changes a result depends on the BLAS's kernels. OpenBLAS's SkylakeX kernels (issue
16's machine) round a matmul the same at 1 and 2 threads, so greedy tokens, seeded samples and int4
calibration were bit for bit the same; its Haswell kernels, as OpenBLAS 0.3.31 picks them on an AMD EPYC
VM, round a 67-row prefill matmul otherwise in the last bits (~1e-6 relative), so there the logits agree
within fp32 rounding and a near-tie can pick another token. tests/test_threads.py probes the BLAS and
holds whichever of the two applies.

The pool. NumPy's elementwise functions and reductions (exp, multiply, sum, ...) run on one core, but
release the GIL while they loop over a large array, so plain Python threads, each given its own
slice, run them on several cores at once. `parallel_map` does that; `n_threads` says how many
threads it uses. quant.search_grid (seconds of pure elementwise work) runs on it. Where it does not
pay: between matmuls, where OpenBLAS's spinning workers hold the other cores (splitting prefill's
softmax or SiLU made them slower on a 2-core VM; see attention.py). And handing work to a sleeping
thread costs ~0.1 ms, the time of ~70k exps: split only large arrays.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import numpy as np

from minillm.errors import InvalidValue

T = TypeVar("T")
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_in_worker = threading.local()

# ---- BLAS threads ------------------------------------------------------------------------------------
PREFILL_ROWS = 32       # the prefill shape measured; a forward pass of more rows than DECODE_ROWS is "prefill"
DECODE_ROWS = 8         # up to this many rows (a batch of decodes) a matmul still streams the weights once
USER_LIMIT_VARS = ("MINILLM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
_state = {"policy": None, "user_threads": None, "blas": None, "count": None}


@dataclass(frozen=True)
class ThreadPolicy:
    """How many BLAS threads decode and prefill run on, and why (what was measured, or who said so)."""
    decode: int
    prefill: int
    reason: str = ""

    def count(self, rows: int) -> int:
        """The thread count for a forward pass over `rows` rows."""
        return self.decode if rows <= DECODE_ROWS else self.prefill

    def __str__(self) -> str:
        plural = lambda n: f"{n} thread{'s' if n != 1 else ''}"
        return f"BLAS threads: decode {plural(self.decode)}, prefill {plural(self.prefill)} ({self.reason})"


def cores() -> int:
    """The cores this process may run on (honours taskset and container CPU sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # not on Linux
        return os.cpu_count() or 1


def user_limit() -> tuple[int, str] | None:
    """The thread count the user fixed: --threads (`choose(threads=N)`), else $MINILLM_THREADS,
    $OPENBLAS_NUM_THREADS or $OMP_NUM_THREADS (e.g. the lessons' OPENBLAS_NUM_THREADS=1); None if none."""
    if _state["user_threads"] is not None:
        return _state["user_threads"], f"--threads {_state['user_threads']}"
    for var in USER_LIMIT_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"${var}={value}"
    return None


def fix(threads: int) -> None:
    """Use `threads` threads from now on, unmeasured (--threads N): BLAS, and the pool below. At most
    cores(): more is refused."""
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise InvalidValue(f"threads must be an integer >= 1, got {threads}")
    if threads > cores():   # threads past the cores wait on each other: decode ran 100-1000x slower (issue 40)
        raise InvalidValue(f"{threads} threads is more than the {cores()} cores this process may use")
    _state["user_threads"] = int(threads)
    set_blas_threads(int(threads))


def set_blas_threads(n: int) -> None:
    """Run BLAS calls on `n` threads from now on (a no-op when it already does)."""
    if n != _state["count"]:
        for lib in _blas().lib_controllers:
            lib.set_num_threads(n)
        _state["count"] = n


def blas_threads() -> int:
    """The thread count BLAS runs on now."""
    return max([lib.get_num_threads() or 1 for lib in _blas().lib_controllers] or [1])


def _blas():
    if _state["blas"] is None:
        from threadpoolctl import ThreadpoolController
        _state["blas"] = ThreadpoolController().select(user_api="blas")
    return _state["blas"]


def install(policy: ThreadPolicy | None) -> None:
    """Make `policy` the process's (None: leave BLAS as it is); BLAS runs at its decode count meanwhile."""
    _state["policy"] = policy
    if policy is not None:
        set_blas_threads(policy.decode)


def policy() -> ThreadPolicy | None:
    """The installed policy (None before any `minillm.load` or `install`)."""
    return _state["policy"]


@contextmanager
def pinned(n: int):
    """Every forward pass on `n` BLAS threads, decode and prefill alike, until the block ends (bench
    compares minillm and its peer at equal counts); then the policy and the count as they were."""
    saved_policy, saved_count = _state["policy"], blas_threads() if _state["count"] is None else _state["count"]
    install(ThreadPolicy(n, n, f"pinned to {n}"))
    try:
        yield
    finally:
        _state["policy"] = saved_policy
        set_blas_threads(saved_count)


def for_rows(rows: int) -> None:
    """Before a forward pass over `rows` rows: the installed policy's count for it (nothing without one)."""
    current = _state["policy"]
    if current is not None:
        set_blas_threads(current.count(rows))


def choose(step: Callable[[int], object] | None, threads: int | None = None, budget_s: float = 0.3) -> ThreadPolicy:
    """The thread policy: `threads` if given (--threads; also the pool's count), else the user's
    environment limit, else 1 on one core, else measured by timing `step(rows)` (a forward pass over
    `rows` rows) at 1 row and PREFILL_ROWS rows, at each count of `candidates()`, for ~budget_s."""
    if threads is not None:
        fix(threads)
    fixed = user_limit()
    if fixed is not None:
        return ThreadPolicy(fixed[0], fixed[0], fixed[1])
    counts = candidates()
    if len(counts) == 1 or step is None:
        return ThreadPolicy(counts[-1], counts[-1], "one core" if counts == [1] else "not measured")
    decode = _timed(lambda: step(1), counts, budget_s / 2)
    prefill = _timed(lambda: step(PREFILL_ROWS), counts, budget_s / 2)
    return ThreadPolicy(_fastest(decode), _fastest(prefill), "measured: decode " + _times(decode) +
                        ", prefill " + _times(prefill))


def candidates() -> list[int]:
    """The counts worth trying: 1, half the cores, all of them."""
    n = cores()
    return sorted({1, max(1, n // 2), n})


def _timed(fn: Callable[[], object], counts: list[int], budget_s: float, min_rounds: int = 2,
           max_rounds: int = 7) -> dict[int, float]:
    """The median seconds of fn() at each count, over rounds (max_rounds, or fewer once budget_s is
    spent) that visit every count in turn, so a change of load hits all counts alike. A count
    more than 3x slower than the best after a round is not timed again: it has lost, and on a busy
    machine each of its calls can cost many times the budget."""
    before = blas_threads() if _state["count"] is None else _state["count"]
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        start, racing = time.perf_counter(), list(counts)
        for round_ in range(max_rounds):
            for n in (racing if round_ % 2 == 0 else racing[::-1]):
                set_blas_threads(n)
                t = time.perf_counter()
                fn()
                times[n].append(time.perf_counter() - t)
            best = min(statistics.median(times[n]) for n in racing)
            racing = [n for n in racing if statistics.median(times[n]) <= 3 * best]
            if round_ + 1 >= min_rounds and time.perf_counter() - start > budget_s:
                break
    finally:
        set_blas_threads(before)
    return {n: statistics.median(ts) for n, ts in times.items()}


def _fastest(medians: dict[int, float], margin: float = 0.9) -> int:
    """The fewest threads within `margin` of the best time: more threads must earn their place, since
    they are what a neighbour pays for."""
    best = min(medians.values())
    return min(n for n, t in medians.items() if t * margin <= best)


def _times(medians: dict[int, float]) -> str:
    return " vs ".join(f"{n}t {t * 1e3:.2f} ms" for n, t in sorted(medians.items()))


# ---- the pool for NumPy work BLAS does not parallelize -----------------------------------------------
def n_threads() -> int:
    """How many threads NumPy work may use: the count the user fixed (--threads, $MINILLM_THREADS,
    $OPENBLAS_NUM_THREADS, $OMP_NUM_THREADS), else the cores this process may run on."""
    fixed = user_limit()
    return fixed[0] if fixed is not None else cores()


def parallel_map(fn: Callable[..., T], *iterables: Iterable) -> list[T]:
    """[fn(*args) for args in zip(*iterables)], spread over n_threads() threads, the caller's included.

    Items go out in order to whichever thread is free, so put the largest first. A nested call
    (fn itself calling parallel_map) runs in place: a thread waiting on work queued behind itself
    would wait forever."""
    items = list(zip(*iterables))
    helpers = min(n_threads(), len(items)) - 1
    if helpers <= 0 or getattr(_in_worker, "active", False):
        return [fn(*args) for args in items]
    results: list = [None] * len(items)
    next_item = iter(range(len(items)))
    take = threading.Lock()

    def work() -> None:
        while True:
            with take:
                i = next(next_item, None)
            if i is None:
                return
            results[i] = fn(*items[i])

    errors = np.geterr()                        # np.errstate is per thread: helpers take the caller's

    def flagged_work() -> None:                 # nested parallel_map calls in here run in place
        _in_worker.active = True
        try:
            with np.errstate(**errors):
                work()
        finally:
            _in_worker.active = False

    futures = [_pool(helpers).submit(flagged_work) for _ in range(helpers)]
    try:
        flagged_work()
    finally:
        for f in futures:                       # a helper not started yet has nothing left to take
            if not f.cancel():
                f.exception()                   # wait for the others, even if this thread failed
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    return results


def _pool(size: int) -> ThreadPoolExecutor:
    """One long-lived pool per size: starting a thread costs more than waking one."""
    with _pools_lock:
        if size not in _pools:
            _pools[size] = ThreadPoolExecutor(size, thread_name_prefix="minillm")
        return _pools[size]
