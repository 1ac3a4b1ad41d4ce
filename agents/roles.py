"""LLM agent roles: test designer, profile analyst, planner, coder (+ compile repair), single agent.

Each role renders its prompt (agents/prompts/<role>.md), asks the `openai` provider for one JSON
object in its reply schema (agents/llm.py: one repair turn, errors mapped for Temporal) and returns
its output with the audit records of every call. Requests may carry an LLMConfig; without one the
agent worker's own KOPT_OPENAI_* settings apply.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, Field, StrictInt

from agents.llm import chat_json, render, schema_text
from agents.playbook import PLAYBOOK
from kopt.agent_models import (
    EVALUATING,
    AnalyzeRequest,
    Diagnosis,
    LLMCall,
    LLMConfig,
    RepairRequest,
    SingleAgentRequest,
    TestDesign,
    TestDesignRequest,
    shape_symbols,
)
from kopt.candidates import candidate_id, unified_diff
from kopt.flags import check_flags  # noqa: F401 - the allow-list; re-exported for callers
from kopt.models import (
    DEFAULT_TOLERANCES,
    Candidate,
    CodeRequest,
    CodeResult,
    HistoryDigest,
    KernelSpec,
    PackageRef,
    Plan,
    PlanRequest,
    ProfileResult,
    RoundRecord,
    Target,
)
from kopt.package import PackageError, apply_tunables

DESCRIPTION_CHARS = 160
EARLIER_CONFIGS = 60  # configurations of the history digest a prompt lists one by one (the most recent)

# ---------------------------------------------------------------- reply schemas


class PlannerReply(BaseModel):
    description: str
    rationale: str
    tunables: dict[str, StrictInt] = Field(default_factory=dict)  # only the ones that change
    flags: list[str] | None = None  # full list; None keeps the best's
    exhausted: bool = False


class CoderReply(BaseModel):
    source: str
    summary: str = ""


class SingleAgentReply(PlannerReply):
    source: str | None = None
    summary: str = ""


# ---------------------------------------------------------------- checks (pure)

def check_tunables(spec: KernelSpec, target: Target, tunables: dict[str, int]) -> list[str]:
    declared = {t.name: t for t in spec.tunables_for(target)}
    problems = []
    for name, value in tunables.items():
        if name not in declared:
            problems.append(f"tunable {name!r} is not declared for target {target} (declared: {sorted(declared)})")
        elif value not in declared[name].values:
            problems.append(f"tunable {name}={value} is not an allowed value {declared[name].values}")
    return problems


def strip_fences(source: str) -> str:
    """A source wrapped whole in a Markdown fence, unwrapped."""
    m = re.fullmatch(r"\s*```[\w+-]*[ \t]*\n(.*?)\n?```\s*", source, flags=re.S)
    return (m.group(1) if m else source).strip("\n") + "\n"


# ---------------------------------------------------------------- prompt context


def _config(req: BaseModel) -> LLMConfig:
    cfg = getattr(req, "llm", None)
    if cfg is not None:
        return cfg
    from kopt.llm_settings import LLMSettings, llm_config  # the worker's environment, read at call time

    return llm_config(LLMSettings())


def _arguments(spec: KernelSpec) -> str:
    return "\n".join(f"- {a.name}: role {a.role}, shape [{', '.join(a.shape)}], dtype {a.dtype or 'run dtype'}"
                     + (", must match exactly" if a.exact else "") for a in spec.arguments)


def _tunables(spec: KernelSpec, target: Target) -> str:
    lines = [f"- {t.name}: {t.values}; {t.help}" for t in spec.tunables_for(target)]
    return "\n".join(lines) or "(none)"


def _kernel(spec: KernelSpec, target: Target) -> dict[str, str]:
    return {"name": spec.name, "target": target, "summary": spec.summary or "(no summary)", "entry": spec.entry,
            "dtypes": ", ".join(spec.dtypes), "arguments": _arguments(spec), "tunables": _tunables(spec, target),
            "source_name": spec.sources[target]}


def _earlier(digest: HistoryDigest) -> list[str]:
    """Lines for the records older than the request's window: bounded however long the run is."""
    head = (f"Older candidates in brief ({digest.records} of rounds 1-{digest.last_round}; "
            "configurations as tunables|flags):")
    lines = [head]
    lines += [f"- fastest: {t}" for t in digest.top]
    lines += [f"- failed {n}x: {reason}" for reason, n in digest.failures.items()]
    tried = list(digest.tried.items())
    shown = tried[-EARLIER_CONFIGS:]
    if len(tried) > len(shown):
        lines.append(f"- {len(tried) - len(shown)} older configurations not shown (all were tried)")
    lines += [f"- tried {key}: {outcome}" for key, outcome in shown]
    return [*lines, "The most recent candidates in full:"]


