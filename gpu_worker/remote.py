"""The judge's side of the kernel hosts: shared memory for kernel-visible buffers, and kernels that
run in a host process of their own (docs/decisions/0014-judge-and-kernel-hosts.md, 0015 for CUDA).

The judge (the harness process) keeps everything a verdict rests on in its private memory: the
key, the pristine inputs, the references, the checks, the clock and the result. The only memory a
kernel host shares with it holds the buffers a call reads and writes: the Arena (CPU, a sealed
memfd) or the CudaArena (device-memory segments exported as descriptors). A RemoteKernel is called
like abi.Kernel; the judge times the round trip with its own clock less the no-op round trip
(Hosts): on CPU that is the sample, on CUDA it checks the host's event reading. Hosts also checks
that no host works outside its calls.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import fcntl
import mmap
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from containment.seccomp import KILLED_REASON
from gpu_worker.abi import KOPT_DTYPES, KernelFailure, Packed, error_message
from gpu_worker.kernel_host import (BURST, CALL, EMPTY, FP_MODE_CHANGED, MODE, PACK_HEAD, REPLY, SEGMENT,
                                    SEGMENT_SHIFT, TENSOR_HEAD, X87_IN_USE, FpMode, Hello, Op)  # fmt: skip
from gpu_worker.sandbox import FSIZE_LIMIT, PASSED_ENV

T = TypeVar("T")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where gpu_worker/ and kopt/ are
ALIGN = 256
LOAD_TIMEOUT_S = 120.0
CLOSE_WAIT_S = 2.0
TOOL_CLOSE_WAIT_S = 60.0  # a host under a tool (compute-sanitizer): its summary is written at the exit
PINGS_KEPT = 64  # no-op round trips the overhead estimate is the median of
# A host's CPU time over a block must fit in the block's call round trips, plus what an honest host
# spends after each reply on its way back into recv() and a little for the accounting's edges.
IDLE_PER_CALL_NS = 25_000
IDLE_SLACK_NS = {"cpu": 200_000, "cuda": 1_000_000}  # the CUDA driver's own threads wake now and then
# ... and more often the longer a block: a CUDA host idle through a 100 ms block of the other's calls was
# charged 1.2 ms (merge_attn_states_lse at T=1 on an H100, a block of thousands of calls). A host working
# during the other's calls takes most of the block, not a few percent of it.
IDLE_SLACK_SHARE = {"cpu": 0.0, "cuda": 0.03}
# A CPU-time reading waits (this long at most) for every host to block on its socket: a host still on
# its way back from a reply to its receive has not been charged for that slice yet (the kernel charges
# a running thread when it stops), so the charge, tens of microseconds, would land in the next block,
# perhaps another kernel's. A host still running after the wait is read as it is.
SETTLE_S = 0.02
SETTLE_POLL_S = 50e-6
# The clock check, in us. A cold call's round trip holds the device's switch from the judge's context
# to the host's, and that switch is bimodal on an H100: the no-op round trip after a flush is either
# about 45 or about 230 us, and which one shifts during a shape (one host's no-op median went from 52
# to 236 within a shape). A gap taken against each host's own no-op median therefore moved by up to
# ~190 us between two honest hosts: an A/A of fused_add_rmsnorm failed as "forged" (93 us over the
# baseline's at one shape). Against the baseline, the shape check compares the two hosts' raw
# (round trip less reading) per call, taken interleaved through the same switches, no no-op at all,
# by their trimmed means (a median of a two-mode mixture jumps between the modes; a mean moves with
# the mixture's weights, by a few us over hundreds of calls): in 4 A/A evaluations of the three
# Astra kernels on an H100 (block medians) the candidate's exceeded the baseline's by at most 12 us.
# A host that under-reports a share p of its calls by d us moves it by about p*d. A block is held to
# a gross bound against the no-op; one that misses it is taken again (a whole block once took 3 ms a
# call longer in an A/A of silu_and_mul), and only
# BLOCK_RETAKES misses in a row are a forgery. docs/decisions/0015.
CLOCK_SLACK_US = 40.0  # candidate's shape figure over the baseline's (plus CLOCK_SLACK_FRACTION)
CLOCK_TRIM = 0.1  # the share of calls left out at each end of the trimmed means (stalls, stragglers)
LONE_CLOCK_SLACK_US = 120.0  # shape median without a baseline, against the no-op
CLOCK_SLACK_FRACTION = 0.05
BLOCK_CLOCK_SLACK_US = 1000.0  # any block's median, a gross bound (plus BLOCK_CLOCK_SLACK_FRACTION)
BLOCK_CLOCK_SLACK_FRACTION = 1.0
RETAKEN = {"clock": "the judge's clock disagreed grossly",
           "idle": "a host used CPU outside the calls",
           "shape": "the shape's clock check failed: that timing dropped"}
MAX_DROPPED_NOTES = 4  # shape timings dropped (SHAPE_RETAKES) whose reason the notes give
SHAPE_RETAKES = 2  # a shape whose clock check fails is timed again, at most this often (clock_checked_shape)
BLOCK_RETAKES = 2  # a block that misses the gross bound or the idle check is taken again, at most this often
SEGMENT_BYTES = 1 << 30  # CUDA: the smallest device-memory segment the arena adds for "plain" buffers
# CUDA: buffers of at least this many bytes are always fenced (a segment of their own, rounded up to the
# 2 MiB granule, in timing as in tests); smaller test buffers by a coin toss (Placement).
FENCE_MIN_BYTES = 1 << 20
PAGE = mmap.PAGESIZE
CUDA_ERROR_ILLEGAL_ADDRESS = 700


class CaptureFailed(Exception):
    """A kernel that cannot be captured in a CUDA graph (it synchronizes or allocates in the call)."""


class Region:
    """First-fit allocation of ALIGN-rounded blocks in [0, size)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset

    def take(self, length: int) -> int | None:
        for i, (off, free_len) in enumerate(self.free):
            if free_len >= length:
                if free_len == length:
                    del self.free[i]
                else:
                    self.free[i] = (off + length, free_len - length)
                return off
        return None

    def give_back(self, off: int, length: int) -> None:
        i = bisect.bisect(self.free, (off, length))
        self.free.insert(i, (off, length))
        if i + 1 < len(self.free) and off + length == self.free[i + 1][0]:  # merge with the next
            self.free[i] = (off, length + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == self.free[i][0]:  # and the previous
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]


