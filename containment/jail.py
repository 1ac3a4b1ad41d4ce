"""Contain a process that runs untrusted code: namespaces, a read-only view, no privileges, hard limits.

The harness child that loads a candidate library, the compiler that builds it and the
compute-sanitizer run are all started through `enter` (in process, after a fork: the zygote's
children) or through `python -m containment.jail SPEC -- ARGV...` (which enters, then execs ARGV):

1. The calling process becomes a small supervisor: it makes new PID, mount, network, IPC and UTS
   namespaces (as root with CAP_SYS_ADMIN directly; otherwise inside a new user namespace that maps
   only the caller's own uid), forks the namespace's init (PID 1), waits for it and exits the way
   the job did. The init sets the sandbox up, forks the job's process (at a pid drawn at random up to
   pid_max, as a production process's could be, not 2) and waits. When the
   supervisor dies, the init is killed (PDEATHSIG), and with it everything in its PID namespace:
   no descendant outlives the job.
2. The init builds a new root on a tmpfs: the system directories (/usr and the
   merged-/usr links, a few /etc files the loader and Python need), the Python installation,
   kopt's own code, the compiler's install root and whatever the spec names, each bound read-only
   at its own path; a fresh /proc of its own PID namespace; /dev with null, zero, random and (for
   GPU jobs) the NVIDIA device nodes only; /sys read-only without its sub-mounts; a size-capped
   tmpfs /tmp; the job's scratch directory, the only writable place. It pivots into that root,
   so nothing else of the host's files (homes, keys, kopt's home, other jobs) exists for it. There
   is no network: the new network namespace has no interface but a loopback that is down.
3. It drops privileges for good: as root, to uid/gid 65534 with no supplementary groups (all
   capabilities go with uid 0); in a user namespace, every capability is dropped. Then hard
   rlimits (no core files, file size, open files, processes, address space where asked),
   NO_NEW_PRIVS, a fresh environment of only the spec's variables, and a new session.

Where no namespace can be made, `enter` raises JailError; callers refuse to run candidate code then
unless KOPT_ALLOW_UNSANDBOXED=1 (see `unsandboxed_allowed`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP = 1, 24
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
JOB_PID_LOW = 300  # the lowest pid the job may be given (_draw_job_pid); the host's own start there too
NOBODY = 65534
HOSTNAME = b"kopt-sandbox"
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "nsswitch.conf", "passwd", "group",
             "localtime", "os-release")  # fmt: skip
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
ESCAPE_HATCH = "KOPT_ALLOW_UNSANDBOXED"
SETUP_FAILED = 113  # exit status of a jail that could not be built (the job never ran)

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(RuntimeError):
    """The sandbox could not be built; the job must not run untrusted code."""


@dataclass(frozen=True)
class JailSpec:
    scratch: str  # the only writable directory (made by the caller)
    read_only: tuple[str, ...] = ()  # more paths to show read-only, at their own paths
    env: dict[str, str] = field(default_factory=dict)  # the whole environment inside
    gpu: bool = False  # pass the NVIDIA device nodes in
    address_space_mb: int | None = None  # RLIMIT_AS, hard (not for CUDA: it reserves huge ranges)
    file_size_mb: int = 64  # RLIMIT_FSIZE, hard: a flood of output dies of SIGXFSZ
    processes: int = 512  # RLIMIT_NPROC, hard (binds an unprivileged uid)
    open_files: int = 4096  # RLIMIT_NOFILE, hard
    tmp_mb: int = 256  # size of the tmpfs at /tmp

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JailSpec:
        data = json.loads(text)
        data["read_only"] = tuple(data.get("read_only", ()))
        return cls(**data)


def unsandboxed_allowed() -> bool:
    return os.environ.get(ESCAPE_HATCH, "") == "1"


def disabled() -> bool:
    """KOPT_SANDBOX=off: run without the jail (benchmarks of its cost; hosts without namespaces).
    Only honoured together with KOPT_ALLOW_UNSANDBOXED=1."""
    return os.environ.get("KOPT_SANDBOX", "on") == "off" and unsandboxed_allowed()


REPO_ROOT = Path(__file__).resolve().parent.parent


def python_paths() -> list[str]:
    """What an interpreter of this installation needs to see: its prefixes and import paths, but
    not the repository root or the working directory (only kopt's own packages, `code_paths`)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths |= set(sys.path) | set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    skip = {str(REPO_ROOT), os.getcwd(), ""}
    return sorted(p for p in paths if p not in skip and os.path.isdir(p) and os.path.realpath(p) not in skip)


def code_paths() -> list[str]:
    """kopt's own packages (the harness imports them), not the whole repository around them."""
    return [str(REPO_ROOT / name) for name in ("kopt", "containment", "gpu_worker", "kernels")
            if (REPO_ROOT / name).is_dir()]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                       data and data.encode()), f"mount {src or fstype} on {dst}")  # fmt: skip


