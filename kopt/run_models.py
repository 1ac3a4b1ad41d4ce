"""Contracts of the OptimizeKernel workflow: its request, state, progress and result.

Separate from kopt.models because a run's request also carries the LLM provider's settings
(kopt.agent_models). Importable inside the workflow sandbox: no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kopt.agent_models import LLMCall, LLMConfig
from kopt.models import (
    Candidate,
    CompileResult,
    NsightSummary,
    PackageRef,
    ProfileResult,
    RoundRecord,
    Shape,
    ShapeSpeedup,
    Target,
    TestResult,
)


class Budgets(BaseModel):
    """Limits that stop a run cleanly, keeping the best result so far (None: no limit)."""

    max_cost_usd: float | None = None
    max_tokens: int | None = None
    max_gpu_seconds: float | None = None
    max_wall_time_s: float | None = None
    # When the wall-time budget started (epoch seconds): the command's start, so that starting the dev
    # server and workers counts too and `--max-wall-time S` bounds the whole command. Never later than
    # the workflow's start; None: from the workflow's start (runs started by older front ends).
    wall_time_from: float | None = None


class Usage(BaseModel):
    """What a run has spent so far."""

    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    unpriced_calls: int = 0
    device_seconds: float = 0.0
    nsight_seconds: float = 0.0  # of device_seconds: the Nsight Compute summaries (CUDA)

    def add_calls(self, calls: list[LLMCall]) -> None:
        for c in calls:
            self.llm_calls += 1
            self.prompt_tokens += c.usage.prompt_tokens
            self.completion_tokens += c.usage.completion_tokens
            if c.cost_usd is None:
                self.unpriced_calls += 1
            else:
                self.cost_usd += c.cost_usd


class CandidateOutcome(BaseModel):
    round: int
    candidate_id: str
    description: str
    tunables: dict[str, int]
    flags: list[str]
    diff: str = ""
    compile: CompileResult | None = None
    test: TestResult | None = None
    profile: ProfileResult | None = None
    correct: bool = False
    speedup_geomean: float | None = None
    speedup_ci: list[float] | None = None  # 95% interval of the geomean speedup (interleaved A/B)
    per_shape: list[ShapeSpeedup] = Field(default_factory=list)


class ActivityTimeouts(BaseModel):
    """Per-queue timeouts in seconds. A dead worker is noticed after its heartbeat timeout."""

    agent_s: float = Field(300, gt=0)
    agent_heartbeat_s: float = Field(30, gt=0)
    compile_s: float = Field(600, gt=0)
    compile_heartbeat_s: float = Field(10, gt=0)
    exec_s: float = Field(1200, gt=0)
    exec_heartbeat_s: float = Field(20, gt=0)  # a dead worker is noticed, and a cancellation arrives, within ~this


class Approval(BaseModel):
    """Update sent to a run started with --approve: accept or reject a pending new best."""

    candidate_id: str
    accept: bool = True


class BestSummary(BaseModel):
    candidate_id: str
    round: int
    correct: bool
    speedup_geomean: float
    per_shape: list[ShapeSpeedup]
    speedup_ci: list[float] | None = None
    tunables: dict[str, int]
    flags: list[str]
    source: str
    nsight: NsightSummary | None = None  # its Nsight Compute summary (CUDA), from the profile that judged it


class RunState(BaseModel):
    """What a run carries across continue-as-new: the best so far and a compact summary."""

    baseline: CandidateOutcome
    best: Candidate
    best_summary: BestSummary
    best_outcome: CandidateOutcome  # its compile report and profile feed the profile analyst
    rounds: list[RoundRecord] = Field(default_factory=list)
    next_round: int = 1
    segment: int = 1
    events: list[str] = Field(default_factory=list)  # progress events, so followers see no gap
    event_total: int = 0
    usage: Usage = Field(default_factory=Usage)
    extra_test_shapes: list[Shape] = Field(default_factory=list)  # accepted from the test designer
    rounds_since_improvement: int = 0
    started_at: float | None = None  # workflow time (epoch seconds) of the first segment
    last_round_s: float | None = None  # workflow time the last round took (BUDGET_RESERVE_PATCH)
    last_round_device_s: float | None = None  # and the device time it used
    resumed: bool = False  # set by `kopt resume`: the first round may take its answers from the reply cache


class ResumePoint(BaseModel):
    """Where a run that ended early can go on from (workflow query `resume_point`): its request and
    its state after the last round it finished (None: it had not finished measuring the baseline)."""

    request: OptimizeRequest
    state: RunState | None = None


class OptimizeRequest(BaseModel):
    package: PackageRef
    reference_source: str = ""  # the package's reference.py, for the planner's and coder's prompts
    target: Target
    gpu_class: str | None = None  # for target cuda
    toolchain: str
    baseline: Candidate
    rounds: int = 5
    provider: str = "offline"
    seed: int = 0
    # A candidate replaces the best only if its geomean speedup over the best beats this margin,
    # so timing noise is not mistaken for progress.
    min_gain: float = 0.02
    approve: bool = False  # wait for an Approval update before accepting a new best
    allow_regressions: bool = False  # a new best may be slower than the baseline at some shapes
    continue_every: int = 50  # rounds per history segment (continue-as-new), also on server suggestion
    timeouts: ActivityTimeouts = Field(default_factory=ActivityTimeouts)
    llm: LLMConfig | None = None  # provider "openai": endpoint, models, prices (never the key)
    candidates_per_round: int = 1
    # Offline runs of several candidates a round judge them in asynchronous slots (each compared with the
    # best as it finishes, its slot then taking the next proposal); lockstep judges a round's candidates
    # together and compares only their fastest with the best, as LLM runs always do.
    lockstep: bool = False
    # Sampling cap per shape and dtype of every profile (seconds); None: the target's default. Short
    # runs whose timing precision does not matter (tests of the workflow itself) set it low.
    time_cap_s: float | None = Field(default=None, gt=0)
    single_agent: bool = False  # one combined agent (the ablation Astra reports)
    patience: int | None = None  # stop after this many rounds without an accepted improvement
    budgets: Budgets = Field(default_factory=Budgets)
    # Shapes the search never sees: the best is tested and timed on them once, after the last round
    # (OptimizeResult.holdout). Chosen by kopt.holdout when the request is made.
    holdout_shapes: list[Shape] = Field(default_factory=list)
    # Weighted shapes (kopt.workload) timed instead of the package's bench shapes; the profile's
    # objective is then the workload-weighted time. Empty: the bench shapes and their geomean.
    workload: list[Shape] = Field(default_factory=list)
    state: RunState | None = None  # set by continue-as-new only


class Progress(BaseModel):
    """Answer of the workflow's `progress` query."""

    phase: str
    round: int
    rounds: int
    events: list[str] = Field(default_factory=list)  # the latest events only
    event_total: int = 0  # events ever emitted, so a follower knows how many it missed
    best_speedup: float | None = None
    segment: int = 1
    usage: Usage = Field(default_factory=Usage)
    pending_approval: str | None = None  # candidate id waiting for an Approval update

    def details(self) -> str:
        """The run as the Web UI's "current details" show it while it runs (markdown)."""
        best = "no best yet" if self.best_speedup is None else f"best {self.best_speedup:.3f}x"
        head = f"**round {self.round} of {self.rounds}**: {self.phase}, {best}"
        if self.pending_approval:
            head += f"; waiting for approval of {self.pending_approval}"
        return head + "".join(f"\n- {e}" for e in self.events[-3:])