def _length(count: int, dtype: torch.dtype) -> int:
    nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
    return -(-nbytes // ALIGN) * ALIGN


def _bytes(count: int, dtype: torch.dtype) -> int:
    return count * torch.empty((), dtype=dtype).element_size()


class Placement:
    """Where a buffer's end lies (docs/decisions/0029-buffers-against-unmapped-memory.md):
    - "fence": its storage ends where unmapped memory begins (the arena's job), so an access a byte
      past the poisoned tail faults;
    - "plain": in shared memory among other buffers, with poisoned guards on each side;
    - "roomy": poisoned room on each side as large as the buffer and at least cases.ROOM_BYTES: the
      other arguments of a job that looks for the argument a fault came through (`fence_only`).
    CPU: every buffer is fenced. CUDA: buffers of FENCE_MIN_BYTES or more, in tests and timing alike;
    smaller test buffers (pools "candidate", "baseline") each by a coin toss, smaller timing buffers
    never (a granule of device memory each would not fit thousands of graph slots). The toss keeps a
    kernel from taking "my buffer ends at a granule" for "I am being tested": half its test calls
    look like timing calls, and are checked all the same."""

    fence_only: str | None = None  # set for such a job: only this argument is fenced ("": none), the others roomy
    fence_min_bytes = 0
    coin = random.SystemRandom()

    def placement(self, name: str, nbytes: int, pool: str = "shared") -> str:
        if self.fence_only is not None:
            return "fence" if name == self.fence_only else "roomy"
        if nbytes >= self.fence_min_bytes or (pool != "shared" and self.coin.getrandbits(1)):
            return "fence"
        return "plain"


class Arena(Placement):
    """CPU: a sealed memfd mapped here and in every kernel host (segment 0); first-fit allocation of
    whole pages, each buffer's storage ending at a page end. A host opens only the pages of its own
    packs (kernel_host.CpuPages), so the page after a fenced buffer, never part of any buffer, faults
    in every host; so does memory of the other host's buffers."""

    target = "cpu"

    def __init__(self, nbytes: int) -> None:
        self.size = nbytes
        self.fd = os.memfd_create("kopt-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, nbytes)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.mm = mmap.mmap(self.fd, nbytes)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.region = Region(nbytes)
        self.live: dict[int, int] = {}  # allocation offset -> its bytes without the fence page
        self.starts: list[int] = []  # the offsets of self.live, sorted

    @property
    def spawn(self) -> tuple[str, tuple[int, ...]]:
        """(the host's ARENA argument, descriptors it inherits)."""
        return f"{self.fd}:{self.size}", (self.fd,)

    def tensor(self, count: int, dtype: torch.dtype, owner: object, pool: str = "shared",
               fence: bool = False) -> torch.Tensor:  # fmt: skip
        """`count` elements of `dtype` ending at a page end (and, `fence`, followed by a page no
        buffer uses), given back when `owner` is collected. (`pool` is CUDA's: here a host maps the
        pages of its own packs only.)"""
        nbytes = _bytes(count, dtype)
        body = -(-max(nbytes, 1) // PAGE) * PAGE
        length = body + (PAGE if fence else 0)
        off = self.region.take(length)
        if off is None:
            raise MemoryError(f"kernel buffer arena full ({self.size >> 20} MiB): shapes too large for the memory limit")
        self.live[off] = body
        bisect.insort(self.starts, off)
        weakref.finalize(owner, self._give_back, off, length)
        return torch.frombuffer(self.mm, dtype=dtype, count=count, offset=off + body - nbytes)

    def _give_back(self, off: int, length: int) -> None:
        del self.live[off]
        del self.starts[bisect.bisect_left(self.starts, off)]
        self.region.give_back(off, length)

    def allocation(self, where: int, nbytes: int) -> tuple[int, int]:
        """(offset, bytes) of the live allocation that holds [where, where + nbytes): the pages a host
        opens for a tensor there (its guards and room included, its fence page not)."""
        i = bisect.bisect_right(self.starts, where) - 1
        if i < 0 or where + nbytes > self.starts[i] + self.live[self.starts[i]]:
            raise RuntimeError("harness bug: a kernel buffer outside every live allocation")
        return self.starts[i], self.live[self.starts[i]]

    def offset_of(self, ptr: int, nbytes: int) -> int:
        off = ptr - self.base
        if not (0 <= off and off + nbytes <= self.size):
            raise RuntimeError("harness bug: a kernel buffer outside the shared arena")
        return off

    def segments(self) -> list[tuple[int, int, int]]:
        return []


class _CudaSegment:
    """A segment of device memory seen by torch (judge side) through __cuda_array_interface__."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                         "version": 2}


@dataclass
class Segment:
    ptr: int
    size: int
    fd: int
    region: Region
    whole: torch.Tensor  # the segment's bytes, as the judge's torch sees them
    pool: str
    fenced: bool  # holds one buffer at a time, at its end (hosts map a segment with an unmapped granule after it)


class CudaArena(Placement):
    """CUDA: segments of device memory (cuMemCreate), each exported as a descriptor that RemoteKernel
    hands to its host before the first pack that uses it. "plain" buffers: first-fit inside shared
    segments (at least SEGMENT_BYTES each). "fence" buffers: one at a time in a segment of their
    own, at its end; a host maps every segment with a reserved, unmapped granule after it. The
    judge's other device memory (pristine inputs, references) is in its own allocations, in a
    context no host can reach."""

    target = "cuda"
    fence_min_bytes = FENCE_MIN_BYTES

    def __init__(self, device: torch.device) -> None:
        from gpu_worker import cuda_driver

        self.driver = cuda_driver
        self.device = device
        self.ordinal = device.index or 0
        self.gran = cuda_driver.granularity(self.ordinal)
        self.segs: list[Segment] = []

    @property
    def spawn(self) -> tuple[str, tuple[int, ...]]:
        return f"cuda:{self.ordinal}", ()

    def tensor(self, count: int, dtype: torch.dtype, owner: object, pool: str = "shared",
               fence: bool = False) -> torch.Tensor:  # fmt: skip
        """`count` elements in a segment of `pool`: "candidate" and "baseline" segments hold the buffers
        of one host's test calls, and a host maps only the segments its calls use, so no kernel can
        reach the other's buffers (a candidate's kernel left running after its call could otherwise
        spoil the baseline's guards and have every check the baseline "fails" skipped); "shared" holds
        the A/B slots both hosts are timed on. `fence`: at the end of a segment of its own."""
        nbytes = _bytes(count, dtype)
        if fence:
            free = [g for g in self.segs if g.fenced and g.pool == pool and g.size >= nbytes and g.region.free]
            seg = min(free, key=lambda g: g.size) if free else self._new(-(-max(nbytes, 1) // self.gran) * self.gran,
                                                                        pool, True)  # fmt: skip
            seg.region.take(seg.size)
            weakref.finalize(owner, seg.region.give_back, 0, seg.size)
            return seg.whole[seg.size - nbytes:].view(dtype)
        length = _length(count, dtype)
        for seg in self.segs:
            off = seg.region.take(length) if seg.pool == pool and not seg.fenced else None
            if off is not None:
                break
        else:
            seg = self._new(-(-max(length, SEGMENT_BYTES) // self.gran) * self.gran, pool, False)
            off = seg.region.take(length)
        weakref.finalize(owner, seg.region.give_back, off, length)
        return seg.whole[off : off + nbytes].view(dtype)

    def new_bytes(self, nbytes: int, pool: str) -> int:
        """Device memory a fenced buffer of `nbytes` in `pool` would add (none where a free segment fits it)."""
        if any(g.fenced and g.pool == pool and g.size >= nbytes and g.region.free for g in self.segs):
            return 0
        return -(-max(nbytes, 1) // self.gran) * self.gran

    def _new(self, size: int, pool: str, fenced: bool) -> Segment:
        torch.cuda.synchronize(self.device)  # torch has made its context current on this thread
        ptr, fd = self.driver.create_segment(size, self.ordinal)
        seg = Segment(ptr, size, fd, Region(size), torch.as_tensor(_CudaSegment(ptr, size), device=self.device), pool,
                      fenced)  # fmt: skip
        self.segs.append(seg)
        return seg

    def offset_of(self, ptr: int, nbytes: int) -> int:
        for i, seg in enumerate(self.segs):
            if seg.ptr <= ptr and ptr + nbytes <= seg.ptr + seg.size:
                return i << SEGMENT_SHIFT | (ptr - seg.ptr)
        raise RuntimeError("harness bug: a kernel buffer outside the shared segments")

    def allocation(self, where: int, nbytes: int) -> tuple[int, int]:
        return 0, 0  # a host maps whole segments (the pages of CPU hosts only are opened per pack)

    def segments(self) -> list[tuple[int, int, int]]:
        """(segment id, bytes, descriptor) of every segment so far."""
        return [(i, seg.size, seg.fd) for i, seg in enumerate(self.segs)]


class Hosts:
    """The judge's kernel hosts together: each host's no-op round trip (median of its last
    PINGS_KEPT: the two hosts of an A/B are scheduled differently enough that one shared figure
    tilted the ratio by a few percent) and the idle check over all of them (a host busy during the
    other host's calls would slow those down)."""

    def __init__(self) -> None:
        self.rts: dict[int, collections.deque[float]] = {}  # host serial -> its last no-op round trips
        self.members: list[RemoteKernel] = []
        self.clock_gaps: dict[str, list[float]] = {}  # "role kind" -> block medians of check_clock's gap (us)
        self.shape_gaps: dict[tuple[str, str], list[float]] = {}  # (role, mode) -> each call's gap, this shape
        self.shape_raw: dict[tuple[str, str], list[float]] = {}  # (role, mode) -> round trip less reading
        self.shape_reported: dict[tuple[str, str], list[float]] = {}  # (role, mode) -> each call's reading
        self.retaken: dict[str, int] = {}  # "role kind" or "role idle" -> blocks taken again (RETAKEN)
        self.idle_use: dict[str, float] = {}  # "role (caller|idle)" -> largest share of its spare a block used
        self.dropped_timings: list[str] = []  # why each shape timing the shape clock check dropped

    def calibrate(self, kernel: RemoteKernel, n: int, prepare=None) -> None:
        """n more no-op round trips, each after `prepare()` where the timed calls have the judge's own
        device work before them (CUDA cold mode: the device then switches from the judge's context to
        the host's inside the round trip, a call's as well as a no-op's)."""
        kept = self.rts.setdefault(kernel.serial, collections.deque(maxlen=PINGS_KEPT))
        for _ in range(n):
            if prepare is not None:
                prepare()
            kept.append(kernel.ping())

    def overhead_us(self, kernel: RemoteKernel) -> float:
        kept = self.rts.get(kernel.serial)
        return statistics.median(kept) if kept else 0.0

    def summary(self) -> list[str]:
        """What the clock and idle checks saw (notes of a profile result)."""
        out = []
        roles = {h.serial: h.role for h in self.members}
        for serial, kept in sorted(self.rts.items()):
            if kept:
                out.append(f"{roles.get(serial, serial)}: no-op round trip: median of the last {len(kept)} "
                           f"{statistics.median(kept):.1f} us")  # fmt: skip
        for key, n in sorted(self.retaken.items()):
            role, why = key.rsplit(" ", 1)
            what = "shape(s) timed" if why == "shape" else "block(s) taken"
            out.append(f"{role}: {n} {what} again ({RETAKEN.get(why, RETAKEN['clock'])})")
        out.extend(f"a shape's timing dropped: {why}" for why in self.dropped_timings[:MAX_DROPPED_NOTES])
        for role, gaps in sorted(self.clock_gaps.items()):
            q = sorted(gaps)
            out.append(f"{role}: judge's clock less the host's events, block medians over {len(gaps)} blocks: "
                       f"p10 {q[len(q) // 10]:.1f}, median {q[len(q) // 2]:.1f}, p90 {q[9 * len(q) // 10]:.1f} us")
        for role, use in sorted(self.idle_use.items()):
            out.append(f"{role}: CPU time beyond its calls' round trips: at most {100 * max(use, 0.0):.0f}% "
                       "of the allowance in a block")  # fmt: skip
        return out

    def cpu(self) -> dict[int, int | None]:
        """Each host's CPU time so far, read once every host is blocked (SETTLE_S)."""
        wait_blocked([h.proc.pid for h in self.members], SETTLE_S)
        return {h.serial: h.cpu_ns() for h in self.members}

    def idle_excess(self, before: dict[int, int | None], caller: RemoteKernel, calls_ns: int,
                    calls: int) -> tuple[RemoteKernel, str] | None:  # fmt: skip
        """A host is blocked on its socket except while it answers: over a block of `calls` calls to
        `caller` (round trips summing to calls_ns), the caller may use about that much CPU and every
        other host none. More means a host kept working between calls (on the next inputs as the
        judge wrote them, say) or during the other's calls (taking the core from it), outside the
        checked and timed region: the host that did, and why; None where none did. The block is taken
        again (timing.checked): an honest host is charged more now and then (the kernel charges
        interrupts to whatever runs, IRQ_TIME_ACCOUNTING being off on most distributions' kernels:
        once 0.5 ms over a block of the baseline in CI), a host that works outside its calls is so
        in every block. A host that gained a thread during a call fails at once."""
        after = self.cpu()
        for host in self.members:
            if host.cuda and host.tasks() > host.threads:
                host.close()
                raise KernelFailure(f"{host.role}: started a thread during a call (code outside the calls that "
                                    "are checked and timed)", party=host.role)  # fmt: skip
        for host in self.members:
            b, a = before.get(host.serial), after.get(host.serial)
            if a is None or b is None:
                continue
            mine = host is caller
            target = host.arena.target
            spare = (calls * IDLE_PER_CALL_NS if mine else 0) + IDLE_SLACK_NS[target] \
                + IDLE_SLACK_SHARE[target] * calls_ns
            beyond = a - b - (calls_ns if mine else 0)
            key = f"{host.role} ({'caller' if mine else 'idle'})"
            self.idle_use[key] = max(self.idle_use.get(key, 0.0), beyond / spare)
            if beyond > spare:
                during = "between its calls" if mine else f"during the {caller.role}'s calls"
                return host, (f"{host.role}: used {(a - b) / 1e6:.2f} ms of CPU over a block whose {caller.role} "
                              f"calls took {calls_ns / 1e6:.2f} ms: it works {during}, outside the checked and "
                              "timed region")  # fmt: skip
        return None

    def check_clock(self, kernel: RemoteKernel, kind: str, rts_us: list[float], reported_us: list[float]) -> str | None:
        """CUDA, per block: the host's event readings against the judge's clock; None where they agree,
        else why not (the caller takes the block again, BLOCK_RETAKES times at most: timing.checked). For
        an honest host the round trip of a call less the host's no-op round trip (the same two events
        and wait, without the call) is the events' reading plus a few microseconds of launch; a host
        that reports less than its calls took (its timer patched, events moved) leaves a larger gap.
        In cold mode each round trip also holds the device's switch from the judge's context to the
        host's (see CLOCK_SLACK_US): a block is held to a gross bound here, the shape to a tight one
        (check_clock_shape: against the baseline's, taken alike). A block that agrees joins its shape's."""
        noop = self.overhead_us(kernel)
        gaps = [rt - noop - ev for rt, ev in zip(rts_us, reported_us)]
        gap = statistics.median(gaps)
        self.clock_gaps.setdefault(f"{kernel.role} {kind}", []).append(gap)
        allowed = BLOCK_CLOCK_SLACK_US + BLOCK_CLOCK_SLACK_FRACTION * statistics.median(reported_us)
        if gap > allowed:
            return self._forgery(kernel, gap, allowed, "median over a block")
        key = (kernel.role, kind)
        self.shape_gaps.setdefault(key, []).extend(gaps)
        self.shape_raw.setdefault(key, []).extend(rt - ev for rt, ev in zip(rts_us, reported_us))
        self.shape_reported.setdefault(key, []).extend(reported_us)
        return None

    def retake(self, kernel: RemoteKernel, kind: str) -> None:
        """Count a block taken again: kind is the timing mode (the clock check missed) or "idle"."""
        key = f"{kernel.role} {kind}"
        self.retaken[key] = self.retaken.get(key, 0) + 1

    def begin_shape(self) -> None:
        """Forget the clock figures of the shape timed before (check_clock_shape)."""
        self.shape_gaps, self.shape_raw, self.shape_reported = {}, {}, {}

    def clock_checked_shape(
        self, take: Callable[[], T], kernel: RemoteKernel, baseline: RemoteKernel | None, label: str = "shape"
    ) -> T:
        """take() times one shape (every block through check_clock); its result once the shape's clock
        check passes over that timing (check_clock_shape). A timing that fails it is dropped and the
        shape timed again, SHAPE_RETAKES times at most: an honest host whose calls met more of the
        device's slow context switches than the baseline's by chance passes a later timing; a forger
        fails each one. Failing every timing fails the host. The readings the verdict uses always come
        from a timing that passed the check by itself."""
        for attempt in range(1 + SHAPE_RETAKES):
            self.begin_shape()
            out = take()
            why = self.check_clock_shape(kernel, baseline)
            if why is None:
                return out
            if attempt < SHAPE_RETAKES:
                self.retake(kernel, "shape")
                self.dropped_timings.append(f"{label}: {why}")
        self.reject(kernel, f"{why}, in each of {1 + SHAPE_RETAKES} timings of the shape")
        raise AssertionError("unreachable")  # reject() raises

    def check_clock_shape(self, kernel: RemoteKernel, baseline: RemoteKernel | None) -> str | None:
        """Over the shape's blocks so far (all of one mode), the candidate's round trip less reading
        (trimmed mean over its calls) may exceed the baseline's, taken interleaved through the same
        context switches, by CLOCK_SLACK_US plus CLOCK_SLACK_FRACTION of its median reading; without a
        baseline's, its median gap against its own no-op is held to LONE_CLOCK_SLACK_US. None where it
        holds, else why not."""
        raw, reported = self.shape_raw, self.shape_reported
        for (role, kind), gaps in self.shape_gaps.items():
            if role != kernel.role:
                continue
            base = raw.get((baseline.role, kind)) if baseline is not None else None
            if base:
                gap, slack = trimmed_mean(raw[(role, kind)]) - trimmed_mean(base), CLOCK_SLACK_US
            else:
                gap, slack = statistics.median(gaps), LONE_CLOCK_SLACK_US
            allowed = slack + CLOCK_SLACK_FRACTION * statistics.median(reported[(role, kind)])
            if gap > allowed:
                how = f"trimmed mean over the shape ({kind}), beyond the baseline's" if base else \
                    f"median over the shape ({kind})"
                return self._forgery(kernel, gap, allowed, how)
        return None

    @staticmethod
    def _forgery(kernel: RemoteKernel, gap: float, allowed: float, how: str) -> str:
        return (f"{kernel.role}: its calls took {gap:.1f} us longer by the judge's clock than the kernel process "
                f"reported ({how}; {allowed:.1f} us allowed for the launch): a forged clock")

    @staticmethod
    def reject(kernel: RemoteKernel, why: str) -> None:
        """Close the host and fail it for `why`."""
        kernel.close()
        raise KernelFailure(why, party=kernel.role)


def trimmed_mean(xs: list[float], trim: float = CLOCK_TRIM) -> float:
    """The mean of xs without its lowest and highest `trim` shares."""
    s = sorted(xs)
    k = int(len(s) * trim)
    return statistics.fmean(s[k:len(s) - k] or s)


def running_threads(pid: int) -> int:
    """How many of the process's threads are running or ready to run (/proc/PID/task/*/stat state R);
    0 where the process is gone."""
    n = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    n += f.read().rsplit(b")", 1)[1].split()[0] == b"R"
            except (OSError, IndexError):
                continue  # the thread ended between the listing and the read
    except OSError:
        return 0
    return n


def wait_blocked(pids: list[int], timeout_s: float) -> bool:
    """Wait until no thread of these processes is running (each blocked or gone), at most timeout_s;
    whether they all were."""
    deadline = time.perf_counter() + timeout_s
    while any(running_threads(pid) for pid in pids):
        if time.perf_counter() >= deadline:
            return False
        time.sleep(SETTLE_POLL_S)
    return True


# The only variables a kernel host gets (the judge's own, HOME and PYTHONPATH among them, may name
# kopt's folders); the same names a production process on this machine has.
HOST_ENV = (*PASSED_ENV, "PATH", "LANG")


def host_env(tool: bool = False) -> dict[str, str]:
    """The whole environment of a kernel host; under a tool (a test job, nothing timed) also HOME and
    TMPDIR, where the tool keeps its own files."""
    names = (*HOST_ENV, "HOME", "TMPDIR") if tool else HOST_ENV
    return {name: os.environ[name] for name in names if name in os.environ}


def host_program(args: list[str]) -> bytes:
    """What a kernel host's interpreter reads on stdin: where kopt is, then kernel_host.main(args).
    Read and compiled before it runs, so none of it is in the command line or the environment."""
    path = [REPO_ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return (
        "import sys, faulthandler\n"
        "sys.dont_write_bytecode = True\n"
        f"sys.path[:0] = {path!r}\n"
        "faulthandler.enable()  # a Python stack in the log when the kernel crashes\n"
        "from gpu_worker.kernel_host import main\n"
        f"main({args!r})\n"
    ).encode()


def fp_mode_change(before: int, after: int) -> str:
    """Words for a change of the caller's floating-point mode (kernel_host.FpMode.read's numbers)."""
    what = []
    if FpMode.X86_64:
        if (before ^ after) & X87_IN_USE:
            what.append(f"x87 registers {'left in use' if after & X87_IN_USE else 'emptied'} (the x87 stack must be "
                        "empty on return: the caller's next long double would be NaN)")  # fmt: skip
        before, after = before & ~X87_IN_USE, after & ~X87_IN_USE
        (cw0, mx0), (cw1, mx1) = divmod(before, 1 << 16), divmod(after, 1 << 16)
        bits = {1 << 15: "flush-to-zero", 1 << 6: "denormals-are-zero"}
        what += [f"{name} {'on' if mx1 & bit else 'off'}" for bit, name in bits.items() if (mx0 ^ mx1) & bit]
        rounding = ("to nearest", "down", "up", "toward zero")
        if (mx0 ^ mx1) & 0x6000:
            what.append(f"SSE rounding {rounding[mx1 >> 13 & 3]}")
        if (mx0 ^ mx1) & 0x1F80:
            what.append("SSE exception masks")
        if (cw0 ^ cw1) & 0x0C00:
            what.append(f"x87 rounding {rounding[cw1 >> 10 & 3]}")
        if (cw0 ^ cw1) & 0x033F:
            what.append("x87 precision or exception masks")
        detail = f"MXCSR {mx0:#06x} -> {mx1:#06x}, x87 control {cw0:#06x} -> {cw1:#06x}"
    else:
        detail = f"rounding mode {before} -> {after}"
    return (f"returned with the caller's floating-point mode changed ({', '.join(what) or 'control bits'}; {detail}): "
            "every later float operation of the calling thread would differ")


class RemoteKernel:
    """One library in its own kernel host; called like abi.Kernel: kernel(packed) -> rc.

    After each call, last_rt_ns is the judge's round trip and last_ns the host's own reading (CPU:
    its clock; CUDA: its events). `before_send` (CUDA: the judge's stream synchronize) runs before
    every call, so what the judge wrote into the buffers is there when the host's kernel starts."""

    _ids = 0

    def __init__(self, library: str, entry: str, role: str, arena: Arena | CudaArena, memory_limit_mb: int,
                 hosts: Hosts, before_send=None, prefix: list[str] | None = None) -> None:  # fmt: skip
        self.role, self.arena = role, arena
        self.cuda = arena.target == "cuda"
        # Under a tool, proc is the tool's process: the host's own threads and CPU time are not read
        # (a tool's job is a test job: nothing is timed).
        self.under_tool = bool(prefix)
        self.before_send = before_send or (lambda: None)
        RemoteKernel._ids += 1
        self.serial = RemoteKernel._ids  # names this host in the packs registered with it
        self.last_rt_ns = self.last_ns = 0
        self._forgotten: list[int] = []
        self._segments: set[int] = set()  # CUDA: the device segments this host has mapped (only those its packs use)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        arena_arg, fds = arena.spawn
        # The interpreter's real file (a venv's bin/python may be a link the jail does not show), no site
        # (the host imports only kopt's own torch-free modules), C stdio unbuffered (a kernel's printf
        # then needs no buffer, whose set-up the served filter would kill), and a command line and
        # environment that say nothing of kopt: a kernel reads both at the top of its own stack without a
        # system call (tests/cheats/cpu/stack_argv.cpp). What to run comes on stdin (host_program).
        argv = [*(prefix or []), os.path.realpath(sys.executable), "-S", "-u"]
        args = [str(theirs.fileno()), arena.target, arena_arg, library, entry, role, str(memory_limit_mb)]
        self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(), *fds), stdin=subprocess.PIPE,
                                     env=host_env(tool=self.under_tool))
        try:
            self.proc.stdin.write(host_program(args))
            self.proc.stdin.close()
        except OSError:  # the interpreter did not start: wait_ready reports how it ended
            pass
        theirs.close()
        self.hosts = hosts
        self.ready = False

    def wait_ready(self) -> None:
        """Wait until the host has loaded its library (hosts start together; each is waited for in
        turn, so their process and CUDA-context start-ups overlap with each other and the judge's)."""
        self.sock.settimeout(LOAD_TIMEOUT_S)
        try:
            first = self.sock.recv(4096)
        except TimeoutError:
            self.close()
            raise KernelFailure(f"{self.role}: its library did not finish loading in {LOAD_TIMEOUT_S:g} s",
                                party=self.role) from None
        self.sock.settimeout(None)
        if first.startswith(Hello.ERROR):
            self.close()
            raise KernelFailure(first[1:].decode(errors="replace"), party=self.role)
        if first != Hello.READY:
            raise self._death()
        self.threads = self.tasks()
        self.hosts.members.append(self)
        self.ready = True

    def _death(self) -> KernelFailure:
        """Why the host stopped answering, from its exit status, worded as the parent words the death
        of a harness (the judge adds the step it was at; a baseline's death is named as such)."""
        who = "" if self.role == "candidate" else f"{self.role}: "
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.close()
            return KernelFailure(f"{who}the kernel process closed its connection to the judge", party=self.role)
        if rc == -signal.SIGSYS:
            return KernelFailure(f"{who}killed by the sandbox: {KILLED_REASON}", party=self.role)
        if rc == -signal.SIGXFSZ:
            return KernelFailure(f"{who}killed: wrote more than {FSIZE_LIMIT >> 20} MiB to stdout/stderr",
                                 party=self.role)
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            fault = -rc in (signal.SIGSEGV, signal.SIGBUS) and self.role == "candidate"
            return KernelFailure(f"{who}crashed: {name}", memory_fault=fault, party=self.role)
        return KernelFailure(f"{who}kernel process exited with code {rc} without answering (does the kernel call "
                             "exit()?)", party=self.role)  # fmt: skip

    def _send(self, data: bytes) -> None:
        try:
            while self._forgotten:
                self.sock.send(Op.FORGET + CALL.pack(self._forgotten.pop()))
            self.sock.send(data)
        except OSError:
            raise self._death() from None

    def _reply(self, fatal: bool = True) -> tuple[int, int]:
        """(rc, the host's ns) of the reply to the last message; a CUDA error ends the host (unless
        not `fatal`: then it is raised as CaptureFailed and the host stays)."""
        try:
            msg = self.sock.recv(64)
        except OSError:
            msg = b""
        if len(msg) != REPLY.size:
            if msg:
                self.close()
                raise KernelFailure(f"{self.role}: broke the kernel host's protocol during a call", party=self.role)
            raise self._death()
        rc, ns, status = REPLY.unpack(msg)
        if status == FP_MODE_CHANGED:
            self.close()
            who = "" if self.role == "candidate" else f"{self.role}: "
            raise KernelFailure(who + fp_mode_change(rc, ns), party=self.role)
        if status:
            from gpu_worker.cuda_driver import error_name

            if not fatal:
                raise CaptureFailed(error_name(status) or "an unknown CUDA error")
            self.close()  # its context is broken: the judge's own context is not
            raise KernelFailure(f"{self.role}: CUDA error after the kernel call: "
                                f"{error_name(status) or 'an unknown CUDA error'}",
                                memory_fault=status == CUDA_ERROR_ILLEGAL_ADDRESS and self.role == "candidate",
                                party=self.role)
        return rc, ns

    def _register(self, packed: Packed) -> int:
        ids = packed.__dict__.setdefault("remote_ids", {})
        if self.serial in ids:
            return ids[self.serial]
        RemoteKernel._ids += 1
        pack_id = RemoteKernel._ids
        body = [Op.PACK, PACK_HEAD.pack(pack_id, packed.n)]
        for t, readonly in zip(packed.tensors, packed.readonly):
            extent = (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0
            where = self.arena.offset_of(t.data_ptr(), extent) if t.numel() else EMPTY
            span = self.arena.allocation(where, extent) if t.numel() else (0, 0)
            body.append(TENSOR_HEAD.pack(where, KOPT_DTYPES[t.dtype], t.dim(), *span, not readonly))
            body.append(struct.pack(f"<{2 * t.dim()}q", *t.shape, *t.stride()))
        used = {self.arena.offset_of(t.data_ptr(), 1) >> SEGMENT_SHIFT for t in packed.tensors if t.numel()}
        for seg, size, fd in self.arena.segments():  # the device segments this pack uses, new to the host, first
            if seg not in used or seg in self._segments:
                continue
            try:
                socket.send_fds(self.sock, [Op.SEGMENT + SEGMENT.pack(seg, size)], [fd])
            except OSError:
                raise self._death() from None
            self._segments.add(seg)
        self._send(b"".join(body))
        ids[self.serial] = pack_id
        weakref.finalize(packed, self._forgotten.append, pack_id)
        return pack_id

    def _timed(self, message: bytes) -> int:
        """Send one message that runs kernel code; the judge's round trip, checked against the host's
        own reading (which cannot be longer than the round trip it happened in)."""
        self.before_send()
        t0 = time.perf_counter_ns()
        self._send(message)
        rc, self.last_ns = self._reply()
        self.last_rt_ns = time.perf_counter_ns() - t0
        if self.last_ns > self.last_rt_ns:
            self.close()
            raise KernelFailure(f"{self.role}: the kernel process reported a call of {self.last_ns} ns that the judge "
                                f"timed at {self.last_rt_ns} ns (a forged clock)", party=self.role)  # fmt: skip
        return rc

    def __call__(self, packed: Packed, stream: int | None = None) -> int:
        return self._timed(Op.CALL + CALL.pack(self._register(packed)))

    def caller_mode(self, extra: int) -> None:
        """Call from now on as a caller whose floating-point mode has `extra` MXCSR control bits set (0: the
        host's own mode); a call must still return with the mode it found (kernel_host.FpMode)."""
        self._send(Op.MODE + MODE.pack(extra))

    def capture(self, packs: list[Packed]) -> int:
        """CUDA: a graph of one call per pack, in order, kept by the host; its id."""
        ids = [self._register(p) for p in packs]
        self.before_send()
        self._send(Op.CAPTURE + CALL.pack(len(ids)) + struct.pack(f"<{len(ids)}I", *ids))
        rc, graph = self._reply(fatal=False)
        if rc:
            raise KernelFailure(f"{self.role}: {error_message(rc)} during graph capture", party=self.role)
        return graph

    def replay(self, graph: int) -> None:
        """CUDA: launch a captured graph once and wait for it (last_ns: the host's event reading)."""
        self._timed(Op.REPLAY + CALL.pack(graph))

    def burst(self, packed: Packed, count: int) -> int:
        """CUDA: `count` calls back to back, then the host waits for its whole context."""
        return self._timed(Op.BURST + BURST.pack(self._register(packed), count))

    def tasks(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/task"))
        except OSError:
            return 0

    def cpu_ns(self) -> int | None:
        """CPU time all of the host's threads have used so far (ns, /proc/PID/task/*/schedstat); None
        where not available."""
        total = 0
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return total

    def ping(self) -> float:
        """One no-op round trip, in microseconds (CUDA: two events on the host's stream and a wait)."""
        t0 = time.perf_counter_ns()
        self._send(Op.NOOP)
        self._reply()
        return (time.perf_counter_ns() - t0) / 1e3

    def close(self) -> None:
        """Close the socket (a host in its loop exits on that) and wait for the host to go; kill it
        where it does not and this process may still send signals (under the judge's seccomp it may
        not: the jail's end takes the host, and without a jail the parent reports it as left over)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=TOOL_CLOSE_WAIT_S if self.under_tool else CLOSE_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            self.proc.kill()
            self.proc.wait(timeout=CLOSE_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
