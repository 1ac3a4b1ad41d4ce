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
# An argument's dtype: a storage dtype, or an integer one for index-like inputs (positions, token ids).
ArgDType = Literal["float32", "float16", "bfloat16", "int32", "int64"]

ELEMENT_SIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


class ArtifactRef(BaseModel):
    """Bytes kept out of workflow history: content address plus where to fetch them."""

    sha256: str
    size: int
    uri: str


# ---------------------------------------------------------------- kernel package (kernel.toml)


class Argument(BaseModel):
    """One tensor argument of the kernel's entry point, in call order (docs/kernel-packages.md)."""

    name: str
    role: Role
    shape: list[str]
    dtype: ArgDType | None = None  # None: the run's storage dtype
    exact: bool = False  # outputs that must match the reference bit for bit (e.g. a residual)
    # Float inputs only: False keeps the harness from rescaling it (the x0.01 / x100 variants, the
    # per-call factor of timed calls); for tables whose values mean something (a cos/sin cache).
    scale: bool = True
    # Integer inputs only: the valid values, [low, high) as expressions over the shape symbols. The
    # harness checks make_inputs() against it, or draws the values itself when make_inputs() leaves
    # the argument out (the edges low and high - 1 included).
    range: tuple[str, str] | None = None


class Tolerance(BaseModel):
    rtol: float
    atol: float


# docs/measurement.md (correctness 1) defaults when a package is silent about a dtype.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=1.3e-6, atol=1e-5),
    "float16": Tolerance(rtol=1e-3, atol=1e-3),
    "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-3),
}

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
    # Share of the workload (relative; kopt.workload): with weights, a profile's objective is the
    # workload-weighted time instead of the geomean over shapes. None: an unweighted shape.
    weight: float | None = Field(default=None, gt=0)

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.dims.items())


class ShapeSets(BaseModel):
    test: list[Shape]
    bench: list[Shape]
    # Shapes the optimizer never times or tests during its search; the best is judged on them at the
    # end of a run (held-out validation). None declared: kopt.holdout derives some from the bench shapes.
    holdout: list[Shape] = Field(default_factory=list)


class CostModel(BaseModel):
    bytes: str
    flops: str = "0"


class Dispatch(BaseModel):
    """Shape buckets for a shape-specialized best (kopt.dispatch; docs/kernel-packages.md, Dispatch):
    bucket i holds the calls whose `symbol` lies in (edges[i-1], edges[i]], the last one every call
    above the last edge. Each bucket may get its own tunable values; one library dispatches."""

    symbol: str
    edges: list[int] = Field(min_length=1, max_length=7)


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
    dispatch: dict[Target, Dispatch] = Field(default_factory=dict)
    # The values a caller may give each shape symbol, [min, max] inclusive (kernel.toml `[ranges]`):
    # the test draws shapes from size classes inside them (gpu_worker/fuzz.py). A min of 0 says an
    # empty call is legal. A symbol not listed ranges over [1, the largest declared value].
    ranges: dict[str, tuple[int, int]] = Field(default_factory=dict)
    # The values of a symbol that served models use most (kernel.toml `[sizes]`): every judgement tests
    # each of them, with the other symbols small, so a shortcut keyed on a common size is met.
    sizes: dict[str, list[int]] = Field(default_factory=dict)
    # The workload a target's kernel serves (kernel.toml `[workloads]`: a file in the package, as
    # `--workload` takes one): what a run of that target optimizes unless told otherwise.
    workloads: dict[Target, str] = Field(default_factory=dict)

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


# A shape is a regression when the whole 95 % interval of its A/B speedup lies below 1/(1 + this), and
# below 1 - the A/B's noise floor: the optimizer does not accept such a best (unless --allow-regressions)
# and `kopt verify` fails it.
SHAPE_SLOWDOWN_LIMIT = 0.02