def _history(history: list[RoundRecord], earlier: HistoryDigest | None = None) -> str:
    if not history and earlier is None:
        return "(none yet: this is the first round)"
    lines = _earlier(earlier) if earlier is not None else []
    for h in history:
        if h.speedup_geomean is not None:
            verdict = f"{h.speedup_geomean:.3f}x"
        elif h.failure == EVALUATING:  # a sibling candidate of this round: not a failure
            verdict = f"{EVALUATING}; propose something different"
        elif h.failure:
            verdict = f"FAILED: {h.failure}"
        else:
            verdict = "compiled" if h.compiled else "did not compile"
        if getattr(h, "accepted", False):
            verdict += " (became the best)"
        if getattr(h, "versus_best", None) is not None:
            lo, hi = h.versus_best_ci or (h.versus_best, h.versus_best)
            verdict += f" (head to head against the best then: {h.versus_best:.3f}x [{lo:.3f}, {hi:.3f}])"
        per_shape = getattr(h, "per_shape", None) or []
        if per_shape:  # absolute times too: a ratio alone hides a baseline measured faster or slower
            verdict += " [" + ", ".join(f"{p.shape} {p.dtype} {p.speedup:.2f}x ({p.candidate_us:.1f} us vs baseline "
                                        f"{p.baseline_us:.1f} us)" for p in per_shape) + "]"  # fmt: skip
        lines.append(f"- round {h.round}: {h.description} | tunables {json.dumps(h.tunables)} | "
                     f"flags {json.dumps(h.flags)} | {verdict}")
    return "\n".join(lines)


def _diagnosis(diagnosis: Diagnosis | None) -> str:
    if diagnosis is None:
        return "(no diagnosis this round)"
    parts = [f"Bottleneck: {diagnosis.bottleneck}"]
    parts += [f"- evidence: {e}" for e in diagnosis.evidence]
    parts += [f"- suggestion: {s}" for s in diagnosis.suggestions]
    return "\n".join(parts)


def _timings(profile: ProfileResult | None) -> str:
    if profile is None:
        return "(not available)"
    if not profile.ok:
        return f"(profiling failed: {profile.reason})"
    lines = []
    for t in profile.timings:
        sol = f", {t.pct_sol:.1f}% SOL" if t.pct_sol is not None else ""
        lines.append(f"- {t.shape} {t.dtype}: median {t.median_us:.2f} us (p10 {t.p10_us:.2f}, p90 {t.p90_us:.2f}, "
                     f"{t.samples} samples), {t.gbytes_per_s:.1f} GB/s{sol}")
    return "\n".join(lines) or "(no timings)"


TIMING = {
    "cpu": ("each bench shape is timed in calls interleaved with the baseline's (A/B blocks), every input new "
            "before every call, the CPU caches left warm; one thread; the verdict is the geomean of the per-shape "
            "ratios with a 95% interval"),
    "cuda": ("each bench shape is timed in calls interleaved with the baseline's (A/B blocks), every input new "
             "before every call: cold L2 (a buffer twice the L2 written before each call) with CUDA events, or, "
             "for calls under 20 us, CUDA graphs of back-to-back calls over inputs larger than L2; the verdict is "
             "the geomean of the per-shape ratios with a 95% interval"),
}


def _machine(target: str, device: str, facts: list[str], toolchain: list[str] | None = None) -> str:
    """The machine that compiles and times the code, how it times, and the toolchain that builds it
    (where the worker reported it), as the prompts show it."""
    lines = [f"- {fact}" for fact in facts] or [f"- {device or 'unknown'} (no details reported)"]
    return "\n".join([*lines, f"- timing: {TIMING.get(target, TIMING['cuda'])}", *(f"- {t}" for t in toolchain or [])])


def _semantics(package: PackageRef, reference: str) -> dict[str, str]:
    """What a candidate's outputs are checked against: reference.py, and the tolerance per dtype."""
    tols = {**DEFAULT_TOLERANCES, **package.spec.tolerances}
    return {"reference": reference.strip() or "(not given)",
            "tolerances": "; ".join(f"{d}: atol {tols[d].atol:g}, rtol {tols[d].rtol:g}" for d in package.spec.dtypes
                                    if d in tols)}  # fmt: skip


def _from_the_worker(req: PlanRequest | CodeRequest) -> dict[str, str]:
    """The prompt values the workflow carries from the workers into a plan or code request: the
    timing machine, reference.py and the tolerances (absent from a plain PlanRequest or CodeRequest)."""
    return {"machine": _machine(req.target, getattr(req, "device", ""), getattr(req, "device_facts", []),
                                getattr(req, "toolchain_facts", [])),
            **_semantics(req.package, getattr(req, "reference_source", ""))}