class HoldoutResult(BaseModel):
    """The best judged on shapes the search never tested or timed, against the baseline."""

    candidate_id: str
    shapes: list[str]
    correct: bool
    reason: str | None = None  # why it is not correct, or why no speedup was measured
    per_shape: list[ShapeSpeedup] = Field(default_factory=list)
    speedup_geomean: float | None = None
    speedup_ci: list[float] | None = None
    verdict: str | None = None  # "faster", "same", "slower" (the A/B rule of the search)
    search_speedup: float | None = None  # the best's geomean on the search shapes, for comparison
    overfit: bool = False  # wins on the search shapes, wrong or not faster on the held-out ones
    regressions: list[str] = Field(default_factory=list)  # held-out (shape, dtype) slower than the baseline
    # Of those, the ones in a dtype the best was already slower at on the search shapes: no overfit
    # (rules.held_out_overfit). Runs recorded before the field counted them as overfit.
    foretold: list[str] = Field(default_factory=list)


class SpecializedResult(BaseModel):
    """The shape-specialized step after the search (kopt.dispatch): per-bucket tunable values taken
    from the measured candidates, built into one library, then tested and timed like a candidate."""

    buckets: list[str]  # "T <= 64", "T > 64"
    settings: list[dict[str, int]] = Field(default_factory=list)  # tunable values per bucket
    picked_from: list[str] = Field(default_factory=list)  # the candidate each bucket's values came from
    candidate_id: str | None = None
    correct: bool = False
    tested: list[str] = Field(default_factory=list)  # the shapes it was checked at (bucket edges included)
    speedup_geomean: float | None = None
    speedup_ci: list[float] | None = None
    per_shape: list[ShapeSpeedup] = Field(default_factory=list)
    regressions: list[str] = Field(default_factory=list)
    bucket_gains: list[float] = Field(default_factory=list)  # per bucket: its geomean speedup over the best's
    accepted: bool = False  # became the best
    reason: str | None = None  # why nothing was built, or why it was not accepted


class OptimizeResult(BaseModel):
    kernel: str
    target: Target
    gpu_class: str | None
    status: Literal["completed", "baseline_failed"]
    reason: str | None = None
    baseline: CandidateOutcome
    rounds: list[RoundRecord]
    best: BestSummary | None
    segments: int = 1
    stop_reason: str | None = None  # why the run ended before its last round (budget, patience...)
    llm_stopped: bool = False  # stop_reason is an LLM endpoint error no retry could fix (key, model)
    extra_test_shapes: list[Shape] = Field(default_factory=list)  # added by the test designer
    usage: Usage = Field(default_factory=Usage)
    holdout: HoldoutResult | None = None  # the best on the held-out shapes (runs with holdout_shapes)
    specialized: SpecializedResult | None = None  # packages with [dispatch.<target>]


ResumePoint.model_rebuild()


class ReverifyRequest(BaseModel):
    """Input of ReverifyBest (a scheduled nightly check): a run's best, judged again against the
    baseline on the exec queue of each GPU class (CPU: the CPU queue)."""

    run: str  # the run whose best this is
    package: PackageRef
    target: Target
    toolchain: str
    baseline: Candidate
    best: Candidate
    gpu_classes: list[str] = Field(default_factory=list)  # cuda: one verdict per class
    seed: int = 0
    timeouts: ActivityTimeouts = Field(default_factory=ActivityTimeouts)


class ClassVerdict(BaseModel):
    gpu_class: str | None  # None: the CPU target
    correct: bool
    reason: str | None = None
    speedup_geomean: float | None = None
    speedup_ci: list[float] | None = None
    regressions: list[str] = Field(default_factory=list)  # "shape dtype" slower than the baseline

    @property
    def ok(self) -> bool:
        return self.correct and not self.regressions


class ReverifyResult(BaseModel):
    run: str
    candidate_id: str
    verdicts: list[ClassVerdict]
    ok: bool  # correct everywhere and no shape slower than the baseline anywhere
