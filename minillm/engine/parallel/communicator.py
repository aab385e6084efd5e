"""The communicator: the four collectives tensor parallelism needs, over whichever library moves the bytes.

    all_reduce(x)        every rank's x summed, the sum on every rank (in place)   [..] -> [..]
    all_gather(x)        every rank's x stacked, on every rank                     [..] -> [size, ..]
    broadcast(x, root)   root's x on every rank (in place)                         [..] -> [..]
    broadcast_object(o)  a small Python value (a seed, a token, a batch) from root
    barrier()            wait until every rank is here

The model only ever calls these on an object it was handed (`Transformer(..., comm=...)`), so it never
knows which backend runs: `SingleProcess` (tp = 1: nothing to do), `LocalGroup` (ranks as threads of one
process: tests and lessons, no launcher), `MPICommunicator` (ranks as processes, mpi4py over MPICH or
Open MPI: the CPU path) and `NCCLCommunicator` (one process per GPU, NCCL through CuPy, bootstrapped over
MPI). Every collective waits at most `timeout_s`: a rank that died must not leave the others hanging
forever, so a late peer raises `CommTimeout` and the launcher takes every rank down.

Each communicator counts its calls, bytes and seconds per collective (`stats`): that is how the
communication share of a decode step is measured (lesson 21).
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from minillm.errors import MiniLLMError
from minillm.engine.parallel.launcher import launched_size, rank_setup
from minillm.resources import install_hint

DEFAULT_TIMEOUT_S = 60.0     # `minillm.load` passes $MINILLM_TP_TIMEOUT instead where it is set (read there, once)


class CommTimeout(MiniLLMError):
    """A collective waited longer than the timeout: another rank died, hangs, or took a different path."""


class Communicator(Protocol):
    rank: int
    size: int

    def all_reduce(self, x): ...
    def all_gather(self, x): ...
    def broadcast(self, x, root: int = 0): ...
    def broadcast_object(self, obj, root: int = 0, timeout_s: float | None = None): ...
    def barrier(self) -> None: ...


@dataclass
class CommStats:
    """Per collective: how many calls, how many bytes each rank sent, how many seconds it spent in them."""
    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, op: str, n_bytes: int, seconds: float) -> None:
        self.calls[op] += 1
        self.bytes[op] += n_bytes
        self.seconds[op] += seconds

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()

    def summary(self) -> str:
        """One line: each collective's calls and mean µs."""
        parts = [f"{op} {self.calls[op]}× {1e6 * self.seconds[op] / self.calls[op]:.1f} µs"
                 for op in sorted(self.calls)]
        return ", ".join(parts) or "no collectives"


class _Timed:
    """The stats bookkeeping every backend shares."""
    rank = 0
    size = 1

    def __init__(self):
        self.stats = CommStats()

    def _time(self, op: str, n_bytes: int, start: float) -> None:
        self.stats.add(op, n_bytes, time.perf_counter() - start)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, samples and schedules."""
        return self.rank == 0


class SingleProcess(_Timed):
    """tp = 1: every collective is the identity."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x[None]

    def broadcast(self, x, root: int = 0):
        return x

    def broadcast_object(self, obj, root: int = 0, timeout_s: float | None = None):
        return obj

    def barrier(self) -> None:
        pass


# ---- ranks as threads of one process (tests, lessons) ------------------------------------------------
class LocalGroup:
    """`size` ranks that are threads of this process, exchanging arrays through shared slots.

    The sum is taken in rank order on every rank, so every rank holds bit-identical results, as an MPI
    all-reduce gives. NumPy releases the GIL inside BLAS, so the ranks' matmuls do run side by side."""

    def __init__(self, size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.size = size
        self.timeout_s = timeout_s
        self._slots: list = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout_s)

    def communicators(self) -> list["LocalCommunicator"]:
        return [LocalCommunicator(self, r) for r in range(self.size)]

    def exchange(self, rank: int, value) -> list:
        """Post `value`, return every rank's; the second wait keeps a fast rank from overwriting a slot
        that a slow one has not read yet."""
        self._slots[rank] = value
        self._wait()
        values = list(self._slots)
        self._wait()
        return values

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CommTimeout(f"a collective waited over {self.timeout_s:g} s: another rank died or hangs") from None

    def abort(self) -> None:
        self._barrier.abort()          # wakes every waiting rank with CommTimeout


