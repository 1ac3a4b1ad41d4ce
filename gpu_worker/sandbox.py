"""Limits the harness child puts on itself before it loads candidate code (no torch here).

- RLIMIT_CORE 0 (a crash leaves no core file), RLIMIT_FSIZE (a candidate flooding stdout into
  the log file dies of SIGXFSZ), RLIMIT_AS on the CPU target (CUDA reserves huge virtual ranges).
- A seccomp filter: fork, vfork, clone without CLONE_THREAD, execve and ptrace kill the whole
  process (SIGSYS), so a candidate that forks or execs is a failed candidate, never a stray
  process; sockets and signals to other processes (the worker) are refused with EPERM. Threads
  stay allowed (torch and the CUDA runtime create them); the harness detects threads a kernel
  leaves behind on its own.
  Where seccomp cannot be installed (other architectures, old kernels), RLIMIT_NPROC bounds forks
  for non-root users, and the parent reports any process that outlives the harness.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal

FSIZE_LIMIT = 64 << 20
SIGSYS_REASON = "a forbidden system call (fork, exec or ptrace)"

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}
_LD_W_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_ENOSYS = 38
_CLONE_THREAD = 0x00010000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1

# audit arch, seccomp syscall number, and the syscalls by name
_ARCHES = {
    "x86_64": (0xC000003E, 317, {
        "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62, "ptrace": 101, "tkill": 200,
        "tgkill": 234, "execveat": 322, "process_vm_writev": 311, "clone3": 435, "socket": 41,
        "pidfd_send_signal": 424,
    }),
    "aarch64": (0xC00000B7, 277, {
        "clone": 220, "execve": 221, "kill": 129, "ptrace": 117, "tkill": 130, "tgkill": 131, "execveat": 281,
        "process_vm_writev": 271, "clone3": 435, "socket": 198, "pidfd_send_signal": 424,
    }),
}  # fmt: skip
_KILLED = ("fork", "vfork", "execve", "execveat", "ptrace", "process_vm_writev")
# Refused with EPERM instead: the static CUDA runtime inside every CUDA candidate imports socket()
# and kill() for optional features, and a refusal is enough to protect the worker.
_REFUSED = ("socket", "tkill", "pidfd_send_signal")
_EPERM = 1


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def _program(arch: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The BPF program, as (code, jt, jf, k). Jump targets are labels resolved below."""
    audit, _, nr = _ARCHES[arch]
    ins: list[tuple] = [
        (_LD_W_ABS, 0, 0, 4),  # arch
        (_JEQ, 0, "kill", audit),
        (_LD_W_ABS, 0, 0, 0),  # syscall number
    ]
    if arch == "x86_64":
        ins.append((_JGE, "kill", 0, 0x40000000))  # the x32 ABI: other numbers, same calls
    ins += [(_JEQ, "clone", 0, nr["clone"]), (_JEQ, "enosys", 0, nr["clone3"])]
    ins += [(_JEQ, "own_pid", 0, nr["kill"]), (_JEQ, "own_pid", 0, nr["tgkill"])]
    ins += [(_JEQ, "kill", 0, nr[name]) for name in _KILLED if name in nr]
    ins += [(_JEQ, "eperm", 0, nr[name]) for name in _REFUSED if name in nr]
    ins += [
        (_RET, 0, 0, _ALLOW),
        ("clone",), (_LD_W_ABS, 0, 0, 16),  # args[0] low word: the clone flags
        (_JSET, "allow", "kill", _CLONE_THREAD),
        ("own_pid",), (_LD_W_ABS, 0, 0, 16),  # kill(pid, ...), tgkill(tgid, ...): own process only
        (_JEQ, "allow", 0, pid), (_JEQ, "allow", "eperm", 0),
        ("eperm",), (_RET, 0, 0, _ERRNO | _EPERM),
        ("enosys",), (_RET, 0, 0, _ERRNO | _ENOSYS),  # glibc falls back to clone(), checked above
        ("allow",), (_RET, 0, 0, _ALLOW),
        ("kill",), (_RET, 0, 0, _KILL_PROCESS),
    ]  # fmt: skip
    labels, real = {}, []
    for item in ins:
        if len(item) == 1:
            labels[item[0]] = len(real)
        else:
            real.append(item)

    def target(at: int, j: int | str) -> int:
        return j if isinstance(j, int) else labels[j] - at - 1

    return [(c, target(i, jt), target(i, jf), k) for i, (c, jt, jf, k) in enumerate(real)]


def install_seccomp() -> str | None:
    """Install the filter on every thread of this process; None on success, else why not."""
    arch = platform.machine()
    if arch not in _ARCHES:
        return f"seccomp filter not available on {arch}"
    libc = ctypes.CDLL(None, use_errno=True)
    prog_list = _program(arch, os.getpid())
    filters = (_Filter * len(prog_list))(*[_Filter(*ins) for ins in prog_list])
    prog = _Prog(len(prog_list), filters)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}"
    sys_seccomp = _ARCHES[arch][1]
    flags = _SECCOMP_FILTER_FLAG_TSYNC
    if libc.syscall(sys_seccomp, _SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog)) == 0:
        return None
    # Without TSYNC only this thread (and threads it creates) are filtered; candidate code runs here.
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0:
        return None
    return f"seccomp filter refused: {os.strerror(ctypes.get_errno())}"


def _vm_size() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def apply(target: str, memory_limit_mb: int, use_seccomp: bool = True) -> list[str]:
    """Apply every limit; returns notes on what could not be applied (never raises)."""
    notes = []
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it, so a flood would only spin on EFBIG
    for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, FSIZE_LIMIT)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError) as exc:
            notes.append(f"setrlimit {limit}: {exc}")
    if target == "cpu" and memory_limit_mb > 0:
        size = _vm_size() + (memory_limit_mb << 20)
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (size if hard < 0 else min(size, hard), hard))
        except (ValueError, OSError) as exc:
            notes.append(f"RLIMIT_AS not set: {exc}")
    why = install_seccomp() if use_seccomp else "seccomp off for this job"
    if why:
        notes.append(why)
        if os.getuid() != 0:  # RLIMIT_NPROC counts the user's tasks and does not bind root
            tasks = _user_tasks()
            try:
                resource.setrlimit(resource.RLIMIT_NPROC, (tasks + 256, resource.getrlimit(resource.RLIMIT_NPROC)[1]))
            except (ValueError, OSError) as exc:
                notes.append(f"RLIMIT_NPROC not set: {exc}")
    return notes


def _user_tasks() -> int:
    """Threads of all processes of this user (what RLIMIT_NPROC counts)."""
    uid, total = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    total += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return total
