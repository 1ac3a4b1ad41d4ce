"""The verdict of judging one candidate (`kopt evaluate`, `kopt verify`): what `--json` prints, the
rows of the timing table, and the regression rule the verify gate applies to them."""

from __future__ import annotations

from pydantic import BaseModel, Field

from kopt.models import regression_limit, slower_beyond


class CheckCounts(BaseModel):
    """The test step's checks: how many ran, how many did not apply (and why each), the keys of those that
    failed."""

    total: int = 0
    skipped: int = 0
    failed: list[str] = Field(default_factory=list)
    not_applicable: list[str] = Field(default_factory=list)  # "key: why" of each skipped check


class ShapeVerdict(BaseModel):
    """One timed (shape, dtype): the candidate's median, and against the baseline where an A/B ran."""

    shape: str
    dtype: str
    mode: str
    candidate_us: float
    baseline_us: float | None = None
    speedup: float | None = None
    speedup_ci: list[float | None] | None = None  # 95 % interval of baseline / candidate
    gbytes_per_s: float | None = None
    pct_sol: float | None = None
    samples: int = 0
    sampling_s: float | None = None
    flags: list[str] = Field(default_factory=list)
    held_out: bool = False  # one of the package's held-out shapes (never searched on)


class Verdict(BaseModel):
    """What judging one candidate found. `correct` is False until the test passes (and the profile's
    re-checks after it); `reason` says why where it is False."""

    kernel: str
    target: str
    candidate: str
    correct: bool = False
    reason: str | None = None
    static_violations: list[str] = Field(default_factory=list)
    per_shape: list[ShapeVerdict] = Field(default_factory=list)
    speedup_geomean: float | None = None
    speedup_ci: list[float | None] | None = None
    verdict: str | None = None  # the A/B's: faster, slower or same
    device: str | None = None
    copy_bandwidth_gbs: float | None = None
    device_facts: list[str] = Field(default_factory=list)  # the timing machine (ProfileResult.device_facts)
    notes: list[str] = Field(default_factory=list)
    seconds: dict[str, float] = Field(default_factory=dict)  # per step: build, test, profile, total
    compiler_flags: list[str] = Field(default_factory=list)
    baseline: str = "package source"
    holdout_shapes: list[str] = Field(default_factory=list)
    checks: CheckCounts | None = None  # where the test step ran
    flags: list[str] = Field(default_factory=list)  # the profile's results that deserve a second look
    noise_floor: float | None = None  # the A/B's: how far unchanged code timed against itself may be off

    def limit(self, max_slowdown: float) -> float:
        """The speedup a shape's whole interval must lie below to count as slower: 1 / (1 + max_slowdown),
        or 1 - the A/B's noise floor where that is lower (kopt.models.regression_limit)."""
        return regression_limit(max_slowdown, self.noise_floor or 0.0)

    def regressions(self, max_slowdown: float) -> list[ShapeVerdict]:
        """The rows whose A/B interval lies wholly below limit(max_slowdown)."""
        floor = self.noise_floor or 0.0
        return [s for s in self.per_shape
                if s.speedup_ci and s.speedup_ci[1] is not None and slower_beyond(s.speedup_ci[1], max_slowdown,
                                                                                  floor)]  # fmt: skip