class LocalCommunicator(_Timed):
    def __init__(self, group: LocalGroup, rank: int):
        super().__init__()
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, x):
        start = time.perf_counter()
        parts = self.group.exchange(self.rank, np.array(x, copy=True))
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        x[...] = total
        self._time("all_reduce", x.nbytes, start)
        return x

    def all_gather(self, x):
        start = time.perf_counter()
        out = np.stack(self.group.exchange(self.rank, np.array(x, copy=True)))
        self._time("all_gather", x.nbytes, start)
        return out

    def broadcast(self, x, root: int = 0):
        x[...] = self.group.exchange(self.rank, np.array(x, copy=True))[root]
        return x

    def broadcast_object(self, obj, root: int = 0, timeout_s: float | None = None):
        return self.group.exchange(self.rank, obj)[root]

    def barrier(self) -> None:
        self.group.exchange(self.rank, None)


def run_ranks(size: int, fn: Callable[[Communicator], object], timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Run fn(comm) on `size` thread ranks at once; -> each rank's result, in rank order.

    A rank that raises aborts the group (the others stop waiting at once) and the first error is raised."""
    group = LocalGroup(size, timeout_s)
    results, errors = [None] * size, [None] * size

    def work(comm: LocalCommunicator) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as e:                           # noqa: BLE001  (re-raised below)
            errors[comm.rank] = e
            group.abort()

    threads = [threading.Thread(target=work, args=(c,), name=f"rank{c.rank}") for c in group.communicators()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, CommTimeout)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


# ---- ranks as processes: MPI ----------------------------------------------------------------------
class MPICommunicator(_Timed):
    """MPI through mpi4py (MPICH or Open MPI). Each collective is the nonblocking MPI call, polled until
    done or `timeout_s` passed: blocking MPI calls cannot time out, and a dead peer must not hang us."""

    def __init__(self, mpi_comm=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__()
        from mpi4py import MPI              # only a rank started by mpiexec gets here
        self.MPI = MPI
        self.comm = mpi_comm or MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout_s = timeout_s

    def _wait(self, request, op: str, timeout_s: float | None = None) -> None:
        """Poll the request: spin briefly, then yield the core between polls (ranks may share cores), and
        after 10 ms of waiting sleep a millisecond between polls (a rank waiting on a user must not burn one)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        spins = 0
        while not request.Test():
            spins += 1
            if spins > 64:
                waited = time.monotonic() - start
                time.sleep(0.001 if waited > 0.01 else 0)
                if waited > timeout_s:
                    raise CommTimeout(f"rank {self.rank}: {op} waited over {timeout_s:g} s for the other "
                                      f"ranks (one died or hangs)")

    def all_reduce(self, x):
        start = time.perf_counter()
        x = np.ascontiguousarray(x)
        self._wait(self.comm.Iallreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM), "all_reduce")
        self._time("all_reduce", x.nbytes, start)
        return x

    def all_gather(self, x):
        start = time.perf_counter()
        x = np.ascontiguousarray(x)
        out = np.empty((self.size,) + x.shape, dtype=x.dtype)
        self._wait(self.comm.Iallgather(x, out), "all_gather")
        self._time("all_gather", x.nbytes, start)
        return out

    def broadcast(self, x, root: int = 0, timeout_s: float | None = None):
        start = time.perf_counter()
        self._wait(self.comm.Ibcast(x, root=root), "broadcast", timeout_s)
        self._time("broadcast", x.nbytes, start)
        return x

    def broadcast_object(self, obj, root: int = 0, timeout_s: float | None = None):
        """Pickled, then a length and the bytes as two broadcasts. timeout_s: longer than the default where
        root waits on a person (a chat's next line)."""
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == root else None
        n = self.broadcast(np.array([0 if data is None else len(data)], dtype=np.int64), root, timeout_s)
        buf = data.copy() if data is not None else np.empty(int(n[0]), dtype=np.uint8)
        return pickle.loads(self.broadcast(buf, root).tobytes())

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def abort(self, code: int = 1) -> None:
        """End every rank now (mpiexec kills the rest): what a rank does after an error it cannot share."""
        self.comm.Abort(code)


