"""Confidence intervals of speedups: per shape from pairs of blocks, geomean over shapes.

The two sides are sampled in alternating blocks; the speedup and its interval come from pairs of
neighbouring blocks (paired_blocks), so drift between blocks shows in the interval. Each shape's
ratio gets replicates (Student's t over the pairs), and the same replicate index across shapes
gives one geomean, so the geomean's interval carries every shape's uncertainty. torch is used for
speed (no numpy needed).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

REPLICATES = 2000
CONFIDENCE = 0.95
MAX_RESAMPLED = 2000  # samples per side fed to the bootstrap (evenly thinned beyond this)
UNKNOWN_SPREAD = 1.0  # log-ratio spread assumed when a single block pair was timed
SEGMENTS = 8  # stretches of consecutive block pairs whose means must agree (drift over the run)
# Share of block pairs cut from each end before averaging (Yuen's trimmed mean): a pair whose block
# was disturbed as a whole (a preemption, a page fault storm) is an outlier of either sign, and one
# of them (a log ratio of 8 was seen under a CPU hog) must not decide the point or the width.
TRIM = 0.2
# The smallest speedup a verdict believes, per target, whatever the interval says: the same code
# timed against itself is off by this much from one run to the next (placement of buffers and code,
# which side ran after which re-check; on CPU the two kernel processes and how the scheduler treats
# each), an offset constant within a run that no interval over that run's pairs can see. Measured:
# CPU (2-core EPYC VM, baseline and candidate in two kernel hosts, one busy process beside them)
# A/A points with a spread of 1.5-1.7 % and up to 3.3 % off (one round-trip figure per host; 2.4-2.8 %
# and up to 7 % when both hosts shared one); H100 self A/B within +-0.2 % (bench/results/
# noise_floor-*). docs/measurement.md, timing 7.
MIN_NOISE_FLOOR = {"cpu": 0.04, "cuda": 0.005}


@dataclass(frozen=True)
class Ratio:
    speedup: float  # median(baseline) / median(candidate)
    low: float
    high: float
    replicates: torch.Tensor  # (REPLICATES,) bootstrap ratios, for the geomean


    @classmethod
    def from_interval(cls, speedup: float, low: float, high: float, seed: int = 0, reps: int = REPLICATES) -> Ratio:
        """Replicates rebuilt from a reported interval (a shape resumed from an earlier attempt, whose
        samples are gone): log-normal around the point with the interval's width."""
        z = statistics.NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
        sigma = max(math.log(high) - math.log(low), 0.0) / (2 * z)
        gen = torch.Generator().manual_seed(seed)
        logs = math.log(speedup) + sigma * torch.randn(reps, generator=gen, dtype=torch.float64)
        return cls(speedup, low, high, logs.exp())


def _thin(xs: list[float]) -> torch.Tensor:
    t = torch.tensor(xs, dtype=torch.float64)
    if len(t) > MAX_RESAMPLED:
        t = t[torch.linspace(0, len(t) - 1, MAX_RESAMPLED).long()]
    return t


def _medians(x: torch.Tensor, gen: torch.Generator, reps: int) -> torch.Tensor:
    idx = torch.randint(len(x), (reps, len(x)), generator=gen)
    return x[idx].median(dim=1).values


def _interval(reps: torch.Tensor, confidence: float) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    q = torch.quantile(reps, torch.tensor([alpha, 1 - alpha], dtype=reps.dtype))
    return float(q[0]), float(q[1])


def _width(logs: torch.Tensor, confidence: float) -> float:
    low, high = _interval(logs, confidence)
    return high - low


def _split(xs: list[float], sizes: tuple[int, ...] | list[int]) -> list[list[float]]:
    out, at = [], 0
    for n in sizes:
        out.append(xs[at : at + n])
        at += n
    return out


def _student_t(df: int, reps: int, gen: torch.Generator) -> torch.Tensor:
    """`reps` draws of Student's t with `df` degrees of freedom (normal beyond 60)."""
    z = torch.randn(reps, generator=gen, dtype=torch.float64)
    if df > 60:
        return z
    chi2 = torch.randn(reps, df, generator=gen, dtype=torch.float64).pow(2).sum(dim=1)
    return z / (chi2 / df).sqrt()


def trimmed(d: list[float], trim: float = TRIM) -> tuple[float, float, int]:
    """Yuen's trimmed mean of `d`: (mean of the middle values, its standard error from the
    winsorized spread, degrees of freedom). With fewer than 1/trim values nothing is cut."""
    n = len(d)
    k = int(trim * n)
    xs = sorted(d)
    core = xs[k : n - k]
    mean = statistics.fmean(core)
    if n < 2:
        return mean, math.inf, 1
    winsorized = [core[0]] * k + core + [core[-1]] * k
    se = statistics.stdev(winsorized) / ((1 - 2 * k / n) * math.sqrt(n))
    return mean, se, max(len(core) - 1, 1)