def regression_limit(limit: float = SHAPE_SLOWDOWN_LIMIT, noise_floor: float = 0.0) -> float:
    """The speedup a shape's whole interval must lie below to be a regression: 1 / (1 + limit), or
    1 - noise_floor where that is lower. The same code timed against itself is off by up to the
    target's noise floor from run to run (docs/measurement.md, timing 7; CPU 4 %), so a limit inside
    it would fail unchanged code now and then (docs/decisions/0027)."""
    return min(1.0 / (1.0 + limit), 1.0 - noise_floor)


def slower_beyond(ci_high: float | None, limit: float = SHAPE_SLOWDOWN_LIMIT, noise_floor: float = 0.0) -> bool:
    """The rule of the per-shape guard, the gate and the nightly re-check: the whole interval of a
    shape's speedup lies below regression_limit(limit, noise_floor)."""
    return ci_high is not None and ci_high < regression_limit(limit, noise_floor)


class ShapeSpeedup(BaseModel):
    shape: str
    dtype: DType
    baseline_us: float
    candidate_us: float
    speedup: float
    pct_sol: float | None = None
    ci_low: float | None = None  # 95 % interval of the speedup (interleaved A/B)
    ci_high: float | None = None
    noise_floor: float = 0.0  # the A/B's (0 in runs recorded before NOISE_FLOOR_PATCH)

    def regression(self, limit: float = SHAPE_SLOWDOWN_LIMIT) -> bool:
        return slower_beyond(self.ci_high, limit, self.noise_floor)


# What became of a round's candidate. Records written before the field have none: `kind` reads their
# failure text instead (its words before the first colon were the status).
RoundStatus = Literal["measured", "no candidate", "evaluating", "compile error", "wrong result", "profile failed",
                      "cancelled"]  # cancelled: still running when the run's wall-time budget ran out
FAILURE_STATUSES: tuple[str, ...] = ("compile error", "wrong result", "profile failed")
EVALUATING = "being evaluated in this round"  # the failure text of a record whose candidate is not judged yet


class RoundRecord(BaseModel):
    """One finished round, compact: what the planner sees and what the report lists.

    The full detail (source, diff, compiler output, checks, timings) stays in workflow history.
    """

    round: int
    candidate_id: str
    description: str
    tunables: dict[str, int]
    flags: list[str]
    slot: int = 0  # which of the round's candidates (--candidates N)
    compiled: bool
    correct: bool
    speedup_geomean: float | None = None
    failure: str | None = None
    compile_seconds: float | None = None
    per_shape: list[ShapeSpeedup] = Field(default_factory=list)
    speedup_ci: list[float] | None = None  # 95% interval of the geomean speedup (interleaved A/B)
    accepted: bool = False  # became the new best
    regressions: list[str] = Field(default_factory=list)  # "shape dtype" statistically slower than the baseline
    status: RoundStatus | None = None  # None in records written before the field (see `kind`)
    # The round's best timed head to head against the run's best (HEAD_TO_HEAD_PATCH): its speed over the
    # best's, and the interval; None where it was not (the best was the baseline, or an older run).
    versus_best: float | None = None
    versus_best_ci: list[float] | None = None
    gpu_index: int | None = None  # the GPU that timed the candidate, where the exec workers drive several
    refusal: str | None = None  # why the round's best did not become the run's best (a rule of workflows/rules.py)

    @property
    def kind(self) -> RoundStatus:
        """The status, or for an older record the one its failure text and figures imply."""
        if self.status is not None:
            return self.status
        if self.speedup_geomean is not None:
            return "measured"
        if self.failure == EVALUATING:
            return "evaluating"
        head = (self.failure or "").split(":", 1)[0]
        if head in FAILURE_STATUSES:
            return head  # type: ignore[return-value]
        return "measured" if self.compiled and not self.failure else "no candidate"


