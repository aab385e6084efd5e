"""Shutting a student's grading process in: Landlock for files, TCP and signals, seccomp-bpf for the
system calls a function under test never needs. Both are unprivileged Linux features (no root, no user
namespaces, so they work where Ubuntu and Docker switch those off); the process confines itself and
can never undo it.

    Landlock (Linux >= 5.13)  reads only beneath the paths it is given (the standard library, NumPy),
                              writes only in its scratch folder; ABI 4+ also refuses TCP, ABI 6+ signals
                              to processes outside it
    seccomp-bpf               no socket, no new process or program, no ptrace, no kill but of itself,
                              no raised limits, no namespaces or mounts

This file runs inside the student's process before their code (sandbox.py imports it by path), so it
imports only the standard library."""
from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
import sys

# ---- Landlock (include/uapi/linux/landlock.h) ----------------------------------------------------------------

SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV   # the rights a file rule may hold


class Unconfinable(Exception):
    """This OS or kernel cannot confine the process; the message says what is missing."""


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (not Linux, too old, or switched off)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1                 # ABI 1: execute .. make_sym
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def landlock(readable: list[str], writable: list[str]) -> str:
    """Allow reading only beneath `readable` and writing only beneath `writable`, for good. -> what it holds."""
    abi = landlock_abi()
    if abi < 1:
        raise Unconfinable("this kernel has no Landlock (Linux 5.13+ with landlock in its lsm= list)")
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    handled = _fs_rights(abi)
    attr = struct.pack("<QQQ", handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                       SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    buf = ctypes.create_string_buffer(attr[:size], size)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise Unconfinable(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for paths, rights in ((readable, FS_READ_FILE | FS_READ_DIR | FS_EXECUTE), (writable, handled)):
            for path in paths:
                _allow(libc, ruleset, path, rights)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise Unconfinable(f"prctl(NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise Unconfinable(f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    extras = (["TCP"] if abi >= 4 else []) + (["signals"] if abi >= 6 else [])
    return f"Landlock ABI {abi} (files{', ' + ', '.join(extras) if extras else ''})"


def _allow(libc, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return                                           # a path this machine lacks grants nothing
    try:
        if not os.path.isdir(path):
            rights &= FILE_RIGHTS
        rule = _PathBeneath(rights, fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise Unconfinable(f"landlock_add_rule({path}): {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


# ---- seccomp-bpf ----------------------------------------------------------------------------------------------

# System calls by machine: the ones a function under test never needs (answered EPERM), and the
# signal calls allowed only towards the process itself (their first argument is its pid).
_DENIED = {
    "x86_64": dict(arch=0xC000003E, deny=[
        41, 53,                       # socket, socketpair
        56, 57, 58, 435, 59, 322,     # clone, fork, vfork, clone3, execve, execveat
        101, 310, 311,                # ptrace, process_vm_readv/writev
        200, 129, 297,                # tkill, rt_sigqueueinfo, rt_tgsigqueueinfo
        424, 434, 438,                # pidfd_send_signal, pidfd_open, pidfd_getfd
        160,                          # setrlimit
        272, 308, 165, 166, 155, 161,  # unshare, setns, mount, umount2, pivot_root, chroot
        321, 323, 425, 426, 427,      # bpf, userfaultfd, io_uring_*
        248, 249, 250, 298,           # add_key, request_key, keyctl, perf_event_open
        105, 106, 113, 114, 117, 119, 116,   # setuid, setgid, setreuid, setregid, setresuid, setresgid, setgroups
        133, 259, 135, 317],          # mknod, mknodat, personality, seccomp
        self_signal=[62, 234], prlimit=302),          # kill, tgkill; prlimit64
    "aarch64": dict(arch=0xC00000B7, deny=[
        198, 199, 220, 435, 221, 281, 117, 270, 271, 130, 138, 240, 424, 434, 438, 164,
        97, 268, 40, 39, 41, 51, 280, 282, 425, 426, 427, 217, 218, 219, 241,
        146, 144, 145, 143, 147, 149, 159, 33, 92, 277],
        self_signal=[129, 131], prlimit=261),
}
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_ERRNO_EPERM, _RET_KILL = 0x7FFF0000, 0x00050000 | 1, 0x80000000


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _filter(table: dict, pid: int) -> list[tuple[int, int, int, int]]:
    """The BPF program: (code, jump if true, jump if false, k) instructions."""
    deny, signals = table["deny"], table["self_signal"]
    prog = [(_LD_W_ABS, 0, 0, 4)]                                          # seccomp_data.arch
    # After the checks: ALLOW; the signal check (2); the prlimit check (4); ALLOW again; ERRNO; KILL.
    # BPF jumps only forward, so every target lies below the checks.
    n_checks = len(deny) + len(signals) + 1 + (1 if table["arch"] == 0xC000003E else 0)
    allow = 3 + n_checks
    sig_check, prl_check = allow + 1, allow + 3
    allow_again, errno, kill = allow + 7, allow + 8, allow + 9

    def jump(target: int) -> int:                  # the offset from the instruction about to be appended
        return target - len(prog) - 1
    prog.append((_JEQ_K, 0, jump(kill), table["arch"]))
    prog.append((_LD_W_ABS, 0, 0, 0))                                      # seccomp_data.nr
    if table["arch"] == 0xC000003E:                                        # the x32 ABI: refuse it whole
        prog.append((_JGE_K, jump(errno), 0, 0x40000000))
    for nr in deny:
        prog.append((_JEQ_K, jump(errno), 0, nr))
    for nr in signals:
        prog.append((_JEQ_K, jump(sig_check), 0, nr))
    prog.append((_JEQ_K, jump(prl_check), 0, table["prlimit"]))
    assert len(prog) == allow
    prog.append((_RET_K, 0, 0, _RET_ALLOW))
    prog.append((_LD_W_ABS, 0, 0, 16))                                     # args[0], low word: the pid
    prog.append((_JEQ_K, jump(allow_again), jump(errno), pid))
    prog.append((_LD_W_ABS, 0, 0, 32))                                     # prlimit64's new limit: NULL only
    prog.append((_JEQ_K, 0, jump(errno), 0))
    prog.append((_LD_W_ABS, 0, 0, 36))
    prog.append((_JEQ_K, jump(allow_again), jump(errno), 0))
    assert len(prog) == allow_again
    prog += [(_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ERRNO_EPERM), (_RET_K, 0, 0, _RET_KILL)]
    return prog


def seccomp() -> str:
    """Install the filter on this process, for good. -> what it holds."""
    machine = platform.machine().lower()
    table = _DENIED.get({"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine))
    if table is None:
        raise Unconfinable(f"no seccomp table for a {machine} machine (x86_64 and aarch64 have one)")
    prog = _filter(table, os.getpid())
    code = b"".join(struct.pack("<HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise Unconfinable(f"seccomp: {os.strerror(ctypes.get_errno())}")
    return "seccomp (no sockets, processes, ptrace or signals to others)"


def set_limits(memory_bytes: int, cpu_seconds: int, file_bytes: int = 64 << 20) -> None:
    """Address space, CPU time, the size of a written file, open files, no core dumps."""
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_seconds),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, 64),
                         (resource.RLIMIT_CORE, 0)):
        try:
            _, hard = resource.getrlimit(limit)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass              # macOS refuses some limits; the parent's wall-clock watchdog still holds


def confine(readable: list[str], writable: list[str]) -> str:
    """Landlock, then seccomp; raise Unconfinable where either is missing. -> the mechanism, in words."""
    if not sys.platform.startswith("linux"):
        raise Unconfinable(f"{sys.platform} has neither Landlock nor seccomp (Linux only)")
    files = landlock(readable, writable)
    return f"{files} + {seccomp()}"
