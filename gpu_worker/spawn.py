"""Process mechanics of one harness child: spawn, feed, watch, time out, kill, read (no torch).

The child gets its job and the per-job key on stdin and a pipe for authenticated frames; its
stdout and stderr go to a log file that is read only for a human-readable tail. It runs in a new
session (its own process group), which is killed on timeout, on cancellation, and after it exits
(anything still in the group then was forked by the candidate and is reported).

Children are forked by a zygote that has imported torch once (zygote.py), saving the ~1.5 s import
per job; KOPT_HARNESS_ZYGOTE=0 (or a job whose kernel hosts run under compute-sanitizer) execs a fresh
interpreter instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from containment import jail
from containment.procs import kill_group
from gpu_worker.protocol import FrameReader, HarnessJob, arena_bytes, encode_stdin
from gpu_worker.sandbox import PASSED_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_S = 5.0
# The job's folder and log, whose paths the child can read (its scratch is bound at its own path; its
# stdout is the log): named alike for every mode and tool, so a kernel cannot tell the test from the timing
# or a sanitizer run by them (red team, 2026-11-26: readlink of /proc/self/fd/1 said "test.log").
WORKDIR_PREFIX = "kopt-job-"
TAIL_BYTES = 2048
READ_GRACE_S = 5.0
ZYGOTE_START_S = 120.0

Heartbeat = Callable[[str], None]


@dataclass(frozen=True)
class Outcome:
    returncode: int | None
    timed_out: bool
    timeout_s: float
    frames: FrameReader
    log: str  # the end of the child's stdout + stderr
    leftover: bool  # a process of the child's group outlived it




# The GPU (nvidia-smi index) that the harness children started from this task use, where one worker
# process drives several GPUs with one exec worker each (frontend/workers.py); None: the process's own
# CUDA_VISIBLE_DEVICES. A context variable: each activity runs in its own task.
VISIBLE_GPU: ContextVar[int | None] = ContextVar("kopt_visible_gpu", default=None)


def harness_env(home: str = "/tmp", task_gpu: bool = True) -> dict[str, str]:
    """The whole environment of a harness child (and of the zygote, `task_gpu` False): explicit and
    minimal."""
    env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    gpu = VISIBLE_GPU.get() if task_gpu else None
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return {
        **env,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONFAULTHANDLER": "1",  # a Python stack in the log when the kernel segfaults
        "PYTHONUNBUFFERED": "1",  # log lines reach the file before a crash
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def jail_spec(job: HarnessJob, scratch: Path) -> jail.JailSpec:
    """The sandbox of one harness child: the job's libraries and package read-only, `scratch` the
    only writable place, the GPU's device nodes for CUDA jobs."""
    paths = [job.library, job.package_dir, *([job.baseline_library] if job.baseline_library else []), *job.tool_paths]
    # CPU: the judge sizes its shared buffer arena (a memfd: RLIMIT_FSIZE counts it) before it lowers
    # the limit to sandbox.FSIZE_LIMIT, as every kernel host does before its library loads.
    fsize = jail.JailSpec.file_size_mb + (arena_bytes(job.memory_limit_mb) >> 20 if job.target == "cpu" else 0)
    return jail.JailSpec(scratch=str(scratch), read_only=tuple(paths), env=harness_env(str(scratch)),
                         gpu=job.target == "cuda", file_size_mb=fsize)  # fmt: skip


