"""The optimization run's decision rules, as pure functions: no temporalio, no I/O, no clock.

OptimizeKernel (workflows/optimize.py) decides through these, so each rule is tested on its own
(tests/test_rules.py) without a server or a kernel: which candidate of a round is the round's best,
whether it replaces the run's best (min-gain, significance), the bucket rule of a shape-specialized
library, and why a run stops (as a kind and a text). Changing a rule changes what runs decide: guard it
with a workflow patch as the callers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kopt.models import ProfileResult, ShapeSpeedup
from kopt.run_models import Budgets, Usage

StopKind = Literal["budget", "patience", "llm", "exhausted"]


@dataclass(frozen=True)
class Stop:
    """Why a run stops before its last round: `kind` for code to act on, `text` for people."""

    kind: StopKind
    text: str


def speedups(baseline: ProfileResult, candidate: ProfileResult, floored: bool = False) -> list[ShapeSpeedup]:
    """Per-shape speedups: from the interleaved A/B when the profile has one (with its noise floor
    when `floored`: NOISE_FLOOR_PATCH), else from medians."""
    sol = {(t.shape, t.dtype): t.pct_sol for t in candidate.timings}
    if candidate.ab is not None and candidate.ab.per_shape:
        floor = candidate.ab.noise_floor if floored else 0.0
        return [ShapeSpeedup(shape=a.shape, dtype=a.dtype, baseline_us=a.baseline_us, candidate_us=a.candidate_us,
                             speedup=a.speedup, pct_sol=sol.get((a.shape, a.dtype)), ci_low=a.ci_low,
                             ci_high=a.ci_high, noise_floor=floor) for a in candidate.ab.per_shape]  # fmt: skip
    base = {(t.shape, t.dtype): t for t in baseline.timings}
    out = []
    for t in candidate.timings:
        b = base.get((t.shape, t.dtype))
        if b is None or t.median_us <= 0:
            continue
        out.append(ShapeSpeedup(shape=t.shape, dtype=t.dtype, baseline_us=b.median_us, candidate_us=t.median_us,
                                speedup=b.median_us / t.median_us, pct_sol=t.pct_sol))
    return out


def significant(profile: ProfileResult) -> bool:
    """A speedup over the baseline is real only if the A/B interval clears the noise floor."""
    return profile.ab is None or profile.ab.verdict == "faster"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def round_best(measured: list[tuple[int, float, bool]]) -> int | None:
    """The slot of a round's best: the fastest (slot, speedup, eligible) that is eligible (correct,
    measured, and no shape slower than the baseline unless regressions are allowed); the earlier slot
    on a tie; None when no slot is eligible."""
    best: tuple[int, float] | None = None
    for slot, speedup, eligible in measured:
        if eligible and (best is None or speedup > best[1]):
            best = (slot, speedup)
    return None if best is None else best[0]


def beats_best(speedup: float, best_speedup: float, min_gain: float, is_significant: bool) -> bool:
    """A round's best replaces the run's best: faster than it by more than min_gain, and faster than
    the baseline beyond the A/B's noise (why_not_best says which of the two it misses)."""
    return why_not_best(speedup, best_speedup, min_gain, is_significant) is None


def why_not_best(speedup: float, best_speedup: float, min_gain: float, is_significant: bool) -> str | None:
    """Why a round's best does not replace the run's best (beats_best's rules, in words), or None."""
    if speedup <= best_speedup * (1 + min_gain):
        return (f"not the new best: {speedup:.3f}x is not above the best's {best_speedup:.3f}x by the "
                f"minimum gain ({100 * min_gain:g}%, --min-gain)")
    if not is_significant:
        return "not the new best: its A/B interval against the baseline does not clear the noise floor"
    return None


def why_not_better_head_to_head(versus: ProfileResult | None, min_gain: float, is_significant: bool) -> str | None:
    """Why a round's best does not replace a best that is not the baseline, judged on one interleaved
    A/B against the best's library (`versus`, the round's best as the candidate): faster than the best by
    more than min_gain, its interval clear of the noise floor, and still faster than the baseline beyond
    the A/B's noise. None where it replaces the best."""
    if versus is None or not versus.ok or versus.ab is None:
        why = versus.reason if versus is not None and versus.reason else "no A/B against the best"
        return f"not the new best: the head-to-head measurement against the best failed ({why})"
    ab = versus.ab
    if ab.speedup_geomean <= 1 + min_gain:
        return (f"not the new best: {ab.speedup_geomean:.3f}x the best's speed head to head, not above it by "
                f"the minimum gain ({100 * min_gain:g}%, --min-gain)")
    if ab.verdict != "faster":
        return (f"not the new best: head to head, its interval [{ab.ci_low:.3f}, {ab.ci_high:.3f}] does not "
                "clear the noise floor")
    if not is_significant:
        return "not the new best: its A/B interval against the baseline does not clear the noise floor"
    return None


