"""Seccomp-BPF filters for contained processes (ctypes only; no torch).

Four profiles (docs/decisions/0011-trust-boundary.md, 0014, 0015):

- `harness`: the process that loads candidate code. An allow-list on x86_64: a system call that is
  not named below is refused with EPERM, so calls that kernels add later (io_uring was one) are
  refused too. The dangerous ones kill the process at once (SIGSYS: fork, exec, ptrace, io_uring,
  mount, namespaces, bpf, keys, perf, modules, cross-process memory). Threads may be created
  (torch and the CUDA runtime need them); signals reach only the process itself; rlimits can be
  read, never set; sockets only of the AF_UNIX family (there is no network in the sandbox anyway).
- `host`: the kernel host (gpu_worker/kernel_host.py), the process that loads one kernel library.
  The harness profile without threads (clone of any kind kills it), without timers that deliver
  signals and without leaving the CPU the judge pinned it to, so no code of the library runs
  between the calls the judge makes: the host shares one core with the judge, which is busy
  between calls (and a loop that keeps running after its reply shows in the host's CPU time).
- `cuda-host`: a kernel host on the CUDA target. The CUDA driver starts threads of its own, so
  threads are allowed as in the harness profile; the timers and affinity calls of `host` are
  refused. The judge counts the host's threads and their CPU time instead.
- `served`: stacked on `host` in a CPU kernel host once its library is loaded and its entry found
  (seccomp filters add up: the stricter answer wins). Default allow, and death (SIGSYS) for every
  call that looks outside the process or asks who or where it is: files by name (open, stat,
  readlink, directories), identity (uids, parent, session, uname, limits, affinity, CPU), new
  descriptors (sockets, pipes, memfd, eventfd, dup, fcntl) and prctl; not getpid and gettid, which
  glibc's raise() needs (a crash would read as a forbidden call). A kernel call needs
  none of them, and the host's loop (a socket it already holds, memory, locks, clocks) none; a
  kernel that asks (a red team's read the jail's uid through libc's own syscall(), computed one row
  outside the jail and passed every check) is refused instead of told: an error would say "judge"
  as plainly as the answer. Not on the CUDA host: its driver opens files and starts threads lazily.
- `tool`: compilers and compute-sanitizer, which fork and exec. A deny-list (EPERM) of the same
  dangerous calls; the namespaces around the tool are what contain it.

On other architectures than x86_64 the harness profile falls back to the tool's deny-list plus
kills on fork and exec (aarch64).
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Literal

Profile = Literal["harness", "host", "cuda-host", "served", "tool"]

# BPF opcodes and seccomp return values
_LD_W_ABS, _JEQ, _JSET, _JGE, _JA, _RET = 0x20, 0x15, 0x45, 0x35, 0x05, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_AF_UNIX = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1

_X86_64 = dict(
    read=0, write=1, open=2, close=3, stat=4, fstat=5, lstat=6, poll=7, lseek=8, mmap=9, mprotect=10, munmap=11,
    brk=12, rt_sigaction=13, rt_sigprocmask=14, rt_sigreturn=15, ioctl=16, pread64=17, pwrite64=18, readv=19,
    writev=20, access=21, pipe=22, select=23, sched_yield=24, mremap=25, msync=26, mincore=27, madvise=28,
    shmget=29, shmat=30, shmctl=31, dup=32, dup2=33, pause=34, nanosleep=35, getitimer=36, alarm=37, setitimer=38,
    getpid=39, sendfile=40, socket=41, connect=42, accept=43, sendto=44, recvfrom=45, sendmsg=46, recvmsg=47,
    shutdown=48, bind=49, listen=50, getsockname=51, getpeername=52, socketpair=53, setsockopt=54, getsockopt=55,
    clone=56, fork=57, vfork=58, execve=59, exit=60, wait4=61, kill=62, uname=63, semget=64, semop=65, semctl=66,
    shmdt=67, fcntl=72, flock=73, fsync=74, fdatasync=75, truncate=76, ftruncate=77, getdents=78, getcwd=79,
    chdir=80, fchdir=81, rename=82, mkdir=83, rmdir=84, creat=85, link=86, unlink=87, symlink=88, readlink=89,
    chmod=90, fchmod=91, umask=95, gettimeofday=96, getrlimit=97, getrusage=98, sysinfo=99, times=100, ptrace=101,
    getuid=102, syslog=103, getgid=104, geteuid=107, getegid=108, getppid=110, getpgrp=111, getgroups=115,
    getresuid=118, getresgid=120, getpgid=121, getsid=124, capget=125, rt_sigpending=127, rt_sigtimedwait=128,
    rt_sigqueueinfo=129, rt_sigsuspend=130, sigaltstack=131, uselib=134, personality=135, statfs=137, fstatfs=138,
    getpriority=140, sched_getparam=143, sched_getscheduler=145, sched_get_priority_max=146,
    sched_get_priority_min=147, sched_rr_get_interval=148, mlock=149, munlock=150, vhangup=153, modify_ldt=154,
    pivot_root=155, prctl=157, arch_prctl=158, adjtimex=159, setrlimit=160, chroot=161, acct=163,
    settimeofday=164, mount=165, umount2=166, swapon=167, swapoff=168, reboot=169, iopl=172, ioperm=173,
    init_module=175, delete_module=176, quotactl=179, gettid=186, readahead=187, getxattr=191, lgetxattr=192,
    fgetxattr=193, listxattr=194, llistxattr=195, flistxattr=196, tkill=200, time=201, futex=202,
    sched_setaffinity=203, sched_getaffinity=204, set_thread_area=205, get_thread_area=211, lookup_dcookie=212,
    epoll_create=213, getdents64=217, set_tid_address=218, restart_syscall=219, semtimedop=220, fadvise64=221,
    timer_create=222, timer_settime=223, timer_gettime=224, timer_getoverrun=225, timer_delete=226,
    clock_settime=227, clock_gettime=228, clock_getres=229, clock_nanosleep=230, exit_group=231, epoll_wait=232,
    epoll_ctl=233, tgkill=234, utimes=235, mbind=237, set_mempolicy=238, get_mempolicy=239, kexec_load=246,
    waitid=247, add_key=248, request_key=249, keyctl=250, inotify_init=253, inotify_add_watch=254,
    inotify_rm_watch=255, openat=257, mkdirat=258, newfstatat=262, unlinkat=263, renameat=264, linkat=265,
    symlinkat=266, readlinkat=267, fchmodat=268, faccessat=269, pselect6=270, ppoll=271, unshare=272,
    set_robust_list=273, get_robust_list=274, splice=275, tee=276, utimensat=280, epoll_pwait=281, signalfd=282,
    timerfd_create=283, eventfd=284, fallocate=285, timerfd_settime=286, timerfd_gettime=287, accept4=288,
    signalfd4=289, eventfd2=290, epoll_create1=291, dup3=292, pipe2=293, inotify_init1=294, preadv=295,
    pwritev=296, rt_tgsigqueueinfo=297, perf_event_open=298, recvmmsg=299, prlimit64=302, name_to_handle_at=303,
    open_by_handle_at=304, clock_adjtime=305, sendmmsg=307, setns=308, getcpu=309, process_vm_readv=310,
    process_vm_writev=311, kcmp=312, finit_module=313, sched_getattr=315, renameat2=316, seccomp=317,
    getrandom=318, memfd_create=319, kexec_file_load=320, bpf=321, execveat=322, userfaultfd=323, membarrier=324,
    mlock2=325, copy_file_range=326, preadv2=327, pwritev2=328, pkey_mprotect=329, pkey_alloc=330, pkey_free=331,
    statx=332, rseq=334, pidfd_send_signal=424, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
    open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, pidfd_open=434, clone3=435,
    close_range=436, openat2=437, pidfd_getfd=438, faccessat2=439, process_madvise=440, epoll_pwait2=441,
    mount_setattr=442, futex_waitv=449,
)  # fmt: skip
_AARCH64 = dict(
    clone=220, execve=221, kill=129, ptrace=117, tkill=130, tgkill=131, execveat=281, process_vm_readv=270,
    process_vm_writev=271, clone3=435, socket=198, pidfd_send_signal=424, rt_sigqueueinfo=138,
    rt_tgsigqueueinfo=240, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, mount=40, umount2=39,
    pivot_root=41, unshare=97, setns=268, bpf=280, keyctl=219, add_key=217, request_key=218, perf_event_open=241,
    init_module=105, finit_module=273, delete_module=106, kexec_load=104, kexec_file_load=294, reboot=142,
    userfaultfd=282, open_by_handle_at=265, name_to_handle_at=264, setrlimit=164, prlimit64=261, chroot=51,
    swapon=224, swapoff=225, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
    pidfd_getfd=438, mount_setattr=442, kcmp=272, acct=89, settimeofday=170, clock_settime=112, clock_adjtime=266,
    adjtimex=171, syslog=116,
)  # fmt: skip
_ARCHES = {"x86_64": (0xC000003E, 317, _X86_64), "aarch64": (0xC00000B7, 277, _AARCH64)}

# Calls that end the process on the spot (SIGSYS): escapes, not mistakes.
DANGEROUS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "bpf", "keyctl", "add_key", "request_key", "perf_event_open",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "userfaultfd", "open_by_handle_at", "name_to_handle_at", "pidfd_getfd", "kcmp", "acct", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "syslog", "iopl", "ioperm", "uselib", "lookup_dcookie",
    "vhangup", "quotactl",
)  # fmt: skip
PROCESS_STARTS = ("fork", "vfork", "execve", "execveat")
# Allowed in the harness profile, besides the conditional ones handled in `_program`.
HARNESS_ALLOWED = (
    "read", "write", "open", "close", "stat", "fstat", "lstat", "poll", "lseek", "mmap", "mprotect", "munmap", "brk",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "ioctl", "pread64", "pwrite64", "readv", "writev", "access",
    "pipe", "select", "sched_yield", "mremap", "msync", "mincore", "madvise", "shmget", "shmat", "shmctl", "shmdt",
    "semget", "semop", "semctl", "semtimedop", "dup", "dup2", "dup3", "pause", "nanosleep", "getitimer", "alarm",
    "setitimer", "getpid", "sendfile", "connect", "accept", "accept4", "sendto", "recvfrom", "sendmsg", "recvmsg",
    "sendmmsg", "recvmmsg", "shutdown", "bind", "listen", "getsockname", "getpeername", "socketpair", "setsockopt",
    "getsockopt", "exit", "exit_group", "wait4", "waitid", "uname", "fcntl", "flock", "fsync", "fdatasync",
    "truncate", "ftruncate", "getdents", "getdents64", "getcwd", "chdir", "fchdir", "rename", "renameat",
    "renameat2", "mkdir", "mkdirat", "rmdir", "creat", "link", "linkat", "unlink", "unlinkat", "symlink",
    "symlinkat", "readlink", "readlinkat", "chmod", "fchmod", "fchmodat", "umask", "gettimeofday", "getrlimit",
    "getrusage", "sysinfo", "times", "getuid", "getgid", "geteuid", "getegid", "getppid", "getpgrp", "getgroups",
    "getresuid", "getresgid", "getpgid", "getsid", "capget", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
    "sigaltstack", "personality", "statfs", "fstatfs", "getpriority", "sched_getparam", "sched_getscheduler",
    "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval", "sched_getattr", "mlock",
    "mlock2", "munlock", "prctl", "arch_prctl", "gettid", "readahead", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr", "time", "futex", "futex_waitv", "sched_setaffinity",
    "sched_getaffinity", "set_thread_area", "get_thread_area", "set_tid_address", "restart_syscall", "fadvise64",
    "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun", "timer_delete", "clock_gettime",
    "clock_getres", "clock_nanosleep", "epoll_create", "epoll_create1", "epoll_wait", "epoll_pwait",
    "epoll_pwait2", "epoll_ctl", "utimes", "utimensat", "mbind", "set_mempolicy", "get_mempolicy", "inotify_init",
    "inotify_init1", "inotify_add_watch", "inotify_rm_watch", "openat", "openat2", "newfstatat", "statx",
    "faccessat", "faccessat2", "pselect6", "ppoll", "set_robust_list", "get_robust_list", "splice", "tee",
    "signalfd", "signalfd4", "timerfd_create", "timerfd_settime", "timerfd_gettime", "eventfd", "eventfd2",
    "fallocate", "pipe2", "preadv", "pwritev", "preadv2", "pwritev2", "copy_file_range", "getcpu", "seccomp",
    "getrandom", "memfd_create", "membarrier", "pkey_mprotect", "pkey_alloc", "pkey_free", "rseq", "close_range",
)  # fmt: skip
# Checked first, allowed at once: the calls a busy process makes most (locks, memory, I/O, clocks),
# so the filter costs them a few instructions rather than a walk down the whole list.
HOT = ("futex", "sched_yield", "read", "write", "mmap", "munmap", "madvise", "mprotect", "ioctl", "clock_gettime",
       "getpid", "gettid", "poll", "ppoll", "nanosleep", "clock_nanosleep", "rt_sigprocmask", "brk", "close")  # fmt: skip
HOST_DENIED = ("setitimer", "alarm", "timer_create", "timer_settime", "sched_setaffinity")
SIGNALS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # arg 0: the target process
# Killed in a loaded CPU kernel host (`served`): what would tell a kernel where it runs, or reach past it.
SERVED_KILLED = (
    "open", "openat", "openat2", "creat", "stat", "lstat", "newfstatat", "statx", "access", "faccessat",
    "faccessat2", "readlink", "readlinkat", "getdents", "getdents64", "chdir", "fchdir", "getcwd", "mkdir",
    "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat", "symlink",
    "symlinkat", "chmod", "fchmod", "fchmodat", "truncate", "statfs", "fstatfs", "utimes", "utimensat",
    "inotify_init", "inotify_init1", "inotify_add_watch", "getxattr", "lgetxattr", "fgetxattr", "listxattr",
    "llistxattr", "flistxattr", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "getppid", "getpgrp", "getpgid", "getsid", "uname", "sysinfo", "capget", "getpriority",
    "getrlimit", "prlimit64", "getrusage", "times", "sched_getaffinity", "sched_getparam", "sched_getscheduler",
    "sched_getattr", "getcpu", "get_mempolicy", "mincore", "personality", "prctl", "arch_prctl", "socket",
    "socketpair", "connect", "bind", "listen", "accept", "accept4", "getsockname", "getpeername", "getsockopt",
    "setsockopt", "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "memfd_create",
    "pipe", "pipe2", "eventfd", "eventfd2", "signalfd", "signalfd4", "timerfd_create", "epoll_create",
    "epoll_create1", "dup", "dup2", "dup3", "fcntl", "flock", "wait4", "waitid", "sendfile", "splice", "tee",
    "copy_file_range",
)  # fmt: skip

KILLED_REASON = (
    "a forbidden system call (fork, exec, threads in a kernel, ptrace, io_uring, mount, namespaces, bpf, keys, "
    "cross-process memory; on CPU, from a loaded kernel: files by name, who or where the process is, new "
    "descriptors)"
)


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Filter))]


def _arg(i: int, high: bool = False) -> int:
    """Offset of argument i's low (or high) 32-bit word in struct seccomp_data (little endian)."""
    return 16 + 8 * i + (4 if high else 0)


