"""A small thread pool for NumPy work that BLAS does not parallelize.

NumPy's matrix products run on every core through BLAS, but its elementwise functions and
reductions (exp, multiply, sum, ...) run on one. They do release the GIL while they loop over a
large array, so plain Python threads, each given its own slice, run them on several cores at once.
`parallel_map` does that; `n_threads` says how many threads it uses. quant.search_grid (seconds
of pure elementwise work) runs on it.

Where it does not pay: between matmuls. After each BLAS call OpenBLAS's idle workers keep
spinning for a while and hold the other cores, so splitting prefill's softmax or SiLU over
threads made them slower on this 2-core VM (measured; see attention.py). And handing work to a
sleeping thread costs ~0.1 ms here, the time of ~70k exps: split only large arrays.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import numpy as np

T = TypeVar("T")
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_in_worker = threading.local()


def n_threads() -> int:
    """How many threads NumPy work may use: $MINILLM_THREADS if set, else the same limit the user
    gave BLAS ($OPENBLAS_NUM_THREADS, $OMP_NUM_THREADS: e.g. the lessons' OPENBLAS_NUM_THREADS=1 for
    single-core timings), else the cores this process may run on."""
    for var in ("MINILLM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    try:
        return len(os.sched_getaffinity(0))     # honours taskset and container CPU sets
    except AttributeError:                      # not on Linux
        return os.cpu_count() or 1


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
