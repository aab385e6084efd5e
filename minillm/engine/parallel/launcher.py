"""Starting N ranks, and making each one end cleanly.

`minillm generate --tp 2 ...` runs in one process that is no rank: `relaunch` starts the same command
line as 2 ranks under `mpiexec -n 2` (one BLAS thread a rank unless the environment says otherwise),
streams rank 0's output, and returns their exit code. `mpiexec -n 2 minillm generate --tp 2 ...`
skips that step: each process already is a rank.

The ranks never outlive the launcher. Ctrl-C or SIGTERM to it goes on to every rank through mpiexec, and
mpiexec is killed if they have not ended within STOP_GRACE_S. A launcher killed outright (SIGKILL) can
pass nothing on, so each rank it started watches it (its pid comes in LAUNCHER_VAR; the ranks' parent is
hydra's proxy, not the launcher) and exits as soon as it is gone: an orphaned `serve` rank would go on
answering requests.

In a rank, `rank_setup` (called once its MPI communicator exists) silences the other ranks' output
when our launcher started them (rank 0 prints for all), and turns any uncaught exception into an MPI
abort. `exit_rank` is what the CLI calls on an error: it aborts the whole job, because a rank that
simply exited would leave the others waiting in their next collective (until its timeout).
A rank killed outright is seen by mpiexec itself, which stops the rest.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from minillm.errors import MiniLLMError
from minillm.resources import install_hint

QUIET_VAR = "MINILLM_TP_QUIET"        # set by relaunch: ranks other than 0 print nothing but errors
ERRORS_VAR = "MINILLM_TP_ERRORS"      # set by relaunch: a file each rank appends its error line to before aborting
LAUNCHER_VAR = "MINILLM_TP_LAUNCHER"  # set by relaunch: its pid; a rank exits once that process has ended
STOP_GRACE_S = 3                      # after Ctrl-C or SIGTERM, how long the ranks get to end before mpiexec is killed
ERROR_PREFIX = "minillm: error:"
_active = None                        # this process's MPI communicator, once it is a rank


# ---- the parent: one command line, N ranks ---------------------------------------------------------
def find_mpiexec() -> str:
    """The MPI launcher: the one next to this Python first (the `mpich` wheel installs it there, beside the
    MPI library mpi4py loads), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise MiniLLMError(f"tp > 1 needs mpiexec and mpi4py: {install_hint('tp')} (mpi4py and the mpich wheel)")
    return found


# What MPICH's hydra and Open MPI's mpiexec set in each rank's environment (read before MPI starts).
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


def _env_int(names: Sequence[str], default: int) -> int:
    for var in names:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default


def launched_size() -> int:
    """How many ranks the MPI launcher started this process among (1 when not started by one)."""
    return _env_int(_SIZE_VARS, 1)


def launched_rank() -> int:
    """This process's rank as the launcher numbered it (0 when not started by one)."""
    return _env_int(_RANK_VARS, 0)


def relaunch(tp: int, argv: Sequence[str] | None = None, threads_per_rank: int = 1) -> int | None:
    """Run this command line as `tp` MPI ranks and return their exit code; None when there is nothing
    to launch (tp = 1, or this process already is one of the ranks)."""
    size = launched_size()
    if tp > 1 and size == tp and os.environ.get(LAUNCHER_VAR, "").isdigit():
        _exit_with_launcher(int(os.environ[LAUNCHER_VAR]))    # a rank we started: watched from its first moment
    if tp <= 1 or size == tp:
        return None
    if size > 1:
        raise MiniLLMError(f"--tp {tp} but mpiexec started {size} ranks: give them the same number")
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    env[QUIET_VAR] = "1"
    env[LAUNCHER_VAR] = str(os.getpid())
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(threads_per_rank))          # ranks share the cores: one BLAS thread each
    cmd = [find_mpiexec(), "-n", str(tp), sys.executable, "-m", "minillm", *argv]
    with tempfile.TemporaryDirectory(prefix="minillm-tp-") as tmp:
        env[ERRORS_VAR] = errors = os.path.join(tmp, "errors")
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
        on_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            seen_error = _forward_stderr(proc)
            code = proc.wait()
        except KeyboardInterrupt:                           # Ctrl-C: every rank gets it from mpiexec
            _stop(proc, signal.SIGINT)
            raise
        except _Terminated:                                 # a service manager or `kill`: the same, quietly
            return _stop(proc, signal.SIGTERM)
        finally:
            signal.signal(signal.SIGTERM, on_sigterm)
        if code != 0 and not seen_error:    # the abort outran mpiexec's forwarding of the ranks' stderr
            seen_error = _show_reported_errors(errors)
    if code != 0 and not seen_error:
        raise MiniLLMError(f"a rank ended with exit code {code}; mpiexec stopped the others")
    return code


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)      # a second SIGTERM ends the launcher at once; the ranks follow
    raise _Terminated


def _stop(mpiexec: subprocess.Popen, signum: int) -> int:
    """Pass `signum` on to the ranks (mpiexec forwards it to each) and wait for them; past STOP_GRACE_S kill
    mpiexec (its proxies then kill the ranks). -> mpiexec's exit code (128 + the signal that ended it)."""
    mpiexec.send_signal(signum)
    try:
        code = mpiexec.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        mpiexec.kill()
        code = mpiexec.wait()
    return code if code >= 0 else 128 - code


