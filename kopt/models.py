"""Pydantic contracts shared by the CLI, the workflow, the activities and the workers.

One model in and one model out per activity and per workflow, so fields can be added without
breaking running workflows. Everything here must stay importable inside the workflow sandbox:
no I/O, no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Target = Literal["cpu", "cuda"]
Role = Literal["in", "out", "inout"]
DType = Literal["float32", "float16", "bfloat16"]

ELEMENT_SIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class ArtifactRef(BaseModel):
    """Bytes kept out of workflow history: content address plus where to fetch them."""

    sha256: str
    size: int
    uri: str


# ---------------------------------------------------------------- kernel package (kernel.toml)


class Argument(BaseModel):
    name: str
    role: Role
    shape: list[str]
    dtype: DType | None = None  # None: the run's storage dtype
    exact: bool = False  # outputs that must match the reference bit for bit (e.g. a residual)


class Tolerance(BaseModel):
    rtol: float
    atol: float


class Tunable(BaseModel):
    name: str
    target: Target
    values: list[int]
    help: str = ""


class BuildSpec(BaseModel):
    flags: list[str] = Field(default_factory=list)


class Shape(BaseModel):
    """One problem size: values for the package's shape symbols, e.g. {"T": 512, "D": 14336}."""

    dims: dict[str, int]

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.dims.items())


class ShapeSets(BaseModel):
    test: list[Shape]
    bench: list[Shape]


class CostModel(BaseModel):
    bytes: str
    flops: str = "0"


class KernelSpec(BaseModel):
    """The parsed, validated kernel.toml plus the baseline sources it names."""

    name: str
    summary: str = ""
    entry: str
    targets: list[Target]
    dtypes: list[DType]
    origin: str = ""
    sources: dict[Target, str]
    arguments: list[Argument]
    tolerances: dict[DType, Tolerance] = Field(default_factory=dict)
    model: CostModel
    build: dict[Target, BuildSpec] = Field(default_factory=dict)
    tunables: list[Tunable] = Field(default_factory=list)
    shapes: dict[Target, ShapeSets]

    def tunables_for(self, target: Target) -> list[Tunable]:
        return [t for t in self.tunables if t.target == target]


class PackageRef(BaseModel):
    """A kernel package as activities see it: its spec inline, its files by content address."""

    spec: KernelSpec
    files: ArtifactRef  # tar of the package folder (reference.py, sources, kernel.toml)
    baseline_sources: dict[Target, str]  # baseline source text, inline for audit


# ---------------------------------------------------------------- candidates and agents


class Candidate(BaseModel):
    """One kernel version: source plus compile flags. Its id is a hash of both and the toolchain."""

    id: str
    source: str
    flags: list[str]
    tunables: dict[str, int] = Field(default_factory=dict)
    parent_id: str | None = None
    origin: str = "baseline"  # "baseline" or the plan that produced it


class RoundRecord(BaseModel):
    """What the planner sees of one finished round."""

    round: int
    candidate_id: str
    description: str
    tunables: dict[str, int]
    flags: list[str]
    compiled: bool
    correct: bool
    speedup_geomean: float | None = None
    failure: str | None = None


class PlanRequest(BaseModel):
    package: PackageRef
    target: Target
    round: int
    best: Candidate
    best_speedup: float
    history: list[RoundRecord]
    provider: str = "offline"
    seed: int = 0


class Plan(BaseModel):
    round: int
    description: str
    rationale: str
    tunables: dict[str, int]  # full assignment to apply
    flags: list[str]  # full flag list to compile with
    exhausted: bool = False  # the planner has nothing new to try


class CodeRequest(BaseModel):
    package: PackageRef
    target: Target
    toolchain: str
    plan: Plan
    base: Candidate
    provider: str = "offline"


class CodeResult(BaseModel):
    candidate: Candidate
    diff: str


# ---------------------------------------------------------------- build


class CompileRequest(BaseModel):
    package: PackageRef
    target: Target
    toolchain: str
    candidate: Candidate


class CompileResult(BaseModel):
    candidate_id: str
    ok: bool
    library: ArtifactRef | None = None
    seconds: float
    log_tail: str = ""  # last few KB of the compiler output
    log: ArtifactRef | None = None  # full compiler output
    resource_usage: str = ""  # ptxas -v lines (CUDA)
    command: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------- execution (test, profile)


class ExecRequest(BaseModel):
    package: PackageRef
    target: Target
    candidate_id: str
    library: ArtifactRef
    shapes: list[Shape]
    dtypes: list[DType]
    seed: int = 0
    timeout_s: float = 300.0


class ShapeCheck(BaseModel):
    shape: str
    dtype: DType
    ok: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    message: str | None = None


class TestResult(BaseModel):
    __test__ = False  # not a pytest class

    candidate_id: str
    correct: bool
    reason: str | None = None
    checks: list[ShapeCheck] = Field(default_factory=list)
    device: str = ""
    seconds: float = 0.0


class ShapeTiming(BaseModel):
    shape: str
    dtype: DType
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    gbytes_per_s: float
    pct_sol: float | None = None  # of the worker's measured copy bandwidth


class ProfileResult(BaseModel):
    candidate_id: str
    ok: bool
    reason: str | None = None
    timings: list[ShapeTiming] = Field(default_factory=list)
    device: str = ""
    copy_bandwidth_gbs: float | None = None
    seconds: float = 0.0


# ---------------------------------------------------------------- workflow


class OptimizeRequest(BaseModel):
    package: PackageRef
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


class ShapeSpeedup(BaseModel):
    shape: str
    dtype: DType
    baseline_us: float
    candidate_us: float
    speedup: float
    pct_sol: float | None = None


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
    per_shape: list[ShapeSpeedup] = Field(default_factory=list)


class BestSummary(BaseModel):
    candidate_id: str
    round: int
    correct: bool
    speedup_geomean: float
    per_shape: list[ShapeSpeedup]
    tunables: dict[str, int]
    flags: list[str]
    source: str


class Progress(BaseModel):
    """Answer of the workflow's `progress` query."""

    phase: str
    round: int
    rounds: int
    events: list[str] = Field(default_factory=list)  # the latest events only
    event_total: int = 0  # events ever emitted, so a follower knows how many it missed
    best_speedup: float | None = None


class OptimizeResult(BaseModel):
    kernel: str
    target: Target
    gpu_class: str | None
    status: Literal["completed", "baseline_failed"]
    reason: str | None = None
    baseline: CandidateOutcome
    rounds: list[CandidateOutcome]
    best: BestSummary | None