def _plan_context(req: PlanRequest) -> dict[str, str]:
    diagnosis = getattr(req, "diagnosis", None)
    playbook = "\n".join(f"- {flag}: {why}" for flag, why in PLAYBOOK.get(req.target, [])) or "(none)"
    return {**_kernel(req.package.spec, req.target), "round": str(req.round), "best_id": req.best.id,
            "best_speedup": f"{req.best_speedup:.3f}", "best_flags": json.dumps(req.best.flags),
            "best_tunables": json.dumps(req.best.tunables), "best_source": req.best.source,
            "diagnosis": _diagnosis(diagnosis), "history": _history(req.history, req.earlier),
            "playbook": playbook, **_from_the_worker(req)}


# ---------------------------------------------------------------- turning replies into contracts


def _plan_from(reply: PlannerReply, req: PlanRequest) -> Plan:
    problems = check_tunables(req.package.spec, req.target, reply.tunables)
    flags = list(req.best.flags) if reply.flags is None else list(reply.flags)
    problems += check_flags(flags, req.target)
    description = " ".join(reply.description.split())
    if not reply.exhausted and not description:
        problems.append("description is empty")
    if not reply.exhausted and not reply.rationale.strip():
        problems.append("rationale is empty: say why this change should be faster")
    if problems:
        raise ValueError("; ".join(problems))
    if len(description) > DESCRIPTION_CHARS:
        description = description[: DESCRIPTION_CHARS - 3] + "..."
    return Plan(round=req.round, description=description or "nothing left to try", rationale=reply.rationale.strip(),
                tunables={**req.best.tunables, **reply.tunables}, flags=flags, exhausted=reply.exhausted)


def _source_from(source: str, spec: KernelSpec, plan: Plan, base: Candidate) -> str:
    """The coder's source with the plan's tunable values applied; ValueError if unusable."""
    source = strip_fences(source)
    problems = []
    if spec.entry not in source:
        problems.append(f"the source no longer defines the entry point {spec.entry}")
    try:
        source = apply_tunables(source, plan.tunables)
    except PackageError as exc:
        problems.append(f"{exc} (keep one '#define NAME VALUE' line per declared tunable)")
    if not problems and source == base.source and sorted(plan.flags) == sorted(base.flags):
        problems.append("the source is identical to the current one; write the planned change")
    if problems:
        raise ValueError("; ".join(problems))
    return source


def _result(req: CodeRequest | SingleAgentRequest, base: Candidate, plan: Plan, source: str) -> CodeResult:
    flags = list(plan.flags)
    candidate = Candidate(id=candidate_id(source, flags, req.toolchain), source=source, flags=flags,
                          tunables=dict(plan.tunables), parent_id=base.id, origin=plan.description)
    name = req.package.spec.sources[req.target]
    return CodeResult(candidate=candidate, diff=unified_diff(base.source, source, name))


# ---------------------------------------------------------------- roles


async def design_tests(req: TestDesignRequest) -> tuple[TestDesign, list[LLMCall]]:
    """Extra test shapes and edge cases; check them with kopt.agent_models.validate_shapes."""
    spec = req.package.spec
    symbols = shape_symbols(spec)
    sets = spec.shapes[req.target]
    messages = render(
        "test_designer", **_kernel(spec, req.target), source=req.package.baseline_sources.get(req.target, ""),
        limits=json.dumps(req.limits), symbols=", ".join(symbols), max_shapes=req.max_shapes,
        test_shapes="; ".join(s.label for s in sets.test), bench_shapes="; ".join(s.label for s in sets.bench),
        example=", ".join(f'"{s}": 1' for s in symbols), schema=schema_text(TestDesign))

    def check(design: TestDesign) -> TestDesign:
        if not design.shapes and not design.notes.strip():  # `{"type": "object"}` parsed as a design of nothing
            raise ValueError("the design has no shapes and no notes: propose shapes, or say in notes why none")
        return TestDesign(shapes=design.shapes[: req.max_shapes], notes=design.notes)

    return await chat_json(_config(req), "test_designer", messages, TestDesign, check)


