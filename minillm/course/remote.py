"""The grader's side of a student's process: start it (sandbox.py, confined by confine.py), call the
student's function through it one case at a time, and stop it.

`Submission` is a callable: a check calls it like the student's function, with the grader's arrays, and
gets the answer back as data (arrays changed in place are copied back into the grader's arrays, a view
of an argument comes back as a view). Whatever goes wrong in the student's process (a time limit, a
crash, a malformed answer) reaches the check as SubmissionStopped, which it cannot catch by mistake."""
from __future__ import annotations

import builtins
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from minillm.course import sandbox
from minillm.course.cases import CaseFailed, SubmissionStopped
from minillm.errors import MiniLLMError

SANDBOX = Path(sandbox.__file__)
STARTUP_S = 20.0                 # a child's Python + NumPy + confinement on a busy machine
MAX_RESTARTS = 2                 # new processes after crashes, per exercise
# The child's whole environment: nothing of the teacher's (no MINILLM_*, no PYTHONPATH); -I ignores PYTHON*.
CHILD_ENV = {"PATH": os.defpath, "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1"}
UNSAFE_HINT = "give --unsafe to grade without isolation (the report then says so)"


class Unisolated(MiniLLMError):
    """The student's process could not be confined here, and --unsafe was not given."""


class StudentException(Exception):
    """An exception the student's code raised that is not a Python builtin: carries its name."""


