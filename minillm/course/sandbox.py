"""The child process `minillm exercise grade` (grading.py) runs for one student: it shuts itself off from the
network (where the OS allows), sets its own memory and CPU limits, then grades the student's files
one exercise at a time and writes each verdict as one JSON line to the file descriptor it was given.

It runs as a script (python sandbox.py ...), never as `-m minillm.course.sandbox`: importing the
package first would import NumPy, whose BLAS threads make the process multi-threaded, and a
multi-threaded process cannot enter a new user namespace. So the limits come before any import.

    python sandbox.py RESULT_FD MEMORY_BYTES CPU_SECONDS TIME_LIMIT NN=path [NN=path ...]
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def isolate_network() -> str:
    """Enter a new user + network namespace (only a loopback that is down): 'isolated' or why not."""
    if not sys.platform.startswith("linux"):
        return f"not isolated ({sys.platform} has no network namespaces)"
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return f"not isolated (unshare: {os.strerror(ctypes.get_errno())})"
    try:            # keep our own uid inside, so files keep their owner (else everything is 'nobody')
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        pass        # the namespace holds anyway; only the mapping of ids is missing
    return "isolated (a network namespace of its own)"


def set_limits(memory_bytes: int, cpu_seconds: int) -> None:
    """Address space and CPU time; the parent's wall-clock watchdog is the limit that always works."""
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_seconds)):
        if value > 0:
            _, hard = resource.getrlimit(limit)
            try:
                resource.setrlimit(limit, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))
            except (ValueError, OSError):
                pass          # macOS refuses some limits; the parent's watchdog still holds the time


class TimeLimit(BaseException):
    """Raised in the student's code by the alarm; a BaseException, so `except Exception` cannot eat it."""


def main(argv: list) -> None:
    fd, memory, cpu, time_limit = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    network = isolate_network()
    set_limits(memory, cpu)
    out = os.fdopen(fd, "w", buffering=1)
    out.write(json.dumps({"network": network}) + "\n")
    sys.path[0] = os.environ.get("MINILLM_SANDBOX_ROOT", "")   # the parent's minillm, not this folder's files
    from minillm.course.grader import check_exercise

    def on_alarm(signum, frame):
        raise TimeLimit()
    signal.signal(signal.SIGALRM, on_alarm)
    for item in argv[4:]:
        number, path = item.split("=", 1)
        out.write(json.dumps({"start": int(number)}) + "\n")
        signal.setitimer(signal.ITIMER_REAL, time_limit)
        try:
            report = check_exercise(int(number), path)
            verdict = {"cases": [[c.name, c.passed, c.detail] for c in report.cases], "note": report.note}
        except TimeLimit:
            verdict = {"cases": [], "note": f"stopped: over the time limit of {time_limit:g} s"}
        except BaseException as e:  # noqa: BLE001 - a file that does not even import is this student's failure
            verdict = {"cases": [], "note": _describe(e, path)}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps({"done": int(number), **verdict}) + "\n")


def _describe(e: BaseException, path: str) -> str:
    if isinstance(e, SyntaxError):
        return f"does not compile: {e.msg} ({os.path.basename(path)}, line {e.lineno})"
    if isinstance(e, MemoryError):
        return "ran out of memory (over the memory limit)"
    where = ""
    tb = e.__traceback__
    while tb is not None:                      # the student's last line in the traceback
        if tb.tb_frame.f_code.co_filename == os.path.abspath(path) or tb.tb_frame.f_code.co_filename == path:
            where = f" ({os.path.basename(path)}, line {tb.tb_lineno})"
        tb = tb.tb_next
    return f"could not be graded: {type(e).__name__}: {e}{where}"


if __name__ == "__main__":
    main(sys.argv[1:])