async def spawn(
    job: HarnessJob,
    key: bytes,
    workdir: Path,
    timeout_s: float,
    heartbeat: Heartbeat | None,
    on_partial: Callable[[str], None] | None = None,
) -> Outcome:
    """Run one harness child (a fresh `python -m gpu_worker.harness FD` where the zygote is off or
    the job's kernel hosts run under a tool, job.host_prefix) to completion or timeout. `on_partial`
    gets the body of each authenticated partial frame (a finished piece of the job) as it arrives."""
    log_path = workdir / "job.log"  # outside the scratch: the child sees it only as its stdout
    scratch = workdir / "scratch"
    scratch.mkdir(exist_ok=True)
    spec = jail_spec(job, scratch)
    frames = FrameReader(key=key, on_partial=on_partial)
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    transport = child = read_task = wait_task = None
    try:
        tool = bool(job.host_prefix)
        # Unsandboxed, a zygote child keeps the zygote's environment: a task's own GPU needs a fresh one.
        fresh = tool or (jail.disabled() and VISIBLE_GPU.get() is not None)
        zygote = await asyncio.to_thread(ZygoteClient.shared) if not fresh else None
        with open(log_path, "wb") as log:
            if zygote is not None:
                child = await _ZygoteChild.start(zygote, w, log.fileno(), spec)
            else:
                child = await _ExecChild.start(tool, w, log, scratch, spec)
        os.close(w)
        w = -1
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", buffering=0)
        )
        r = -1  # owned by the transport now
        read_task = asyncio.create_task(_read(reader, frames))
        wait_task = asyncio.create_task(child.wait())
        await child.feed(encode_stdin(key, job))
        timed_out = await _wait(wait_task, timeout_s, heartbeat, job, frames)
        leftover = False
        if timed_out:
            kill_group(child.pid)
            await wait_task
        else:
            leftover = kill_group(child.pid)  # anything left was forked by the kernel
        # EOF comes once every holder of the write end is gone; bound the wait in case one escaped.
        try:
            await asyncio.wait_for(read_task, timeout=READ_GRACE_S)
        except asyncio.TimeoutError:
            pass
        frames.close()
        return Outcome(child.returncode, timed_out, timeout_s, frames, _read_end(log_path), leftover)
    finally:
        # Runs on cancellation too: never leave a candidate running behind a cancelled activity.
        if child is not None and child.returncode is None:
            kill_group(child.pid)
        for task in (read_task, wait_task):
            if task is not None and not task.done():
                task.cancel()
        if transport is not None:
            transport.close()
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


TOOL_LOG = "tool.log"  # every tool's log has this one name: a kernel that lists its scratch learns nothing


