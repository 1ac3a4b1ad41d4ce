"""The judge's side of the kernel hosts: a shared arena for kernel-visible buffers, and kernels
that run in a host process of their own (docs/decisions/0014-judge-and-kernel-hosts.md).

The judge (the harness process) keeps everything a verdict rests on in its private memory: the
key, the pristine inputs, the references, the checks, the clock and the result. The only memory a
kernel host shares with it is the Arena (a sealed memfd): the buffers a call reads and writes.
A RemoteKernel is called like abi.Kernel; the judge times the round trip with its own clock and
subtracts the no-op round trip (Hosts), so no number the host reports is believed; Hosts also checks that no host works outside its calls.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import mmap
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import weakref

import torch

from gpu_worker.abi import KOPT_DTYPES, KernelFailure, Packed
from gpu_worker.kernel_host import CALL, PACK_HEAD, REPLY, TENSOR_HEAD
from gpu_worker.sandbox import FSIZE_LIMIT
from kopt.seccomp import KILLED_REASON

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where gpu_worker/ and kopt/ are
ALIGN = 256
LOAD_TIMEOUT_S = 120.0
CLOSE_WAIT_S = 2.0
PINGS_KEPT = 64  # no-op round trips the overhead estimate is the median of
# A host's CPU time over a block must fit in the block's call round trips, plus what an honest host
# spends after each reply on its way back into recv() and a little for the accounting's edges.
IDLE_PER_CALL_NS = 25_000
IDLE_SLACK_NS = 200_000


class Arena:
    """A sealed memfd mapped here and in every kernel host; first-fit allocation of tensors in it."""

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.fd = os.memfd_create("kopt-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, nbytes)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.mm = mmap.mmap(self.fd, nbytes)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted by offset

    def tensor(self, count: int, dtype: torch.dtype, owner: object) -> torch.Tensor:
        """`count` elements of `dtype` in the arena, given back when `owner` is collected."""
        nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
        length = -(-nbytes // ALIGN) * ALIGN
        for i, (off, free_len) in enumerate(self.free):
            if free_len >= length:
                if free_len == length:
                    del self.free[i]
                else:
                    self.free[i] = (off + length, free_len - length)
                weakref.finalize(owner, self._release, off, length)
                return torch.frombuffer(self.mm, dtype=dtype, count=count, offset=off)
        raise MemoryError(f"kernel buffer arena full ({self.size >> 20} MiB): shapes too large for the memory limit")

    def _release(self, off: int, length: int) -> None:
        i = bisect.bisect(self.free, (off, length))
        self.free.insert(i, (off, length))
        if i + 1 < len(self.free) and off + length == self.free[i + 1][0]:  # merge with the next
            self.free[i] = (off, length + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == self.free[i][0]:  # and the previous
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]

    def offset_of(self, ptr: int, nbytes: int) -> int:
        off = ptr - self.base
        if not (0 <= off and off + nbytes <= self.size):
            raise RuntimeError("harness bug: a kernel buffer outside the shared arena")
        return off


class Hosts:
    """The judge's kernel hosts together: each host's no-op round trip (median of its last
    PINGS_KEPT: the two hosts of an A/B are scheduled differently enough that one shared figure
    tilted the ratio by a few percent) and the idle check over all of them (a host busy during the
    other host's calls would slow those down)."""

    def __init__(self) -> None:
        self.rts: dict[int, collections.deque[float]] = {}  # host serial -> its last no-op round trips
        self.members: list[RemoteKernel] = []

    def calibrate(self, kernel: RemoteKernel, n: int) -> None:
        kept = self.rts.setdefault(kernel.serial, collections.deque(maxlen=PINGS_KEPT))
        for _ in range(n):
            kept.append(kernel.ping())

    def overhead_us(self, kernel: RemoteKernel) -> float:
        kept = self.rts.get(kernel.serial)
        return statistics.median(kept) if kept else 0.0

    def cpu(self) -> dict[int, int | None]:
        return {h.serial: h.cpu_ns() for h in self.members}

    def check_idle(self, before: dict[int, int | None], caller: RemoteKernel, calls_ns: int, calls: int) -> None:
        """A host is blocked on its socket except while it answers: over a block of `calls` calls to
        `caller` (round trips summing to calls_ns), the caller may use about that much CPU and every
        other host none. More means a host kept working between calls (on the next inputs as the
        judge wrote them, say) or during the other's calls (taking the core from it), outside the
        checked and timed region."""
        after = self.cpu()
        for host in self.members:
            b, a = before.get(host.serial), after.get(host.serial)
            if a is None or b is None:
                continue
            mine = host is caller
            allowed = (calls_ns + calls * IDLE_PER_CALL_NS if mine else 0) + IDLE_SLACK_NS
            if a - b > allowed:
                host.close()
                during = "between its calls" if mine else f"during the {caller.role}'s calls"
                raise KernelFailure(f"{host.role}: used {(a - b) / 1e6:.2f} ms of CPU over a block whose "
                                    f"{caller.role} calls took {calls_ns / 1e6:.2f} ms: it works {during}, "
                                    "outside the checked and timed region")  # fmt: skip


class RemoteKernel:
    """One library in its own kernel host; called like abi.Kernel: kernel(packed) -> rc."""

    _ids = 0

    def __init__(self, library: str, entry: str, role: str, arena: Arena, memory_limit_mb: int, hosts: Hosts) -> None:
        self.role, self.arena = role, arena
        RemoteKernel._ids += 1
        self.serial = RemoteKernel._ids  # names this host in the packs registered with it
        self.last_rt_ns = 0
        self._forgotten: list[int] = []
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        # The interpreter's real file (a venv's bin/python may be a link the jail does not show) and no
        # site (the host imports only kopt's own torch-free modules, found through PYTHONPATH).
        argv = [os.path.realpath(sys.executable), "-S", "-m", "gpu_worker.kernel_host", str(theirs.fileno()), str(arena.fd),
                str(arena.size), library, entry, role, str(memory_limit_mb)]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(), arena.fd), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.sock.settimeout(LOAD_TIMEOUT_S)
        try:
            first = self.sock.recv(4096)
        except TimeoutError:
            self.close()
            raise KernelFailure(f"{role}: its library did not finish loading in {LOAD_TIMEOUT_S:g} s") from None
        self.sock.settimeout(None)
        if first.startswith(b"E"):
            self.close()
            raise KernelFailure(first[1:].decode(errors="replace"))
        if first != b"R":
            raise KernelFailure(self._died())
        hosts.members.append(self)

    def _died(self) -> str:
        """Why the host stopped answering, from its exit status, worded as the parent words the death
        of a harness (the judge adds the step it was at; a baseline's death is named as such)."""
        who = "" if self.role == "candidate" else f"{self.role}: "
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.close()
            return f"{who}the kernel process closed its connection to the judge"
        if rc == -signal.SIGSYS:
            return f"{who}killed by the sandbox: {KILLED_REASON}"
        if rc == -signal.SIGXFSZ:
            return f"{who}killed: wrote more than {FSIZE_LIMIT >> 20} MiB to stdout/stderr"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"{who}crashed: {name}"
        return f"{who}kernel process exited with code {rc} without answering (does the kernel call exit()?)"

    def _send(self, data: bytes) -> None:
        try:
            while self._forgotten:
                self.sock.send(b"F" + CALL.pack(self._forgotten.pop()))
            self.sock.send(data)
        except OSError:
            raise KernelFailure(self._died()) from None

    def _reply(self) -> tuple[int, int]:
        try:
            msg = self.sock.recv(64)
        except OSError:
            msg = b""
        if len(msg) != REPLY.size:
            if msg:
                self.close()
                raise KernelFailure(f"{self.role}: broke the kernel host's protocol during a call")
            raise KernelFailure(self._died())
        return REPLY.unpack(msg)

    def _register(self, packed: Packed) -> int:
        ids = packed.__dict__.setdefault("remote_ids", {})
        if self.serial in ids:
            return ids[self.serial]
        RemoteKernel._ids += 1
        pack_id = RemoteKernel._ids
        body = [b"P", PACK_HEAD.pack(pack_id, packed.n)]
        for t in packed.tensors:
            extent = (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0
            body.append(TENSOR_HEAD.pack(self.arena.offset_of(t.data_ptr(), extent), KOPT_DTYPES[t.dtype], t.dim()))
            body.append(struct.pack(f"<{2 * t.dim()}q", *t.shape, *t.stride()))
        self._send(b"".join(body))
        ids[self.serial] = pack_id
        weakref.finalize(packed, self._forgotten.append, pack_id)
        return pack_id

    def __call__(self, packed: Packed, stream: int | None = None) -> int:
        message = b"C" + CALL.pack(self._register(packed))
        t0 = time.perf_counter_ns()
        self._send(message)
        rc, host_ns = self._reply()
        self.last_rt_ns = time.perf_counter_ns() - t0
        if host_ns > self.last_rt_ns:
            self.close()
            raise KernelFailure(f"{self.role}: the kernel process reported a call of {host_ns} ns that the judge "
                                f"timed at {self.last_rt_ns} ns (a forged clock)")  # fmt: skip
        return rc

    def cpu_ns(self) -> int | None:
        """CPU time the host has used so far (ns, /proc/PID/schedstat); None where not available."""
        try:
            with open(f"/proc/{self.proc.pid}/schedstat", "rb") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def ping(self) -> float:
        """One no-op round trip, in microseconds."""
        t0 = time.perf_counter_ns()
        self._send(b"N")
        self._reply()
        return (time.perf_counter_ns() - t0) / 1e3

    def close(self) -> None:
        """Close the socket (a host in its loop exits on that) and wait for the host to go; kill it
        where it does not and this process may still send signals (under the judge's seccomp it may
        not: the jail's end takes the host, and without a jail the parent reports it as left over)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=CLOSE_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            self.proc.kill()
            self.proc.wait(timeout=CLOSE_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