class HistoryDigest(BaseModel):
    """The records older than a plan request's `history` window, in bounded space (kopt.plan_history).

    Enough for a planner never to repeat a configuration and to see what worked and what failed;
    each record is in full in the workflow history of its own round.
    """

    records: int = 0  # candidates summarized (rounds x candidates per round)
    last_round: int = 0  # rounds 1..last_round are summarized here
    # Every configuration tried (kopt.plan_history.config_key) -> outcome of its latest try, e.g.
    # "1.013x", "1.013x best", "compile error"; oldest first. One entry per distinct configuration.
    tried: dict[str, str] = Field(default_factory=dict)
    failures: dict[str, int] = Field(default_factory=dict)  # the most frequent failure reasons -> count
    top: list[str] = Field(default_factory=list)  # the fastest few, one line each


class PlanRequest(BaseModel):
    package: PackageRef
    target: Target
    round: int
    best: Candidate
    best_speedup: float
    history: list[RoundRecord]  # the most recent records in full (all of them in runs before the digest)
    provider: str = "offline"
    seed: int = 0
    earlier: HistoryDigest | None = None  # everything older than `history`, compacted


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
    describe_toolchain: bool = False  # the result carries toolchain_facts (the run asks with its baseline)


class CompileResult(BaseModel):
    candidate_id: str
    ok: bool
    library: ArtifactRef | None = None
    seconds: float
    log_tail: str = ""  # last few KB of the compiler output
    log: ArtifactRef | None = None  # full compiler output
    resource_usage: str = ""  # ptxas -v lines (CUDA)
    command: list[str] = Field(default_factory=list)
    # Where asked (describe_toolchain): the building worker's compiler and version, fixed build command,
    # allowed headers and options, and the toolkit headers' declarations, a fact a line, for the agents.
    toolchain_facts: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------- execution (test, profile)

TimingMode = Literal["auto", "cold", "graph"]
# Whose code a failed test or profile step failed in: the candidate's library, the baseline's (loaded
# beside it for calibration and the A/B) or the package's own reference.py. Not set where the harness
# itself failed (a Python error, a timeout) or the step passed.
FailedParty = Literal["candidate", "baseline", "package"]


class ExecRequest(BaseModel):
    package: PackageRef
    target: Target
    candidate_id: str
    library: ArtifactRef
    shapes: list[Shape]
    dtypes: list[DType]
    seed: int = 0
    timeout_s: float = 300.0
    # Candidate source text: static checks (includes, streams, threads, library calls) run on it
    # before the library is loaded. None: only the compiled library's symbols are checked.
    source: str | None = None
    # The package baseline, loaded into the same harness process: it calibrates the candidate's
    # error bound on the very same inputs (test) and is timed interleaved with it (profile: A/B).
    baseline_library: ArtifactRef | None = None
    baseline_id: str | None = None
    # Without a baseline library: the baseline's max |err| per check key ("shape dtype variant",
    # see ShapeCheck.key) from its own TestResult, used as the calibration instead.
    baseline_errors: dict[str, float] = Field(default_factory=dict)
    trials: int = 2  # seeded trials per declared shape and dtype (variants add their own)
    edge_shapes: bool = True  # add 1-row, all-ones and prime-size shapes derived from `shapes`
    # One shape far above the fuzzed shapes' budget (gpu_worker/fuzz.large_shape): the gates (kopt evaluate,
    # kopt verify) check it; an optimization round does not (seconds on CPU).
    large_shapes: bool = False
    timing_mode: TimingMode = "auto"  # auto: CUDA graph mode when a cold call takes < ~20 us
    time_cap_s: float | None = None  # sampling cap per shape and dtype; None: the target's default
    memory_limit_mb: int = 8192  # address-space headroom of the harness (CPU target only)
    sanitize: bool = True  # compute-sanitizer memcheck on CUDA where the tool exists
    # Profile, CUDA: a short Nsight Compute summary where the library is the baseline (no baseline_library)
    # or came out faster than the baseline in the A/B, above the best so far (a contender); for the profile analyst.
    nsight: bool = False
    nsight_above: float | None = None  # ... and, given, only where its A/B speedup is above this (the best's)
    noise_floor: float = 0.0  # A/B: a speedup is significant only if its CI low > 1 + noise_floor


