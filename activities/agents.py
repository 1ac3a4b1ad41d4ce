"""Agent activities on kopt-agents: test designer, profile analyst, planner, coder, repair and the
combined single agent, dispatched to the run's provider (`offline` or `openai`).

Every activity returns its output together with the LLM calls it made (prompt, response, model,
usage, cost, latency), so each call is in workflow history for audit.
"""

from __future__ import annotations

from temporalio import activity

from activities.errors import invalid_request
from agents import offline
from kopt.agent_models import (
    AgentCodeRequest,
    AgentPlanRequest,
    AnalyzeRequest,
    CodeOutput,
    DiagnosisOutput,
    PlanOutput,
    RepairRequest,
    SingleAgentOutput,
    SingleAgentRequest,
    TestDesignOutput,
    TestDesignRequest,
    shape_symbols,
    validate_shapes,
)
from kopt.models import CodeRequest
from kopt.package import PackageError

PROVIDERS = ("offline", "openai")


def _check(provider: str) -> None:
    if provider not in PROVIDERS:
        raise invalid_request(f"unknown agent provider {provider!r}; known: {', '.join(PROVIDERS)}")


def _roles():
    from agents import roles  # imports openai: only where the provider is used

    return roles


@activity.defn(name="plan")
async def plan(req: AgentPlanRequest) -> PlanOutput:
    _check(req.provider)
    if req.provider == "offline":
        return PlanOutput(plan=offline.plan(req), calls=[])
    the_plan, calls = await _roles().plan(req)
    return PlanOutput(plan=the_plan, calls=calls)


@activity.defn(name="code")
async def code(req: AgentCodeRequest) -> CodeOutput:
    _check(req.provider)
    if req.provider == "offline":
        try:
            return CodeOutput(result=offline.code(req), calls=[])
        except PackageError as exc:
            raise invalid_request(f"coder could not apply the plan: {exc}") from None
    result, calls = await _roles().code(req)
    return CodeOutput(result=result, calls=calls)


@activity.defn(name="repair")
async def repair(req: RepairRequest) -> CodeOutput:
    if req.provider != "openai":
        raise invalid_request(f"provider {req.provider!r} has no repair turn")
    result, calls = await _roles().repair(req)
    return CodeOutput(result=result, calls=calls)


@activity.defn(name="analyze")
async def analyze(req: AnalyzeRequest) -> DiagnosisOutput:
    diagnosis, calls = await _roles().analyze(req)
    return DiagnosisOutput(diagnosis=diagnosis, calls=calls)


@activity.defn(name="design_tests")
async def design_tests(req: TestDesignRequest) -> TestDesignOutput:
    design, calls = await _roles().design_tests(req)
    sets = req.package.spec.shapes[req.target]
    review = validate_shapes(design.shapes, shape_symbols(req.package.spec), req.limits, sets.test)
    return TestDesignOutput(design=design, review=review, calls=calls)


@activity.defn(name="single_agent")
async def single_agent(req: SingleAgentRequest) -> SingleAgentOutput:
    _check(req.provider)
    if req.provider == "offline":
        the_plan = offline.plan(req)
        if the_plan.exhausted:
            return SingleAgentOutput(plan=the_plan, result=offline.unchanged(req.best), calls=[])
        result = offline.code(CodeRequest(package=req.package, target=req.target, toolchain=req.toolchain,
                                          plan=the_plan, base=req.best, provider=req.provider))
        return SingleAgentOutput(plan=the_plan, result=result, calls=[])
    the_plan, result, calls = await _roles().single_agent(req)
    return SingleAgentOutput(plan=the_plan, result=result, calls=calls)


ACTIVITIES = [plan, code, repair, analyze, design_tests, single_agent]