def paired_blocks(
    baseline: list[float], base_blocks: tuple[int, ...], candidate: list[float], cand_blocks: tuple[int, ...],
    seed: int = 0, reps: int = REPLICATES, confidence: float = CONFIDENCE,
) -> Ratio:  # fmt: skip
    """The speedup from pairs of blocks: the i-th block of each side was taken next to the other in
    time (A B B A ...), so d_i = log(median(A_i) / median(B_i)) compares the two under the same
    conditions, and the machine's drift between blocks (load, clocks, caches) cancels in d_i and
    shows in their spread. Speedup = exp(trimmed mean of d_i) (TRIM); its interval is Student's t
    over the pairs (Yuen: the trimmed mean's error from the winsorized spread), so few pairs or
    drifting ones give a wide interval rather than a confident wrong one (a bootstrap of single
    samples, treating them as independent, hides the drift). With many pairs, the means of SEGMENTS
    consecutive stretches (trimmed too) are a second estimate (Student's t over them): when the
    pairs' difference drifts during the run, the stretches disagree more than the pairs' spread
    predicts, and the wider of the two intervals is the one reported."""
    a = [statistics.median(x) for x in _split(baseline, base_blocks) if x]
    b = [statistics.median(x) for x in _split(candidate, cand_blocks) if x]
    d = [math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0]
    gen = torch.Generator().manual_seed(seed)
    mean, se, df = trimmed(d)
    if len(d) < 2:  # one pair says nothing about the spread: an interval that decides nothing
        logs = mean + UNKNOWN_SPREAD * torch.randn(reps, generator=gen, dtype=torch.float64)
    else:
        logs = mean + se * _student_t(df, reps, gen)
        if len(d) >= 2 * SEGMENTS:  # drift: stretches of the run that disagree widen the interval
            n = len(d)
            seg = [trimmed(d[k * n // SEGMENTS : (k + 1) * n // SEGMENTS])[0] for k in range(SEGMENTS)]
            by_seg = mean + statistics.stdev(seg) / math.sqrt(SEGMENTS) * _student_t(SEGMENTS - 1, reps, gen)
            if _width(by_seg, confidence) > _width(logs, confidence):
                logs = by_seg
    ratios = logs.exp()
    low, high = _interval(ratios, confidence)
    return Ratio(math.exp(mean), low, high, ratios)


def ratio_of_medians(
    baseline: list[float], candidate: list[float], seed: int = 0, reps: int = REPLICATES, confidence: float = CONFIDENCE,
    base_blocks: tuple[int, ...] = (), cand_blocks: tuple[int, ...] = (),
) -> Ratio:  # fmt: skip
    """baseline / candidate with a 95 % interval: from pairs of blocks when the block structure is
    known (paired_blocks, what the harness uses), else median over median with a bootstrap of
    single samples."""
    if base_blocks and cand_blocks:
        return paired_blocks(baseline, base_blocks, candidate, cand_blocks, seed, reps, confidence)
    gen = torch.Generator().manual_seed(seed)
    b, c = _thin(baseline), _thin(candidate)
    point = float(b.median() / c.median())
    rb, rc = _medians(b, gen, reps), _medians(c, gen, reps)
    ratios = rb / rc
    low, high = _interval(ratios, confidence)
    return Ratio(point, low, high, ratios)


def geomean_interval(ratios: list[Ratio], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(geomean of the point speedups, low, high) over shapes."""
    point = math.exp(sum(math.log(r.speedup) for r in ratios) / len(ratios))
    logs = torch.stack([r.replicates.log() for r in ratios]).mean(dim=0).exp()
    low, high = _interval(logs, confidence)
    return point, low, high


def weighted_time_interval(ratios: list[Ratio], baseline_us: list[float], weights: list[float],
                           confidence: float = CONFIDENCE) -> tuple[float, float, float]:  # fmt: skip
    """(speedup, low, high) of the workload-weighted time: sum(w * baseline) / sum(w * baseline /
    speedup) over the (shape, dtype) pairs, with each pair's replicates as its uncertainty."""
    w = torch.tensor([wi * bi for wi, bi in zip(weights, baseline_us)], dtype=torch.float64)
    total = float(w.sum())
    point = total / sum(float(wi) / r.speedup for wi, r in zip(w, ratios))
    reps = torch.stack([r.replicates for r in ratios])  # (pairs, REPLICATES)
    speedups = total / (w[:, None] / reps).sum(dim=0)
    low, high = _interval(speedups, confidence)
    return point, low, high


def verdict(low: float, high: float, noise_floor: float) -> str:
    """"faster" only when the interval's low end clears 1 by more than the noise floor."""
    if low > 1 + noise_floor:
        return "faster"
    if high < 1 - noise_floor:
        return "slower"
    return "same"