class ShapeCheck(BaseModel):
    shape: str
    dtype: DType
    ok: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    message: str | None = None
    variant: str = ""  # "" declared inputs; "edge", "x0.01", "x100", "special", "strided"
    skipped: bool = False  # the variant does not apply (the baseline or reference cannot do it)
    baseline_max_abs_err: float | None = None
    error_bound: float | None = None  # calibrated bound on max_abs_err (2x baseline + floor)

    @property
    def key(self) -> str:
        return " ".join(p for p in (self.shape, self.dtype, self.variant) if p)


class TestResult(BaseModel):
    __test__ = False  # not a pytest class

    candidate_id: str
    correct: bool
    reason: str | None = None
    checks: list[ShapeCheck] = Field(default_factory=list)  # one per declared shape and dtype
    device: str = ""
    seconds: float = 0.0
    # Edge shapes, input scales, special values and layouts derived from the declared suite.
    variant_checks: list[ShapeCheck] = Field(default_factory=list)
    static_violations: list[str] = Field(default_factory=list)
    sanitizer: str | None = None  # compute-sanitizer summary, or why it did not run
    notes: list[str] = Field(default_factory=list)  # what was skipped or relaxed, and why
    reused_from: str | None = None  # the candidate these library bytes passed as earlier in the run
    # The check group at which a candidate call faulted on memory (CPU: SIGSEGV or SIGBUS; CUDA: an
    # illegal address): the runner then names the argument it went through (gpu_worker/runner.py).
    fault_group: str | None = None
    failed_party: FailedParty | None = None  # whose code failed, where the harness knows it
    gpu_index: int | None = None  # the GPU (nvidia-smi index) that ran it, where a worker drives several
    # With a baseline loaded beside the candidate: the first check at which the baseline took the call and
    # failed it (as a failed check reads). Not the candidate's fault (that check is skipped for it), but
    # the package's baseline disagreeing with its reference: `kopt evaluate` / `verify` fail on it as a
    # run fails at round 0 (a newcomer's float32 LayerNorm under the x100 variant, #29).
    baseline_reason: str | None = None


class ShapeTiming(BaseModel):
    shape: str
    dtype: DType
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    gbytes_per_s: float
    pct_sol: float | None = None  # of the worker's measured copy bandwidth
    # cold: L2 flushed before each event-timed call; graph: CUDA graph of back-to-back calls over
    # rotating inputs larger than L2, per call; hot-cpu: wall clock, CPU caches not flushed.
    mode: str = "cold"
    rse: float | None = None  # relative standard error of the mean at the stop
    throttled_dropped: int = 0  # samples dropped because the GPU reported a thermal/power slowdown
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    temperature_c: float | None = None
    flags: list[str] = Field(default_factory=list)  # e.g. above 105% of the copy bandwidth
    seconds: float | None = None  # wall time spent on this shape and dtype (inputs, checks, sampling)
    sampling_s: float | None = None  # of which the sampling loop (both sides of an A/B)


class ShapeAB(BaseModel):
    """Baseline and candidate timed interleaved on one shape: ratio of medians, bootstrap CI."""

    shape: str
    dtype: DType
    mode: str
    baseline_us: float
    candidate_us: float
    speedup: float  # baseline median / candidate median
    ci_low: float
    ci_high: float
    baseline_samples: int
    candidate_samples: int


class ABResult(BaseModel):
    baseline_id: str | None = None
    per_shape: list[ShapeAB] = Field(default_factory=list)
    # The objective's speedup over the shapes: their geomean, or with weighted shapes (a workload)
    # baseline time / candidate time summed over the shapes by weight ("objective").
    speedup_geomean: float | None = None
    ci_low: float | None = None  # 95% bootstrap interval of that speedup
    ci_high: float | None = None
    objective: Literal["geomean", "workload"] = "geomean"
    confidence: float = 0.95
    noise_floor: float = 0.0
    verdict: Literal["faster", "slower", "same"] = "same"


