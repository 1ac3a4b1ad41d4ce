"""report.json of a finished optimization run: what it was asked, where it ran, every round, the best,
and the held-out and shape-specialized steps (frontend/report.py writes it and renders report.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kopt.models import NsightSummary, RoundRecord, ShapeTiming
from kopt.run_models import BestSummary, HoldoutResult, SpecializedResult, Usage


class ReportBaseline(BaseModel):
    """The package's own kernel as the run measured it."""

    candidate_id: str
    flags: list[str] = Field(default_factory=list)
    tunables: dict[str, int] = Field(default_factory=dict)
    compile_seconds: float | None = None
    per_shape: list[ShapeTiming] = Field(default_factory=list)
    copy_bandwidth_gbs: float | None = None
    nsight: NsightSummary | None = None  # CUDA: its Nsight Compute summary at one timed shape


class WorkloadWeight(BaseModel):
    shape: str
    weight: float


class RunReport(BaseModel):
    run_id: str
    temporal_run_id: str
    web_ui: str | None = None
    kernel: str
    target: str
    gpu_class: str | None = None
    toolchain: str
    # The build worker's facts of its toolchain and the timing worker's of its machine (the baseline's
    # compile and profile): what the agents' prompts showed.
    toolchain_facts: list[str] = Field(default_factory=list)
    device_facts: list[str] = Field(default_factory=list)
    provider: str
    rounds_requested: int
    status: str
    device: str | None = None
    baseline: ReportBaseline
    segments: int = 1
    stop_reason: str | None = None
    extra_test_shapes: list[dict[str, int]] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    candidates_per_round: int = 1
    single_agent: bool = False
    model: str | None = None
    rounds: list[RoundRecord] = Field(default_factory=list)
    best: BestSummary | None = None  # written without its source (best_<source> holds it)
    allow_regressions: bool = False
    # Every (shape, dtype) where the best is statistically slower than the baseline, and every round
    # candidate that was, with the shapes (the per-shape guard).
    best_regressions: list[str] = Field(default_factory=list)
    round_regressions: dict[str, list[str]] = Field(default_factory=dict)
    holdout: HoldoutResult | None = None
    specialized: SpecializedResult | None = None
    # The search's objective: the geomean over the bench shapes, or the workload-weighted time.
    objective: Literal["geomean", "workload"] = "geomean"
    workload: list[WorkloadWeight] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude={"best": {"source"}}) + "\n"
