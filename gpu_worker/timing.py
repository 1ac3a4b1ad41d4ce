"""The one timing primitive of kopt: sample kernels in blocks until their means are known.

Runs inside the harness subprocess (imports torch). `sample` takes one measurer (a kernel alone)
or two (baseline and candidate, A/B): blocks alternate A B B A ... in the same process, each
block bracketed by NVML readings so blocks taken during a thermal/power slowdown are dropped and
counted. Measurers:
  remote_measure the judge's clock around one call's round trip to its kernel host, less the no-op
                 round trip (the CPU target; caches not flushed: mode "hot-cpu")
  cuda_measure   cold L2: a 2x-L2 buffer overwritten before each event-timed call (mode "cold")
  GraphTimer     a CUDA graph of many back-to-back calls over rotating inputs larger than L2,
                 event-timed per replay, reported per call (mode "graph")
The kernels run in kernel hosts (remote.py): on CUDA the host's events give the figure and the
judge's clock checks them (remote.Hosts.check_clock).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.nvml import Monitor
from gpu_worker.remote import BLOCK_RETAKES

MIN_SAMPLES = 20
MAX_SAMPLES = 5000
RSE_TARGET = 0.005  # relative standard error of the mean
# A/B runs aim at the ratio, not each side: a 95% interval of about +-(1.96 * sqrt(2) * RSE) must sit
# inside the +-1% noise floor, so each side samples to a tighter RSE, and to more samples (the
# interval is a bootstrap of medians, which needs a dense middle of the distribution).
AB_MIN_SAMPLES = 200
AB_MIN_SAMPLES_S = 0.25  # ... but no more of them than fit in this many seconds per side (large shapes
AB_RSE_TARGET = 0.0015  # are tight after a few dozen samples, and each costs a refresh of its inputs)
WARMUP_S = 0.025
WARMUP_CALLS = 10
BATCH = 10  # samples per block (one synchronize per block on CUDA)
AB_MIN_BLOCKS = 6  # blocks a side an A/B takes before its time cap may end it (3x the cap ends it anyway)
GRAPH_BELOW_US = 20.0  # auto mode: graph mode when a cold call takes less than this

# A measurer takes a sample count and returns that many per-call times in microseconds.
Measure = Callable[[int], list[float]]
# One block as its checks see it: the judge's round trips (us; None where not checked against the
# readings: the CPU target, whose readings are the judge's own), the readings (us), and the host that
# used CPU outside the calls with why (Hosts.idle_excess), or None.
Block = tuple[list[float] | None, list[float], tuple[object, str] | None]


@dataclass(frozen=True)
class Stats:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    rse: float
    dropped: int = 0  # samples dropped as throttled
    values: tuple[float, ...] = ()
    blocks: tuple[int, ...] = ()  # sizes of the consecutive blocks `values` was taken in


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an ascending list."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: list[float], dropped: int = 0, blocks: list[int] | None = None) -> Stats:
    s = sorted(xs)
    mean = statistics.fmean(s)
    rse = statistics.stdev(s) / math.sqrt(len(s)) / mean if len(s) > 1 and mean > 0 else math.inf
    return Stats(statistics.median(s), percentile(s, 10), percentile(s, 90), len(s), rse, dropped, tuple(xs),
                 tuple(blocks or ()))  # fmt: skip


def warmup(call: Callable[[], None], sync: Callable[[], None]) -> None:
    """Run at least WARMUP_CALLS calls and WARMUP_S seconds (clocks, caches, lazy loading)."""
    start = time.perf_counter()
    calls = 0
    while calls < WARMUP_CALLS or time.perf_counter() - start < WARMUP_S:
        call()
        calls += 1
        if calls % BATCH == 0:
            sync()  # so the wall clock sees device time, not just queued launches
    sync()


class _Running:
    """Welford running mean/variance, so the stop test stays O(1) per block."""

    def __init__(self) -> None:
        self.xs: list[float] = []
        self.blocks: list[int] = []
        self.mean = self.m2 = 0.0
        self.dropped = 0

    def add(self, batch: list[float]) -> None:
        if batch:
            self.blocks.append(len(batch))
        for x in batch:
            self.xs.append(x)
            delta = x - self.mean
            self.mean += delta / len(self.xs)
            self.m2 += delta * (x - self.mean)

    @property
    def rse(self) -> float:
        n = len(self.xs)
        return math.sqrt(self.m2 / (n - 1) / n) / self.mean if n > 1 and self.mean > 0 else math.inf

    def done(self, min_samples: int, rse_target: float) -> bool:
        return len(self.xs) >= MAX_SAMPLES or (len(self.xs) >= min_samples and self.rse < rse_target)


def sample(
    measures: list[Measure],
    time_cap_s: float,
    monitor: Monitor | None = None,
    after_block: Callable[[int], None] | None = None,
) -> list[Stats]:
    """Sample every measurer in alternating blocks (A B B A ...) until each one's relative standard
    error is below RSE_TARGET (after MIN_SAMPLES; AB_* when there are two sides, whose minimum count
    shrinks to what fits in AB_MIN_SAMPLES_S when samples are expensive) or MAX_SAMPLES, or
    the time cap passes (after at least 3 samples each, so a slow kernel still ends). Throttled
    blocks are dropped and counted; when every block of a side was throttled for 3 caps, its
    throttled samples are kept instead."""
    ab = len(measures) > 1
    min_samples, rse_target = (AB_MIN_SAMPLES, AB_RSE_TARGET) if ab else (MIN_SAMPLES, RSE_TARGET)
    sides = [_Running() for _ in measures]
    kept_throttled = [_Running() for _ in measures]
    start = time.perf_counter()
    block = 0
    while True:
        if ab and block == 1:  # one block per side timed: what a sample costs, refresh and flush included
            per_sample = (time.perf_counter() - start) / max(sum(len(s.xs) + s.dropped for s in sides), 1)
            min_samples = max(MIN_SAMPLES, min(AB_MIN_SAMPLES, int(AB_MIN_SAMPLES_S / per_sample)))
        order = range(len(measures)) if block % 2 == 0 else reversed(range(len(measures)))
        for i in order:
            if len(sides[i].xs) >= MAX_SAMPLES:
                continue  # A/B sides keep alternating until both are done: no side runs alone
            before = monitor.begin() if monitor else None
            batch = measures[i](min(BATCH, MAX_SAMPLES - len(sides[i].xs)))
            if monitor is None or monitor.clean(before):
                sides[i].add(batch)
            else:
                sides[i].dropped += len(batch)
                kept_throttled[i].add(batch)
            if after_block is not None:
                after_block(i)
        block += 1
        if all(s.done(min_samples, rse_target) for s in sides):
            break
        elapsed = time.perf_counter() - start
        # At the cap: 3 samples of a lone kernel, AB_MIN_BLOCKS blocks of each side of an A/B (its
        # interval is built from block pairs: a few of them can agree by chance on a busy machine).
        enough = [len(s.blocks) >= AB_MIN_BLOCKS if ab else len(s.xs) >= 3 for s in sides]
        if elapsed >= time_cap_s and all(enough):
            break
        if elapsed >= 3 * time_cap_s:
            for s, t in zip(sides, kept_throttled):
                if len(s.xs) < 3:
                    s.add(t.xs)  # nothing clean to report: report what there is, flagged by `dropped`
            break
    return [summarize(s.xs, s.dropped, s.blocks) for s in sides]


# ---------------------------------------------------------------- per-target measurers


PINGS_PER_BLOCK = 3  # no-op round trips to the kernel host before each block (remote_measure)
MIN_REMOTE_US = 0.01  # floor of a remote sample (a call faster than the round trip's jitter)


def remote_measure(call: Callable[[], None], before: Callable[[], None], kernel, hosts) -> Measure:
    """CPU kernels in a kernel host: the judge's own clock around each call's round trip (kernel.
    last_rt_ns) minus the median no-op round trip (hosts: remote.Hosts, topped up before each block).
    Nothing the host reports is believed; `before` (outside the timed region) runs in the judge,
    and over the block no host may use CPU outside this kernel's calls (Hosts.idle_excess)."""

    def block(n: int) -> Block:
        hosts.calibrate(kernel, PINGS_PER_BLOCK)
        overhead = hosts.overhead_us(kernel)
        out = []
        cpu_before, calls_ns = hosts.cpu(), 0
        for _ in range(n):
            before()
            call()
            calls_ns += kernel.last_rt_ns
            out.append(max(kernel.last_rt_ns / 1e3 - overhead, MIN_REMOTE_US))
        return None, out, hosts.idle_excess(cpu_before, kernel, calls_ns, n)

    return lambda n: checked(block, n, kernel, hosts, "cpu")