class Partial(BaseModel):
    """One finished piece of a test or profile job (a check group, or a timed shape and dtype),
    reported by the harness as it completes. Heartbeated by the activity, so that a retry after a
    lost worker resumes after the pieces already done instead of paying for them again."""

    key: str  # "test <check key>" or "profile <shape> <dtype>"
    check: ShapeCheck | None = None
    timing: ShapeTiming | None = None
    ab: ShapeAB | None = None


class ExecProgress(BaseModel):
    """Heartbeat details of the test and profile activities."""

    step: str = ""
    partials: list[Partial] = Field(default_factory=list)


class NsightKernel(BaseModel):
    """One kernel as Nsight Compute measured it (gpu_worker/nsight.py); percentages of peak."""

    name: str
    time_us: float
    grid: str = ""
    block: str = ""
    registers: float | None = None  # per thread
    occupancy_pct: float | None = None  # achieved
    theoretical_occupancy_pct: float | None = None
    dram_pct: float | None = None
    l2_pct: float | None = None
    sm_pct: float | None = None
    stalls: dict[str, float] = Field(default_factory=dict)  # top warp-stall reasons, cycles per issued instruction

    def line(self) -> str:
        pct = lambda v: "?" if v is None else f"{v:.0f}%"  # noqa: E731
        stalls = ", ".join(f"{k} {v:.1f}" for k, v in self.stalls.items()) or "none reported"
        regs = "?" if self.registers is None else f"{self.registers:.0f}"
        return (f"{self.name}: {self.time_us:.2f} us, grid {self.grid} x block {self.block}, {regs} registers/thread, "
                f"occupancy {pct(self.occupancy_pct)} achieved of {pct(self.theoretical_occupancy_pct)}, "
                f"DRAM {pct(self.dram_pct)}, L2 {pct(self.l2_pct)}, SM {pct(self.sm_pct)} of peak; "
                f"top stalls (cycles per instruction): {stalls}")  # fmt: skip


class NsightSummary(BaseModel):
    """A short Nsight Compute profile of a CUDA library at one timed shape (advisory, for the analyst)."""

    shape: str
    dtype: str
    kernels: list[NsightKernel] = Field(default_factory=list)
    seconds: float = 0.0  # what it cost, tool start included
    note: str | None = None  # why there is no profile (no tool, counters refused, timed out)

    def lines(self) -> list[str]:
        head = f"Nsight Compute at {self.shape} {self.dtype} ({self.seconds:.1f} s)"
        if not self.kernels:
            return [f"{head}: {self.note or 'no kernel profiled'}"]
        return [f"{head}:", *(f"- {k.line()}" for k in self.kernels)]


class ProfileResult(BaseModel):
    candidate_id: str
    ok: bool
    reason: str | None = None
    timings: list[ShapeTiming] = Field(default_factory=list)
    device: str = ""
    copy_bandwidth_gbs: float | None = None
    seconds: float = 0.0
    peak_bandwidth_gbs: float | None = None  # datasheet (CUDA) or sanity bound (CPU)
    ab: ABResult | None = None  # when a baseline library was given
    flags: list[str] = Field(default_factory=list)  # results that deserve a second look
    notes: list[str] = Field(default_factory=list)
    reused_from: str | None = None  # the candidate these library bytes were timed as earlier in the run
    failed_party: FailedParty | None = None  # whose code failed, where the harness knows it
    # What the machine that timed it is, one fact a line (gpu_worker/device.py: instruction sets, cores,
    # caches; compute capability, SMs, L2, shared memory, registers): the agents' prompts show them.
    gpu_index: int | None = None  # the GPU (nvidia-smi index) that timed it, where a worker drives several
    device_facts: list[str] = Field(default_factory=list)
    nsight: NsightSummary | None = None  # CUDA, where asked (ExecRequest.nsight) and it ran


# ---------------------------------------------------------------- workflow