_TERMINALS = {"allow": _ALLOW, "kill": _KILL_PROCESS, "eperm": _ERRNO | _EPERM, "enosys": _ERRNO | _ENOSYS}
_BLOCK = 48  # instructions between terminal blocks: every jump stays well inside BPF's 8-bit offsets


def _program(profile: Profile, arch: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k). Jumps name a terminal ("allow", "kill", "eperm", "enosys") or
    a local label; a terminal name resolves to the next block of terminals after the jump."""
    audit, _, nr = _ARCHES[arch]
    if profile == "served":  # stacked on `host`, which already refuses everything not on its list
        served = [(_LD_W_ABS, 0, 0, 4), (_JEQ, 0, "kill", audit), (_LD_W_ABS, 0, 0, 0)]
        served += [(_JEQ, "kill", 0, nr[name]) for name in SERVED_KILLED if name in nr]
        return _assemble([*served, (_RET, 0, 0, _ALLOW)])
    contained = profile in ("harness", "host", "cuda-host")
    allow_list = contained and arch == "x86_64"
    default = "eperm" if allow_list else "allow"
    body: list[tuple] = []

    def own_pid(arg: int) -> list[tuple]:  # arg `arg` must be exactly this process's pid
        return [(_LD_W_ABS, 0, 0, _arg(arg, True)), (_JEQ, 0, "eperm", 0),
                (_LD_W_ABS, 0, 0, _arg(arg)), (_JEQ, "allow", "eperm", pid)]  # fmt: skip

    # Conditional calls first, each with its own argument checks.
    special: list[tuple[str, list[tuple]]] = [("clone3", [(_RET, 0, 0, _ERRNO | _ENOSYS)])]  # glibc falls back
    if profile in ("harness", "cuda-host"):
        special.append(("clone", [(_LD_W_ABS, 0, 0, _arg(0)), (_JSET, "allow", "kill", _CLONE_THREAD)]))
    if contained:
        special += [(name, own_pid(0)) for name in SIGNALS]
        special.append(("prlimit64", [(_LD_W_ABS, 0, 0, _arg(2)), (_JEQ, 0, "eperm", 0),
                                      (_LD_W_ABS, 0, 0, _arg(2, True)), (_JEQ, "allow", "eperm", 0)]))  # fmt: skip
    special.append(("socket", [(_LD_W_ABS, 0, 0, _arg(0)), (_JEQ, "allow", "eperm", _AF_UNIX)]))
    plain: list[tuple[str, str]] = [(name, "kill") for name in DANGEROUS]
    if profile == "host":  # no threads, and no timer signals whose handlers would run between calls
        plain.append(("clone", "kill"))
    if profile in ("host", "cuda-host"):
        plain += [(name, "eperm") for name in HOST_DENIED]
    if contained:
        plain += [(name, "kill") for name in PROCESS_STARTS]
        plain += [(name, "eperm") for name in ("setrlimit", "tkill", "pidfd_send_signal", "pidfd_open")]
        if allow_list:
            plain += [(name, "allow") for name in HARNESS_ALLOWED]
    else:
        plain += [(name, "eperm") for name in ("setrlimit",)]

    body += [(_LD_W_ABS, 0, 0, 4), (_JEQ, 0, "kill", audit), (_LD_W_ABS, 0, 0, 0)]
    if arch == "x86_64":
        body.append((_JGE, "kill", 0, 0x40000000))  # the x32 ABI: other numbers, same calls
    if allow_list:
        body += [(_JEQ, "allow", 0, nr[name]) for name in HOT]
    for name, code in special:
        if name in nr:
            body += [(_JEQ, 0, f"after_{name}", nr[name]), *code, (f"after_{name}",), (_LD_W_ABS, 0, 0, 0)]
    for name, action in plain:
        if name in nr:
            body.append((_JEQ, action, 0, nr[name]))
    body.append((_RET, 0, 0, _TERMINALS[default]))
    return _assemble(body)


def _assemble(body: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Insert terminal blocks every _BLOCK instructions and resolve every jump to an offset."""
    real: list[tuple] = []
    labels: dict[str, int] = {}
    terminals: dict[str, list[int]] = {name: [] for name in _TERMINALS}
    count = 0
    for item in body:
        if len(item) == 1:
            labels[item[0]] = len(real)
            continue
        real.append(item)
        count += 1
        if count >= _BLOCK:
            count = 0
            real.append((_JA, 0, 0, len(_TERMINALS)))
            for name, value in _TERMINALS.items():
                terminals[name].append(len(real))
                real.append((_RET, 0, 0, value))
    for name, value in _TERMINALS.items():
        terminals[name].append(len(real))
        real.append((_RET, 0, 0, value))

    def target(at: int, j: int | str) -> int:
        if isinstance(j, int):
            return j
        dest = labels[j] if j in labels else next(t for t in terminals[j] if t > at)
        off = dest - at - 1
        if not 0 <= off <= 255:
            raise AssertionError(f"seccomp program: jump of {off} to {j}")
        return off

    return [(c, target(i, jt), target(i, jf), k) for i, (c, jt, jf, k) in enumerate(real)]


def install(profile: Profile) -> str | None:
    """Install the profile's filter on every thread of this process (NO_NEW_PRIVS first, so it holds
    across exec); None on success, else why not."""
    arch = platform.machine()
    if arch not in _ARCHES:
        return f"seccomp filter not available on {arch}"
    libc = ctypes.CDLL(None, use_errno=True)
    prog_list = _program(profile, arch, os.getpid())
    filters = (_Filter * len(prog_list))(*[_Filter(*ins) for ins in prog_list])
    prog = _Prog(len(prog_list), filters)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}"
    if libc.syscall(_ARCHES[arch][1], _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog)) == 0:
        return None
    # Without TSYNC only this thread (and threads it creates) are filtered; candidate code runs here.
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0:
        return None
    return f"seccomp filter refused: {os.strerror(ctypes.get_errno())}"