class Submission:
    """A student's exercise file in a confined process of its own, called like the function it defines.
    `time_s` is the budget of all its calls together (one exercise)."""

    def __init__(self, path: Path, function: str, time_s: float = 30.0, memory_mb: int = 4096,
                 max_answer_mb: int = 256, unsafe: bool = False):
        self.path, self.function, self.unsafe = Path(path), function, unsafe
        self.time_left, self.memory_mb, self.max_answer = time_s, memory_mb, max_answer_mb << 20
        self.time_s = time_s
        self.__qualname__ = self.path.name
        self.mechanism, self.load_error, self.restarts, self.calls = "", None, 0, 0
        self._proc: subprocess.Popen | None = None
        self._scratch = Path(tempfile.mkdtemp(prefix="minillm-student-"))
        self._log = tempfile.TemporaryFile()
        self._stopped = ""                        # why calls no longer run (the time budget is spent)

    # ---- the process ------------------------------------------------------------------------------------------

    def start(self) -> "Submission":
        """Copy the file into a fresh scratch folder, start the process, load the file there. Raises
        Unisolated where the process cannot be confined (unless unsafe)."""
        shutil.copyfile(self.path, self._scratch / self.path.name, follow_symlinks=False)
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(SANDBOX)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, cwd=self._scratch, env=CHILD_ENV, close_fds=True, start_new_session=True)
        setup = {"numpy_path": str(Path(np.__file__).resolve().parents[1]), "scratch": str(self._scratch),
                 "file": self.path.name, "function": self.function, "memory_bytes": self.memory_mb << 20,
                 "cpu_seconds": int(self.time_s + STARTUP_S + 5), "max_answer_bytes": self.max_answer,
                 "unsafe": self.unsafe}
        body = json.dumps(setup).encode()
        # The first frame comes before the student's code runs (it cannot be forged); the second after.
        hello, _ = self._exchange(struct.pack("<I", len(body)) + body, STARTUP_S, "starting")
        if "unconfined" in hello:
            self.close()
            raise Unisolated(f"cannot isolate the students' code here: {hello['unconfined']}; {UNSAFE_HINT}")
        self.mechanism = str(hello.get("mechanism", ""))
        try:
            loaded, _ = self._exchange(b"", STARTUP_S, "loading")
            if set(loaded) != {"load_error"}:
                raise SubmissionStopped("its file wrote something that is not an answer while it loaded")
            self.load_error = None if loaded["load_error"] is None else str(loaded["load_error"])[:300]
        except SubmissionStopped as e:
            self.load_error = str(e)
        return self

    def close(self) -> None:
        self._kill()
        shutil.rmtree(self._scratch, ignore_errors=True)
        self._log.close()

    def __enter__(self) -> "Submission":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)      # its group: all it could have started
            except ProcessLookupError:
                pass
        if self._proc is not None:
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()

    def _restart(self, why: str) -> None:
        self._kill()
        if self.restarts >= MAX_RESTARTS:
            self._stopped = f"not run: the student's process was stopped {self.restarts + 1} times ({why})"
            return
        self.restarts += 1
        self.start()

    # ---- a call ------------------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not self._stopped and (self._proc is None or self._proc.poll() is not None):
            self._restart("it died")
        if self._stopped:
            raise SubmissionStopped(self._stopped)
        if self.time_left <= 0:
            self._stop_over_time()
        self.calls += 1
        arrays: list = []                     # the grader's own argument arrays, in the order sent
        request = {"call": self.calls, "args": sandbox.encode(args, arrays), "kwargs": sandbox.encode(kwargs, arrays)}
        started = time.monotonic()
        try:
            answer, out = self._exchange(sandbox.frame_bytes(request, arrays), self.time_left, "answering")
        finally:
            self.time_left -= time.monotonic() - started
        try:
            outcome = self._outcome(answer, out, arrays)
        except (sandbox.BadFrame, ValueError, TypeError, KeyError) as e:
            self._restart(str(e))
            raise SubmissionStopped(f"answered with something that is not an answer: {e}") from None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _outcome(self, answer: dict, out: list, arrays: list):
        """The student's return value (or the exception it raised), from a frame checked field by field;
        arrays it changed in place are copied into the grader's `arrays`."""
        if answer.get("call") != self.calls:
            raise sandbox.BadFrame(f"an answer to call {answer.get('call')!r}, not to call {self.calls}")
        if "raised" in answer:
            name, message, where = answer["raised"]
            return _exception(name, message, where)
        if "unsendable" in answer:
            return CaseFailed(str(answer["unsendable"])[:300])
        for j, tree in dict(answer.get("changed", {})).items():
            new, j = sandbox.decode(tree, out), int(j)
            if 0 <= j < len(arrays) and isinstance(new, np.ndarray) and new.shape == arrays[j].shape \
                    and arrays[j].ndim and np.can_cast(new.dtype, arrays[j].dtype, "same_kind"):
                np.copyto(arrays[j], new, casting="unsafe")
        return sandbox.decode(answer.get("value"), out, args=arrays)

    def _stop_over_time(self) -> None:
        self._kill()
        self._stopped = f"stopped: over the time limit of {self.time_s:g} s for this exercise"
        raise SubmissionStopped(self._stopped)

    def _exchange(self, request: bytes, seconds: float, doing: str) -> tuple[dict, list]:
        """Send `request`, read one frame back within `seconds`. -> its header and its arrays"""
        deadline = time.monotonic() + seconds
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.flush()
        except OSError:
            pass                                        # it died: reading says how
        fd = self._proc.stdout.fileno()

        def read(n: int) -> bytes:
            chunks, left = [], n
            while left:
                wait = deadline - time.monotonic()
                if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                    if doing == "answering":
                        self._stop_over_time()
                    self._kill()
                    raise SubmissionStopped({"starting": "the student's process did not start",
                                             "loading": "loading the student's file did not end"}[doing]
                                            + f" within {seconds:g} s")
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    raise EOFError
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        try:
            return sandbox.parse_frame(read, self.max_answer)
        except EOFError:
            why = self._death()
            if doing == "answering":
                self._restart(why)
            raise SubmissionStopped(why) from None
        except (sandbox.BadFrame, struct.error) as e:
            if doing == "answering":
                self._restart(str(e))
            else:
                self._kill()
            raise SubmissionStopped(f"answered with something that is not an answer: {e}") from None

    def _death(self) -> str:
        code = self._proc.wait()
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 2000))
        tail = self._log.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"the student's process died ({_exit_reason(code)}){': ' + tail[0][:200] if tail[0] else ''}"


def _exit_reason(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        why = {"SIGXCPU": "over the CPU-time limit", "SIGKILL": "killed"}.get(name, "crashed")
        return f"{name}: {why}"
    return f"exit code {code}"


def _exception(name, message, where) -> Exception:
    """The student's exception, rebuilt in the grader: a builtin by its class (a check may expect a
    ValueError), any other as StudentException under the student's name."""
    name, text = str(name)[:60], f"{str(message)[:300]}{str(where)[:80]}"
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except TypeError:
            pass
    return type(name if name.isidentifier() else "StudentException", (StudentException,), {})(text)


def probe(unsafe: bool = False) -> str:
    """How a student's process is isolated on this machine, in words; raises Unisolated where it cannot be."""
    if os.name == "nt":                 # no select() on pipes, no process groups: not even --unsafe works
        raise Unisolated("grading runs students' code on Linux (confined) or macOS (--unsafe); on Windows, "
                         "run it in WSL 2, which is Linux")
    with tempfile.TemporaryDirectory() as folder:
        empty = Path(folder) / "ex00_probe.py"
        empty.write_text("def probe():\n    return 0\n")
        try:
            with Submission(empty, "probe", time_s=10, unsafe=unsafe) as sub:
                return sub.mechanism
        except SubmissionStopped as e:
            raise Unisolated(f"cannot start a student's process here: {e}") from None