class ColdL2:
    """A scratch buffer of twice the L2 size, overwritten before each timed call (cold-L2 mode)."""

    def __init__(self, device: torch.device) -> None:
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        self.buf = torch.empty(max(2 * self.l2_bytes, 1 << 20), dtype=torch.uint8, device=device)

    def flush(self) -> None:
        self.buf.zero_()


def cuda_measure(call: Callable[[], None], before: Callable[[], None], kernel, hosts, cold: ColdL2) -> Measure:
    """CUDA kernels in a kernel host, cold L2: the judge refreshes the inputs and flushes the L2 on
    its own stream and waits for them (outside the timed region), then the host records an event
    pair around the call on its stream and waits for it. A sample is the host's event reading, which
    the judge believes only as far as its own clock agrees over the block (Hosts.check_clock: the
    round trip less the host's no-op round trip); Hosts.idle_excess watches the hosts' threads."""

    def flushed() -> None:
        cold.flush()
        torch.cuda.current_stream().synchronize()

    def block(n: int) -> Block:
        hosts.calibrate(kernel, PINGS_PER_BLOCK, flushed)
        out, rts = [], []
        cpu_before = hosts.cpu()
        for _ in range(n):
            before()
            cold.flush()
            call()  # the kernel host syncs the judge's stream before its round trip starts
            rts.append(kernel.last_rt_ns / 1e3)
            out.append(kernel.last_ns / 1e3)
        return rts, out, hosts.idle_excess(cpu_before, kernel, int(sum(rts) * 1e3), n)

    return lambda n: checked(block, n, kernel, hosts, "cold")