def _locked_flags(path: str) -> int:
    """Mount flags of `path` that a remount inside a user namespace must keep (else EPERM)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):  # fmt: skip
        if f & st:
            flags |= ms
    return flags


def _bind(src: str, root: str, writable: bool = False, dev: bool = False) -> None:
    """Bind `src` at the same path under `root`, read-only unless `writable`. Read-only directories
    come with their sub-mounts (a container's driver libraries are often mounted under /usr), each
    made read-only too; the writable scratch comes alone."""
    dst = root + src
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "w").close()
    recursive = os.path.isdir(src) and not writable  # the scratch holds the jail's own root: never recursive
    _mount(src, dst, None, MS_BIND | (MS_REC if recursive else 0))
    for target in _mounts_under(dst) if recursive else [dst]:
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | _locked_flags(target) | (0 if writable else MS_RDONLY)
        if not dev:
            flags |= MS_NODEV
        try:
            _mount(None, target, None, flags)
        except JailError:
            if target == dst:
                raise  # a sub-mount that refuses (locked in a user namespace) keeps its own flags


def _mounts_under(path: str) -> list[str]:
    """`path` and the mount points below it, from /proc/self/mountinfo (octal escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == path or point.startswith(path.rstrip("/") + "/"):
                out.append(point)
    return sorted(set(out), key=len) or [path]


def _show(path: str, root: str) -> None:
    """Show a system path inside: a top-level symlink (merged /usr) as the same link, else bound."""
    if os.path.islink(path) and os.path.dirname(path) == "/":
        if not os.path.lexists(root + path):
            os.symlink(os.readlink(path), root + path)
    elif os.path.exists(path):
        _bind(os.path.realpath(path), root)
        if os.path.realpath(path) != path and not os.path.lexists(root + path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.path.realpath(path), root + path)


def _build_root(spec: JailSpec, root: str) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    # /tmp first: read-only paths under the host's /tmp (a wheel target, say) are bound inside it.
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec.tmp_mb}m,mode=1777")
    for path in SYSTEM_DIRS:
        _show(path, root)
    os.makedirs(root + "/etc", exist_ok=True)
    for name in ETC_FILES:
        _show(f"/etc/{name}", root)
    covered: list[str] = []
    for path in sorted({*python_paths(), *code_paths(), *spec.read_only}, key=len):
        real = os.path.realpath(path)
        if os.path.exists(real) and not any(real == c or real.startswith(c + "/") for c in covered):
            _show(real, root)
            covered.append(real)
    # /dev: a few harmless nodes, the GPU's when asked; shared memory and pts are fresh.
    os.makedirs(root + "/dev", exist_ok=True)
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID, "size=64k,mode=0755")
    for name in DEVICES:
        _bind(f"/dev/{name}", root, writable=True, dev=True)
    if spec.gpu:
        for name in sorted(os.listdir("/dev")):
            if name.startswith("nvidia"):
                _bind(f"/dev/{name}", root, writable=True, dev=True)
    os.makedirs(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if os.path.isdir("/sys"):  # a fresh sysfs (no cgroup or other sub-mounts), read-only; CUDA reads it
        os.makedirs(root + "/sys")
        _mount("sysfs", root + "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _bind(os.path.realpath(spec.scratch), root, writable=True)
    old = root + "/.old-root"
    os.makedirs(old)
    arch = os.uname().machine
    _check(_libc.syscall(SYS_PIVOT_ROOT[arch], root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old-root", MNT_DETACH), "umount the old root")
    os.rmdir("/.old-root")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def host_pid_max() -> int:
    """The host's pid_max, as its own processes see it (read before the jail's /proc replaces the view)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


def _draw_job_pid(pid_max: int) -> None:
    """Make the job's pid one a process in production could have: drawn at random up to the host's
    pid_max, not the 2 that a fresh PID namespace hands out. A small pid told a kernel that it was
    being judged (a red team's read it from glibc's thread control block, no system call needed); the
    job's process, its threads and its children now count up from the drawn number. The init writes
    its namespace's ns_last_pid (the fresh /proc is its own; it still holds the capability)."""
    import secrets

    headroom = 4096  # the job's threads and children count up from the drawn pid
    last = JOB_PID_LOW + secrets.randbelow(max(1, pid_max - headroom - JOB_PID_LOW))
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(last))


def _drop_privileges(spec: JailSpec, real_root: bool) -> None:
    import resource

    if real_root:
        for dirpath, _, files in os.walk(spec.scratch):
            for p in (dirpath, *(os.path.join(dirpath, f) for f in files)):
                os.lchown(p, NOBODY, NOBODY)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)  # leaving uid 0 clears every capability
    else:
        for cap in range(64):
            if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break
        _capset_empty()
    limits = [
        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, spec.file_size_mb << 20),
        (resource.RLIMIT_NOFILE, spec.open_files), (resource.RLIMIT_NPROC, spec.processes),
    ]  # fmt: skip
    if spec.address_space_mb:
        limits.append((resource.RLIMIT_AS, spec.address_space_mb << 20))
    for which, value in limits:
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise JailError("prctl(NO_NEW_PRIVS) failed")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capset_empty() -> None:
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _unshare() -> bool:
    """New namespaces for the caller; True when done as real root (no user namespace)."""
    flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWPID
    if os.geteuid() == 0 and _libc.unshare(flags) == 0:
        return True
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(flags | CLONE_NEWUSER) != 0:
        err = ctypes.get_errno()
        hint = " (user namespaces disabled? see kernel.unprivileged_userns_clone)" if err == errno.EPERM else ""
        raise JailError(f"cannot create namespaces: {os.strerror(err)}{hint}")
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):  # fmt: skip
        with open(path, "w") as f:
            f.write(text)
    return False