# ---- one process per GPU: NCCL through CuPy ---------------------------------------------------------
class NCCLCommunicator(_Timed):
    """NCCL (cupy.cuda.nccl) on CuPy arrays, one process per GPU. The NCCL id travels over `host` (the
    MPI communicator the launcher made), and so do Python objects; arrays go over NCCL on the current
    stream, which is then polled until done or `timeout_s` (after which the NCCL communicator is aborted).

    `nccl` and `xp` default to cupy.cuda.nccl and cupy; tests pass stand-ins to run this code on a CPU."""

    def __init__(self, host: Communicator, nccl=None, xp=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__()
        if nccl is None or xp is None:
            import cupy
            from cupy.cuda import nccl as cupy_nccl
            nccl, xp = nccl or cupy_nccl, xp or cupy
            cupy.cuda.Device(_local_rank(host.rank) % cupy.cuda.runtime.getDeviceCount()).use()
        self.nccl, self.xp, self.host, self.timeout_s = nccl, xp, host, timeout_s
        self.rank, self.size = host.rank, host.size
        unique_id = host.broadcast_object(nccl.get_unique_id() if host.rank == 0 else None)
        self.comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
                       np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.uint8): nccl.NCCL_UINT8}

    def _type(self, x) -> int:
        try:
            return self._types[np.dtype(x.dtype)]
        except KeyError:
            raise MiniLLMError(f"NCCL collectives here take float32/float16/int32/int64/uint8, not {x.dtype}") from None

    def _sync(self, stream, op: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not stream.done:
            time.sleep(0)
            if time.monotonic() > deadline:
                self.comm.abort()
                raise CommTimeout(f"rank {self.rank}: NCCL {op} waited over {self.timeout_s:g} s for the other "
                                  f"ranks (one died or hangs)")

    def all_reduce(self, x):
        start, stream = time.perf_counter(), self.xp.cuda.get_current_stream()
        x = self.xp.ascontiguousarray(x)
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._type(x), self.nccl.NCCL_SUM, stream.ptr)
        self._sync(stream, "all_reduce")
        self._time("all_reduce", x.nbytes, start)
        return x

    def all_gather(self, x):
        start, stream = time.perf_counter(), self.xp.cuda.get_current_stream()
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._type(x), stream.ptr)
        self._sync(stream, "all_gather")
        self._time("all_gather", x.nbytes, start)
        return out

    def broadcast(self, x, root: int = 0):
        start, stream = time.perf_counter(), self.xp.cuda.get_current_stream()
        x = self.xp.ascontiguousarray(x)
        self.comm.broadcast(x.data.ptr, x.data.ptr, x.size, self._type(x), root, stream.ptr)
        self._sync(stream, "broadcast")
        self._time("broadcast", x.nbytes, start)
        return x

    def broadcast_object(self, obj, root: int = 0, timeout_s: float | None = None):
        return self.host.broadcast_object(obj, root, timeout_s)

    def barrier(self) -> None:
        self.all_reduce(self.xp.zeros(1, dtype=np.float32))


# ---- which one this process gets ----------------------------------------------------------------
def _local_rank(rank: int) -> int:
    value = os.environ.get("MPI_LOCALRANKID") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
    return int(value) if value and value.isdigit() else rank


def from_environment(tp: int, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """The communicator for `tp` ranks: SingleProcess for 1; else MPI (CPU) or NCCL over MPI (cuda).
    The process must be one of exactly `tp` ranks that mpiexec started (`launcher.relaunch` does that)."""
    if tp == 1:
        return SingleProcess()
    size = launched_size()
    if size != tp:
        where = f"this process is one of {size} MPI ranks" if size > 1 else "this process was not started by mpiexec"
        raise MiniLLMError(f"tp={tp} needs {tp} ranks started by mpiexec; {where} "
                           f"(run `mpiexec -n {tp} minillm ...`, or let `minillm ... --tp {tp}` start them)")
    try:
        host = MPICommunicator(timeout_s=timeout_s)
    except ImportError:
        raise MiniLLMError(f"tensor parallelism needs mpi4py and an MPI: {install_hint('tp')}") from None
    rank_setup(host)
    return NCCLCommunicator(host, timeout_s=timeout_s) if device == "cuda" else host


def parallel_communicator(tp: int = 1, comm: Communicator | None = None, device: str = "cpu",
                          timeout_s: float = DEFAULT_TIMEOUT_S) -> Communicator:
    """What `minillm.load(tp=, comm=)` runs with: `comm` if given, else the one this process's launch
    provides (SingleProcess for tp = 1). Refuses, in one line, what tensor parallelism cannot do here."""
    if comm is not None:
        if tp not in (1, comm.size):
            raise MiniLLMError(f"tp={tp} but the communicator given has {comm.size} ranks")
        return comm
    if tp < 1:
        raise MiniLLMError(f"tp must be >= 1, got {tp}")
    return from_environment(tp, device, timeout_s)


def shared_seed(comm: Communicator, seed: int | None) -> int | None:
    """One sampling seed for every rank (rank 0's; drawn there when none is given): ranks that sample
    differently would feed the model different tokens and drift apart."""
    if comm.size == 1:
        return seed
    if seed is None and comm.rank == 0:
        seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return comm.broadcast_object(seed)