async def spawn_under_tool(make_job: Callable[[Path], HarnessJob], key: bytes, timeout_s: float,
                           heartbeat: Heartbeat | None) -> tuple[Outcome, str]:  # fmt: skip
    """Run a harness child whose kernel hosts run under a tool (compute-sanitizer, ncu): the tool writes
    its log in the jail's scratch, the one place it can write. `make_job(log_path)` gives the job with
    the tool's prefix naming that path. Returns the spawn's outcome and the log's text ("" where the
    tool wrote none); the folder is removed."""
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    try:
        (workdir / "scratch").mkdir()
        log_path = workdir / "scratch" / TOOL_LOG
        out = await spawn(make_job(log_path), key, workdir, timeout_s, heartbeat)
        return out, log_path.read_text(errors="replace") if log_path.is_file() else ""
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _ExecChild:
    """A fresh interpreter: `python -m gpu_worker.harness FD`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def start(cls, tool: bool, result_w: int, log, scratch: Path, spec: jail.JailSpec) -> _ExecChild:
        argv = [sys.executable, "-m", "gpu_worker.harness", str(result_w)]
        if not jail.disabled():
            # A tool the kernel hosts run under (compute-sanitizer) forks and execs: the jail's tool
            # profile holds it; a bare harness installs the stricter harness profile itself.
            argv = jail.command(spec, argv, seccomp_profile="tool" if tool else None)
        proc = await asyncio.create_subprocess_exec(
            *argv, pass_fds=(result_w,), start_new_session=True, cwd=scratch, env=spec.env,
            stdin=asyncio.subprocess.PIPE, stdout=log, stderr=log,
        )  # fmt: skip
        return cls(proc)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    async def feed(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child died before reading its job; its exit status says why
        finally:
            self.proc.stdin.close()


class _ZygoteChild:
    """A child forked by the zygote; its exit status comes back over the control socket."""

    def __init__(self, pid: int, stdin_w: int, exited: concurrent.futures.Future) -> None:
        self.pid, self.stdin_w, self.exited = pid, stdin_w, exited
        self.returncode: int | None = None

    @classmethod
    async def start(cls, zygote: ZygoteClient, result_w: int, log_fd: int, spec: jail.JailSpec) -> _ZygoteChild:
        stdin_r, stdin_w = os.pipe()
        try:
            pid = await asyncio.to_thread(zygote.launch, [stdin_r, result_w, log_fd], spec)
        except BaseException:
            os.close(stdin_w)
            raise
        finally:
            os.close(stdin_r)
        return cls(pid, stdin_w, zygote.exit_future(pid))

    async def wait(self) -> int:
        self.returncode = await asyncio.wrap_future(self.exited)
        return self.returncode

    async def feed(self, data: bytes) -> None:
        def write_all() -> None:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.stdin_w, view):]
            except (BrokenPipeError, OSError):
                pass  # the child died before reading its job; its exit status says why
            finally:
                os.close(self.stdin_w)

        await asyncio.to_thread(write_all)


class ZygoteError(RuntimeError):
    """The zygote died or did not start (an infrastructure fault: the activity is retried)."""


class ZygoteClient:
    """Runner side of the zygote: one per worker process, shared by every event loop in it."""

    _instance: ZygoteClient | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_worker.zygote", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            env=harness_env(task_gpu=False), cwd="/", stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        theirs.close()
        self.sock = mine
        self.send_lock = threading.Lock()
        self.pids: queue.Queue[int] = queue.Queue()
        self.exits: dict[int, concurrent.futures.Future] = {}
        self.exits_lock = threading.Lock()
        self.dead = False
        mine.settimeout(ZYGOTE_START_S)
        try:
            ready = mine.recv(6)
        except OSError:
            ready = b""
        if ready != b"ready\n":
            self.close()
            raise ZygoteError("the harness zygote did not start")
        mine.settimeout(None)
        threading.Thread(target=self._read, name="kopt-zygote-reader", daemon=True).start()

    @classmethod
    def shared(cls) -> ZygoteClient | None:
        if os.environ.get("KOPT_HARNESS_ZYGOTE", "1") == "0":
            return None
        with cls._guard:
            if cls._instance is None or cls._instance.dead:
                cls._instance = cls()
            return cls._instance

    def launch(self, fds: list[int], spec: jail.JailSpec) -> int:
        body = b"" if jail.disabled() else spec.to_json().encode()
        with self.send_lock:
            if self.dead:
                raise ZygoteError("the harness zygote died")
            socket.send_fds(self.sock, [b"J" + len(body).to_bytes(4, "big")], fds)
            self.sock.sendall(body)
            try:
                pid = self.pids.get(timeout=ZYGOTE_START_S)
            except queue.Empty:
                raise ZygoteError("the harness zygote did not answer") from None
        if pid < 0:
            raise ZygoteError("the harness zygote refused the job")
        return pid

    def exit_future(self, pid: int) -> concurrent.futures.Future:
        with self.exits_lock:
            return self.exits.setdefault(pid, concurrent.futures.Future())

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                kind, *nums = line.decode().split()
                if kind == "pid":
                    self.pids.put(int(nums[0]))
                elif kind == "exit":
                    fut = self.exit_future(int(nums[0]))
                    if not fut.done():
                        fut.set_result(int(nums[1]))
        self.dead = True
        self.pids.put(-1)
        with self.exits_lock:
            for fut in self.exits.values():
                if not fut.done():
                    fut.set_exception(ZygoteError("the harness zygote died while a job ran"))

    def close(self) -> None:
        self.dead = True
        try:
            self.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


async def _read(reader: asyncio.StreamReader, frames: FrameReader) -> None:
    while chunk := await reader.read(1 << 16):
        frames.feed(chunk)


async def _wait(
    wait_task: asyncio.Task, timeout_s: float, heartbeat: Heartbeat | None, job: HarnessJob, frames: FrameReader
) -> bool:
    """Wait for the child, heartbeating every HEARTBEAT_S; True when the timeout passed first."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return True
        done, _ = await asyncio.wait({wait_task}, timeout=min(HEARTBEAT_S, remaining))
        if done:
            return False
        if heartbeat is not None:
            step = f", {frames.last_step}" if frames.last_step else ""
            heartbeat(f"{job.mode} {job.candidate_id}: running for {loop.time() - start:.0f} s{step}")


def _read_end(path: Path) -> str:
    """The last few KB of the child's output (enough for a stderr tail)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8 * TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""