def _show_reported_errors(path: str) -> bool:
    """The error lines ranks appended to `path` (exit_rank), each once, to stderr; -> whether there was one."""
    try:
        with open(path) as f:
            lines = list(dict.fromkeys(line for line in f if line.startswith(ERROR_PREFIX)))
    except FileNotFoundError:
        return False
    sys.stderr.writelines(lines)
    sys.stderr.flush()
    return bool(lines)


def _forward_stderr(proc: subprocess.Popen) -> bool:
    """Copy the ranks' stderr through, each error line once (every rank may report the same one) and
    without MPICH's abort banners; -> whether an error line was seen."""
    shown = set()
    for line in proc.stderr:
        if line.startswith(ERROR_PREFIX):
            if line in shown:
                continue
            shown.add(line)
        elif _mpi_noise(line):
            continue
        sys.stderr.write(line)
        sys.stderr.flush()
    return bool(shown)


def _mpi_noise(line: str) -> bool:
    """What MPICH prints when a rank aborts or dies, or when Ctrl-C reaches mpiexec ("[mpiexec@host] Sending
    Ctrl-C to processes as requested"): the error line before it already said why."""
    text = line.strip()
    return (text.startswith(("Abort(", "=", "BAD TERMINATION", "PID ", "EXIT CODE", "CLEANING UP", "YOU CAN IGNORE",
                             "[mpiexec@", "[proxy:",
                             "YOUR APPLICATION TERMINATED", "This typically refers", "Please see the FAQ",
                             "MPICH: ", "[unset]:", "application called MPI_Abort"))
            or "application called MPI_Abort" in text)


# ---- inside a rank ------------------------------------------------------------------------------------
def _exit_with_launcher(pid: int) -> None:
    """End this process as soon as process `pid` (the launcher) has ended, from a watching thread."""
    def watch():
        _wait_for_exit(pid)
        os._exit(1)                     # nobody is left to read our output, nor to stop us otherwise

    threading.Thread(target=watch, name="minillm-launcher-watch", daemon=True).start()


def _wait_for_exit(pid: int) -> None:
    """Return once process `pid` has ended. On Linux a pidfd turns readable at its exit (so no polling, and a
    launcher left a zombie by its own parent counts as ended); elsewhere, check once a second."""
    try:
        select.select([os.pidfd_open(pid)], [], [])
        return
    except ProcessLookupError:          # ended already
        return
    except (AttributeError, OSError):   # no pidfd_open here (not Linux, or a kernel before 5.3)
        pass
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(1)


def rank_setup(comm) -> None:
    """Called once a process's MPI communicator exists: remember it (for exit_rank), abort every rank on
    an uncaught exception, and leave printing to rank 0 when our launcher started the ranks."""
    global _active
    _active = comm
    previous = sys.excepthook

    def abort_all(kind, value, tb):
        previous(kind, value, tb)
        exit_rank(1)

    sys.excepthook = abort_all
    if os.environ.get(QUIET_VAR) and comm.rank != 0:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorsOnly(sys.__stderr__)


def exit_rank(code: int, message: str | None = None) -> None:
    """On an error in a rank of several: end every rank now with `code` (an MPI abort). No-op elsewhere.
    message: the error line the rank printed, also appended to relaunch's errors file: the abort can end
    mpiexec before it has forwarded the rank's stderr, and the launcher then reads the line from there."""
    if _active is None or _active.size == 1 or code == 0:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if message is not None and os.environ.get(ERRORS_VAR):
        with open(os.environ[ERRORS_VAR], "a") as f:      # one short append a rank: whole lines, any order
            f.write(message.rstrip("\n") + "\n")
    _active.abort(code)


def read_turn(prompt: str, model=None, read: Callable[[str], str | None] = input) -> str | None:
    """The user's next message (`read(prompt)`), None at an empty line, EOF or Ctrl-C. With tensor parallelism
    rank 0 reads it (mpiexec gives stdin to rank 0 only) and every rank gets it, waiting as long as the user takes."""
    comm = getattr(model, "comm", None)
    line = None
    if comm is None or comm.rank == 0:
        try:
            line = read(prompt)
        except (EOFError, KeyboardInterrupt):
            line = None
        line = line if line and line.strip() else None
    return line if comm is None else comm.broadcast_object(line, timeout_s=float("inf"))


def is_main_rank() -> bool:
    """Rank 0 (or no ranks at all): the process that prints."""
    return _active is None or _active.rank == 0


class _ErrorsOnly:
    """A stderr that lets through only our one-line errors (a follower rank's timings would repeat rank 0's)."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.startswith(ERROR_PREFIX):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def memory_line(model) -> str:
    """'[tp 2 · weights per rank 35.2, 35.2 MB · 70.4 MB in all]': what each rank holds, measured (every
    rank must call this: the sizes travel in one all-gather)."""
    import numpy as np
    from minillm.backend import to_host
    from minillm.engine.parallel.sharding import model_bytes
    comm = model.comm
    mine = np.array([model_bytes(model)], dtype=np.int64)
    sizes = [int(n) for n in to_host(comm.all_gather(mine)).ravel()] if comm is not None else [int(mine[0])]
    each = ", ".join(f"{n / 1e6:.1f}" for n in sizes)
    return f"[tp {len(sizes)} · weights per rank {each} MB · {sum(sizes) / 1e6:.1f} MB in all]"