def enter(spec: JailSpec) -> None:
    """Contain the calling (single-threaded) process. Returns only in the contained process; the
    caller's process becomes its supervisor and exits as the contained process did. Raises
    JailError (in the caller) when the namespaces cannot be made.

    Three processes: the supervisor (outside), the namespace's init (PID 1: it builds the root,
    drops privileges, then only waits) and the contained process (at a pid drawn at random:
    _draw_job_pid), which is not the init because an init ignores its own fatal signals (abort()
    would not end it)."""
    root = os.path.join(spec.scratch, ".jail-root")
    os.makedirs(root, exist_ok=True)
    pid_max = host_pid_max()
    real_root = _unshare()
    r, w = os.pipe()  # init -> supervisor: a failed set-up, or the signal that ended the job
    life_r, life_w = os.pipe()  # held open by the supervisor: EOF means it is gone
    pid = os.fork()
    if pid:
        os.close(w)
        os.close(life_r)
        _supervise(pid, r)
    os.close(r)
    os.close(life_w)
    try:
        os.setsid()  # its own process group: a kill(0) or killpg reaches nobody outside
        _build_root(spec, root)
        _libc.sethostname(HOSTNAME, len(HOSTNAME))
        _draw_job_pid(pid_max)
        _drop_privileges(spec, real_root)
        os.chdir(os.path.realpath(spec.scratch))
        # After the last change of credentials (which clears it): die with the supervisor. If the
        # supervisor died before this took effect, the lifeline shows it.
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if select.select([life_r], [], [], 0)[0]:
            os._exit(SETUP_FAILED)
        os.close(life_r)
        child = os.fork()
    except BaseException as exc:  # noqa: BLE001 - report to the supervisor, never run unjailed
        os.write(w, f"sandbox set-up failed: {exc}".encode()[:4000])
        os._exit(SETUP_FAILED)
    if child:
        _init(child, w)
    os.close(w)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the init is gone: so is the job
    if os.getppid() != 1:
        os._exit(SETUP_FAILED)
    os.environ.clear()
    os.environ.update(spec.env)