async def analyze(req: AnalyzeRequest) -> tuple[Diagnosis, list[LLMCall]]:
    """A short bottleneck diagnosis from ptxas resource usage, per-shape times and %SOL."""
    spec = req.package.spec
    profile = req.profile
    bandwidth = f"{profile.copy_bandwidth_gbs:.0f} GB/s" if profile.copy_bandwidth_gbs else "unknown"
    messages = render(
        "analyst", **_kernel(spec, req.target), bytes_model=spec.model.bytes, flops_model=spec.model.flops,
        candidate_id=req.candidate.id, flags=json.dumps(req.candidate.flags),
        candidate_tunables=json.dumps(req.candidate.tunables), source=req.candidate.source,
        resource_usage=(req.compile.resource_usage.strip() if req.compile else "") or "(none)",
        device=profile.device or "unknown", copy_bandwidth=bandwidth, timings=_timings(profile),
        baseline_timings=_timings(req.baseline), schema=schema_text(Diagnosis),
        history=_history(getattr(req, "history", [])), profiler=_profiler(profile, req.baseline),
        machine=_machine(req.target, profile.device, profile.device_facts, getattr(req, "toolchain_facts", [])))
    return await chat_json(_config(req), "analyst", messages, Diagnosis, _usable_diagnosis)


def _profiler(profile: ProfileResult, baseline: ProfileResult | None) -> str:
    parts = [(who, p.nsight) for who, p in (("this candidate", profile), ("the baseline", baseline))
             if p is not None and p.nsight is not None]  # fmt: skip
    if len(parts) == 2 and profile.candidate_id == baseline.candidate_id:
        parts = parts[:1]
    return "\n".join(f"{who}: " + "\n".join(n.lines()) for who, n in parts) or "(none)"


def _usable_diagnosis(diagnosis: Diagnosis) -> Diagnosis:
    if not diagnosis.bottleneck.strip():
        raise ValueError("bottleneck is empty: name what limits the kernel (memory bandwidth, launch overhead, ...)")
    return diagnosis


async def plan(req: PlanRequest) -> tuple[Plan, list[LLMCall]]:
    """The next optimization from the diagnosis (AgentPlanRequest.diagnosis) and the history."""
    messages = render("planner", **_plan_context(req), schema=schema_text(PlannerReply))
    return await chat_json(_config(req), "planner", messages, PlannerReply, lambda r: _plan_from(r, req))


async def code(req: CodeRequest) -> tuple[CodeResult, list[LLMCall]]:
    """A complete new source for the plan; the candidate's id is hash(source, flags, toolchain)."""
    spec = req.package.spec
    diagnosis = getattr(req, "diagnosis", None)
    messages = render(
        "coder", **_kernel(spec, req.target), toolchain=req.toolchain, round=req.plan.round,
        description=req.plan.description, rationale=req.plan.rationale, plan_tunables=json.dumps(req.plan.tunables),
        plan_flags=json.dumps(req.plan.flags), source=req.base.source,
        diagnosis=f"\n{_diagnosis(diagnosis)}\n" if diagnosis else "", schema=schema_text(CoderReply),
        **_from_the_worker(req))

    def check(reply: CoderReply) -> CodeResult:
        return _result(req, req.base, req.plan, _source_from(reply.source, spec, req.plan, req.base))

    return await chat_json(_config(req), "coder", messages, CoderReply, check)


async def repair(req: RepairRequest) -> tuple[CodeResult, list[LLMCall]]:
    """One repair turn for a candidate that did not compile (build the request with repair_request)."""
    spec = req.package.spec
    tunables = ", ".join(f"{t.name}: {t.values}" for t in spec.tunables_for(req.target)) or "(none)"
    messages = render(
        "repair", **{**_kernel(spec, req.target), "tunables": tunables}, toolchain=req.toolchain,
        round=req.plan.round, description=req.plan.description, plan_flags=json.dumps(req.plan.flags),
        failed_source=req.failed.source, compile_error=req.compile_error, schema=schema_text(CoderReply))

    def check(reply: CoderReply) -> CodeResult:
        source = _source_from(reply.source, spec, req.plan, req.base)
        if source == req.failed.source:  # the fix must differ from the failed version, not just the base
            raise ValueError("the source is identical to the version that did not compile; fix the error")
        return _result(req, req.base, req.plan, source)

    return await chat_json(_config(req), "repair", messages, CoderReply, check)


async def single_agent(req: SingleAgentRequest) -> tuple[Plan, CodeResult, list[LLMCall]]:
    """Plan and code in one call (the single-agent ablation). An exhausted plan returns the best as is."""
    messages = render("single_agent", **_plan_context(req), toolchain=req.toolchain,
                      schema=schema_text(SingleAgentReply))

    def check(reply: SingleAgentReply) -> tuple[Plan, CodeResult]:
        the_plan = _plan_from(reply, req)
        if the_plan.exhausted:
            return the_plan, CodeResult(candidate=req.best, diff="")
        if not reply.source:
            raise ValueError("source is missing: give the complete new source file")
        source = _source_from(reply.source, req.package.spec, the_plan, req.best)
        return the_plan, _result(req, req.best, the_plan, source)

    (the_plan, result), calls = await chat_json(_config(req), "single_agent", messages, SingleAgentReply, check)
    return the_plan, result, calls