def why_no_head_to_head(speedup: float, best_speedup: float, min_gain: float) -> str | None:
    """Asynchronous slots judge each candidate against the best as soon as it finishes: one whose speedup
    over the baseline is not above the best's by half the minimum gain is refused without the head-to-head
    measurement. To beat the best by the minimum gain head to head, its baseline-relative figure would have
    to be off by half of it (1 % at the default 2 %; two measurements of one kernel agree to a few tenths
    of a percent on an H100): a GPU's time better spent on the next candidate. None where the head-to-head
    decides."""
    if speedup <= best_speedup * (1 + min_gain / 2):
        return (f"not the new best: {speedup:.3f}x over the baseline, not above the best's {best_speedup:.3f}x by "
                f"half the minimum gain ({50 * min_gain:g}%; no head-to-head)")
    return None


def bucket_gain(speedup: float, best_speedup: float, bucket_ratios: list[float], min_gain: float) -> bool:
    """A shape-specialized library replaces the best: better by min_gain overall, or no worse overall
    with one bucket better by min_gain and none worse by it (a prefill win that decode-heavy weights
    hide). `bucket_ratios`: each bucket's speedup over the best's."""
    if speedup > best_speedup * (1 + min_gain):
        return True
    return (speedup >= best_speedup and max(bucket_ratios, default=1.0) > 1 + min_gain
            and min(bucket_ratios, default=1.0) * (1 + min_gain) >= 1)  # fmt: skip


def held_out_overfit(held_out: list[ShapeSpeedup], slower_overall: bool,
                     search: list[ShapeSpeedup]) -> tuple[bool, list[str], list[str]]:  # fmt: skip
    """Whether the best overfits the search shapes: it won there and loses on held-out ones. Returns
    (overfit, the held-out shapes slower than the baseline that the search shapes did not foretell, those
    it did). A held-out regression in a dtype where the best was already slower than the baseline on a
    search shape (accepted inside the noise floor, 0.965x at float16 say) is no news about the held-out
    shapes: it is listed as foretold, not as an overfit. `slower_overall`: the held-out A/B's verdict over
    all of them; it means an overfit unless every regression was foretold."""
    slower_dtypes = {s.dtype for s in search if s.speedup < 1.0}
    regressions = [s for s in held_out if s.regression()]
    new = [f"{s.shape} {s.dtype}" for s in regressions if s.dtype not in slower_dtypes]
    foretold = [f"{s.shape} {s.dtype}" for s in regressions if s.dtype in slower_dtypes]
    overfit = bool(new) or (slower_overall and not foretold)
    return overfit, new, foretold


def no_room(budgets: Budgets, usage: Usage, elapsed_s: float | None, wall_s: float | None, device_s: float | None,
            what: str) -> str | None:  # fmt: skip
    """Why a step expected to take `wall_s` seconds of wall time and `device_s` of device time (as the
    last one like it did) would end past the wall-time or device-time budget, in words; None where it
    fits, or nothing bounds it, or nothing is known of it. The run then stops, or skips the step, before
    it starts: a budget bounds the whole run, not only the steps begun within it."""
    b = budgets
    if b.max_wall_time_s is not None and elapsed_s is not None and wall_s and elapsed_s + wall_s > b.max_wall_time_s:
        return (f"wall-time budget: {what} (~{wall_s:.0f} s, as the last took) would end past it "
                f"({max(0.0, b.max_wall_time_s - elapsed_s):.0f} s of {b.max_wall_time_s:g} s left)")
    if b.max_gpu_seconds is not None and device_s and usage.device_seconds + device_s > b.max_gpu_seconds:
        return (f"device-time budget: {what} (~{device_s:.1f} s of device time) would end past it "
                f"({max(0.0, b.max_gpu_seconds - usage.device_seconds):.1f} s of {b.max_gpu_seconds:g} s left)")
    return None


def stop_reason(budgets: Budgets, usage: Usage, elapsed_s: float | None, patience: int | None,
                rounds_since_improvement: int, llm_stop: str | None = None) -> Stop | None:  # fmt: skip
    """Why the run stops before its next round, or None. The order is the order of the checks."""
    if llm_stop:
        return Stop("llm", llm_stop)
    b, u = budgets, usage
    if b.max_cost_usd is not None and u.cost_usd >= b.max_cost_usd:
        return Stop("budget", f"cost budget reached (${u.cost_usd:.4f} >= ${b.max_cost_usd})")
    if b.max_tokens is not None and u.prompt_tokens + u.completion_tokens >= b.max_tokens:
        return Stop("budget", f"token budget reached ({u.prompt_tokens + u.completion_tokens} >= {b.max_tokens})")
    if b.max_gpu_seconds is not None and u.device_seconds >= b.max_gpu_seconds:
        return Stop("budget", f"device-time budget reached ({u.device_seconds:.1f} s >= {b.max_gpu_seconds} s)")
    if b.max_wall_time_s is not None and elapsed_s is not None and elapsed_s >= b.max_wall_time_s:
        return Stop("budget", f"wall-time budget reached ({elapsed_s:.0f} s >= {b.max_wall_time_s} s)")
    if patience is not None and rounds_since_improvement >= patience:
        return Stop("patience", f"no improvement in the last {rounds_since_improvement} rounds")
    return None
