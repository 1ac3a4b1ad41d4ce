"""Bootstrap confidence intervals of speedups: ratio of medians per shape, geomean over shapes.

Samples of the two sides are resampled independently (with replacement); each replicate gives a
ratio of medians per shape, and the same replicate index across shapes gives one geomean, so the
geomean's interval carries every shape's uncertainty. torch is used for speed (no numpy needed).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

REPLICATES = 2000
CONFIDENCE = 0.95
MAX_RESAMPLED = 2000  # samples per side fed to the bootstrap (evenly thinned beyond this)


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


def ratio_of_medians(
    baseline: list[float], candidate: list[float], seed: int = 0, reps: int = REPLICATES, confidence: float = CONFIDENCE
) -> Ratio:
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


def verdict(low: float, high: float, noise_floor: float) -> str:
    """"faster" only when the interval's low end clears 1 by more than the noise floor."""
    if low > 1 + noise_floor:
        return "faster"
    if high < 1 - noise_floor:
        return "slower"
    return "same"