def checked(block: Callable[[int], Block], n: int, kernel, hosts, kind: str) -> list[float]:
    """One block's readings, once it passed the block checks: no host used CPU outside the calls
    (Hosts.idle_excess) and, where the block has round trips to check against (CUDA), the judge's
    clock agrees with the readings (Hosts.check_clock). A block that fails either is taken again;
    BLOCK_RETAKES failures in a row fail the host that failed the last one (a retaken block's readings
    never reach the sample: a host that misbehaves now and then gains nothing from it)."""
    for attempt in range(1 + BLOCK_RETAKES):
        rts, readings, idle = block(n)
        if idle is not None:
            (culprit, why), what = idle, "idle"
        else:
            why = hosts.check_clock(kernel, kind, rts, readings) if rts is not None else None
            if why is None:
                return readings
            culprit, what = kernel, kind
        if attempt < BLOCK_RETAKES:
            hosts.retake(culprit, what)
    hosts.reject(culprit, why)
    raise AssertionError("unreachable")  # reject() raises


class GraphTimer:
    """Calls captured back to back in one CUDA graph by the kernel host (one call per slot, slots
    rotate over inputs whose total exceeds L2); a sample is one replay's event time divided by the
    number of calls, cross-checked per block against the judge's clock as in cuda_measure. Every
    replay starts from poisoned outputs and restored in-place inputs (`before_replay`)."""

    def __init__(self, kernel, packs: list, hosts, before_replay=None) -> None:
        self.kernel, self.hosts = kernel, hosts
        self.calls = len(packs)
        self.graph = kernel.capture(packs)
        # The judge's work before every timed replay, outside its events (fresh poison in every output:
        # a kernel that skips what a replay before it already wrote does all its work in every replay).
        self.before_replay = before_replay or (lambda: None)

    def replay(self) -> None:
        self.kernel.replay(self.graph)

    def block(self, n: int) -> Block:
        kernel, hosts = self.kernel, self.hosts
        hosts.calibrate(kernel, PINGS_PER_BLOCK)
        per_replay, rts, pings = [], [], []
        cpu_before = hosts.cpu()
        for _ in range(n):
            self.before_replay()
            # The judge's refresh would put the device's switch from its context to the host's (bimodal,
            # ~45 or ~230 us on an H100) inside the replay's round trip, where the clock check would take
            # it for a forged reading: a no-op round trip after the refresh lands has the switch instead.
            kernel.before_send()
            pings.append(kernel.ping())
            kernel.replay(self.graph)
            rts.append(kernel.last_rt_ns / 1e3)
            per_replay.append(kernel.last_ns / 1e3)
        busy_ns = int((sum(rts) + sum(pings)) * 1e3)
        return rts, per_replay, hosts.idle_excess(cpu_before, kernel, busy_ns, 2 * n)

    def measure(self, n: int) -> list[float]:
        return [t / self.calls for t in checked(self.block, n, self.kernel, self.hosts, "graph")]


def hidden_work(kernel, packed, calls: int) -> tuple[float, float]:
    """(event seconds on the host's stream, the judge's seconds for the round trip) of `calls`
    back-to-back calls after which the host waits for its whole context. Work a kernel hides on
    another stream shows in the second only."""
    kernel.burst(packed, calls)
    return kernel.last_ns / 1e9, kernel.last_rt_ns / 1e9


# ---------------------------------------------------------------- speed of light


def cpu_copy_bandwidth(reps: int = 5) -> float:
    """GB/s (bytes read + written) of a tensor copy larger than the last-level cache."""
    nbytes = min(max(64 << 20, 2 * _cpu_llc_bytes()), 256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        dst.copy_(src)
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return 2 * nbytes / statistics.median(times) / 1e9


def cuda_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 7) -> float:
    """GB/s (bytes read + written) of a 1 GiB device-to-device copy on the current stream."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    stream = torch.cuda.current_stream(device)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def _cpu_llc_bytes() -> int:
    """Largest cache size of cpu0 from sysfs (0 when unknown)."""
    best = 0
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text().strip()
        try:
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best