def _init(child: int, report_fd: int) -> None:
    """PID 1 of the namespace: reap, and when the job's process ends, exit the way it did (a signal
    is told to the supervisor, which re-raises it: an init cannot)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if pid == child:
            break
    if os.WIFSIGNALED(status):
        os.write(report_fd, f"signal {os.WTERMSIG(status)}".encode())
        os._exit(1)
    os._exit(os.WEXITSTATUS(status))


def _supervise(pid: int, report_fd: int) -> None:
    """Wait for the namespace's init; leave the way the job left (same code, or the same signal)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    msg = b""
    while chunk := os.read(report_fd, 4096):
        msg += chunk
    os.close(report_fd)
    text = msg.decode(errors="replace")
    if text and not text.startswith("signal "):
        os.write(2, b"kopt-jail: " + msg + b"\n")
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        except InterruptedError:
            continue
    sig = int(text.split()[1]) if text.startswith("signal ") else (os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0)
    if sig:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    """python -m containment.jail SPEC_JSON [--seccomp PROFILE] -- ARGV...: enter, then exec ARGV."""
    if "--" not in argv or len(argv) < 3:
        sys.stderr.write("usage: python -m containment.jail SPEC_JSON [--seccomp tool|harness] -- ARGV...\n")
        os._exit(2)
    cut = argv.index("--")
    spec = JailSpec.from_json(argv[0])
    profile = argv[argv.index("--seccomp") + 1] if "--seccomp" in argv[:cut] else None
    command = argv[cut + 1 :]
    try:
        enter(spec)
    except JailError as exc:
        sys.stderr.write(f"kopt-jail: {exc}\n")
        os._exit(SETUP_FAILED)
    if profile:
        from containment import seccomp

        why = seccomp.install(profile)  # type: ignore[arg-type]
        if why:
            sys.stderr.write(f"kopt-jail: {why}\n")
            os._exit(SETUP_FAILED)
    try:
        os.execvpe(command[0], command, spec.env)
    except OSError as exc:
        sys.stderr.write(f"kopt-jail: cannot run {command[0]}: {exc}\n")
        os._exit(127)


def probe() -> str | None:
    """None when a jail can be built on this host, else why not (run once per worker process)."""
    import subprocess
    import tempfile

    if disabled():
        return f"sandbox off (KOPT_SANDBOX=off, {ESCAPE_HATCH}=1): candidates run with the worker's rights"
    with tempfile.TemporaryDirectory(prefix="kopt-jail-probe-") as scratch:
        try:
            out = subprocess.run(command(JailSpec(scratch=scratch, env={"PATH": "/usr/bin:/bin"}), ["true"]),
                                 capture_output=True, text=True, env=launcher_env(), timeout=60)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the jail probe did not run: {exc}"
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["no output"])[-1]


def launcher_env() -> dict[str, str]:
    """The environment of `python -m containment.jail` itself: enough to import kopt, nothing secret."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "LANG": "C.UTF-8"}


def command(spec: JailSpec, argv: list[str], seccomp_profile: str | None = "tool") -> list[str]:
    """The argv that runs `argv` inside a jail of `spec`."""
    extra = ["--seccomp", seccomp_profile] if seccomp_profile else []
    return [sys.executable, "-m", "containment.jail", spec.to_json(), *extra, "--", *argv]


if __name__ == "__main__":
    main(sys.argv[1:])
