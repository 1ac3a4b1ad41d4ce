"""The one timing primitive of kopt: sample a kernel until its mean is known, report robust stats.

Runs inside the harness subprocess (imports torch). CPU samples are wall-clock around a single
call; CUDA samples are event pairs around a single call on the current stream after an L2 flush
(MEASUREMENT.md, timing 3). Graph mode, A/B interleaving and throttle detection plug in here later.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

MIN_SAMPLES = 20
MAX_SAMPLES = 5000
RSE_TARGET = 0.005  # relative standard error of the mean
TIME_CAP_S = {"cpu": 2.0, "cuda": 1.5}  # per shape and dtype, sampling only
WARMUP_S = 0.025
WARMUP_CALLS = 10
BATCH = 10  # samples per measurement batch (one synchronize per batch on CUDA)

# A batch measurer takes a sample count and returns that many per-call times in microseconds.
Measure = Callable[[int], list[float]]


@dataclass(frozen=True)
class Stats:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    rse: float


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an ascending list."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: list[float]) -> Stats:
    s = sorted(xs)
    mean = statistics.fmean(s)
    rse = statistics.stdev(s) / math.sqrt(len(s)) / mean if len(s) > 1 and mean > 0 else math.inf
    return Stats(statistics.median(s), percentile(s, 10), percentile(s, 90), len(s), rse)


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


def sample(measure: Measure, time_cap_s: float) -> Stats:
    """Sample until the relative standard error of the mean is below RSE_TARGET (after MIN_SAMPLES),
    the time cap passes (after at least 3 samples, so a slow kernel still ends), or MAX_SAMPLES."""
    xs: list[float] = []
    # Welford running mean/variance so the stop test stays O(1) per batch.
    mean = m2 = 0.0
    start = time.perf_counter()
    while len(xs) < MAX_SAMPLES:
        for x in measure(min(BATCH, MAX_SAMPLES - len(xs))):
            xs.append(x)
            delta = x - mean
            mean += delta / len(xs)
            m2 += delta * (x - mean)
        n = len(xs)
        rse = math.sqrt(m2 / (n - 1) / n) / mean if n > 1 and mean > 0 else math.inf
        if n >= MIN_SAMPLES and rse < RSE_TARGET:
            break
        if time.perf_counter() - start >= time_cap_s and n >= 3:
            break
    return summarize(xs)


# ---------------------------------------------------------------- per-target measurers


def cpu_measure(call: Callable[[], None], before: Callable[[], None]) -> Measure:
    """Wall clock around each call; `before` (outside the timed region) rotates and re-poisons."""

    def measure(n: int) -> list[float]:
        out = []
        for _ in range(n):
            before()
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            out.append((t1 - t0) / 1e3)
        return out

    return measure


class ColdL2:
    """A scratch buffer of twice the L2 size, overwritten before each timed call (cold-L2 mode)."""

    def __init__(self, device: torch.device) -> None:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.buf = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device=device)

    def flush(self) -> None:
        self.buf.zero_()


def cuda_measure(call: Callable[[], None], before: Callable[[], None], cold: ColdL2) -> Measure:
    """Event pair on the current stream around each call, after `before` and an L2 flush; one
    synchronize per batch keeps the host ahead of the device so launches overlap the flush."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(BATCH)]

    def measure(n: int) -> list[float]:
        stream = torch.cuda.current_stream()
        for k in range(n):
            before()
            cold.flush()
            events[k][0].record(stream)
            call()
            events[k][1].record(stream)
        events[n - 1][1].synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in events[:n]]

    return measure


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
