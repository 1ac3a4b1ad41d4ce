"""Agent activities on kopt-agents: test designer, profile analyst, planner, coder, repair and the
combined single agent, dispatched to the run's provider (`offline` or `openai`).

Every activity returns its output together with the LLM calls it made (prompt, response, model,
usage, cost, latency), so each call is in workflow history for audit. That includes the calls of
earlier attempts that failed retryably (a 429, an invalid reply): their records are carried to the
next attempt in heartbeat details, so the run's usage and budgets count the tokens they spent.
"""

from __future__ import annotations

from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import invalid_request
from agents import offline
from kopt.activity_table import ANALYZE, CODE, DESIGN_TESTS, PLAN, REPAIR, SINGLE_AGENT
from kopt.agent_models import PROVIDERS
from kopt.agent_models import (
    AgentCodeRequest,
    AgentPlanRequest,
    AnalyzeRequest,
    CodeOutput,
    DiagnosisOutput,
    LLMCall,
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



def _check(provider: str) -> None:
    if provider not in PROVIDERS:
        raise invalid_request(f"unknown agent provider {provider!r}; known: {', '.join(PROVIDERS)}")


def _roles():
    """agents.roles, which imports the openai client: only where the provider is used. A worker that
    cannot load it fails the call for good, saying why (retrying would only make the run wait)."""
    try:
        from agents import roles
    except ImportError as exc:
        raise ApplicationError(f"this agents worker cannot load the LLM client ({type(exc).__name__}: {exc}); "
                               "install kopt's dependencies where it runs", type="WorkerMisconfigured",
                               non_retryable=True) from None
    return roles


def _earlier_calls() -> list[LLMCall]:
    """Records of this activity's failed earlier attempts, carried here in heartbeat details."""
    calls = []
    for detail in activity.info().heartbeat_details:
        try:
            calls.append(LLMCall.model_validate(detail))
        except ValidationError:  # e.g. the "waiting for the model" heartbeat of an attempt that died
            continue
    return calls


KEPT_FAILED_CALLS = 20  # records of earlier attempts that spent nothing (an outage's 500s), newest kept


def _trim(calls: list[LLMCall]) -> list[LLMCall]:
    """Earlier attempts' records, without all but the last KEPT_FAILED_CALLS of those that spent no
    tokens: an endpoint down for hours would otherwise grow every heartbeat and the final result."""
    free = [i for i, c in enumerate(calls) if not c.usage.prompt_tokens and not c.usage.completion_tokens]
    drop = set(free[:-KEPT_FAILED_CALLS]) if len(free) > KEPT_FAILED_CALLS else set()
    return [c for i, c in enumerate(calls) if i not in drop]


async def _carrying(role_call):
    """Await a role; its calls come back with the earlier attempts' calls in front. A retryable failure
    heartbeats all records so far for the next attempt; every failure carries them in its details
    (a workflow whose retry policy ends at this failure counts them from there)."""
    earlier = _trim(_earlier_calls())
    try:
        *out, calls = await role_call
    except ApplicationError as err:
        dumped = [c.model_dump(mode="json") for c in earlier]
        if not err.non_retryable:
            activity.heartbeat(*dumped, *err.details)  # flushed before the failure is reported
        raise ApplicationError(err.message, *dumped, *err.details, type=err.type, non_retryable=err.non_retryable,
                               next_retry_delay=err.next_retry_delay) from None
    return (*out, [*earlier, *calls])


@activity.defn(name=PLAN.name)
async def plan(req: AgentPlanRequest) -> PlanOutput:
    _check(req.provider)
    if req.provider == "offline":
        return PlanOutput(plan=offline.plan(req), calls=[])
    the_plan, calls = await _carrying(_roles().plan(req))
    return PlanOutput(plan=the_plan, calls=calls)


@activity.defn(name=CODE.name)
async def code(req: AgentCodeRequest) -> CodeOutput:
    _check(req.provider)
    if req.provider == "offline":
        try:
            return CodeOutput(result=offline.code(req), calls=[])
        except PackageError as exc:
            raise invalid_request(f"coder could not apply the plan: {exc}") from None
    result, calls = await _carrying(_roles().code(req))
    return CodeOutput(result=result, calls=calls)


@activity.defn(name=REPAIR.name)
async def repair(req: RepairRequest) -> CodeOutput:
    if req.provider != "openai":
        raise invalid_request(f"provider {req.provider!r} has no repair turn")
    result, calls = await _carrying(_roles().repair(req))
    return CodeOutput(result=result, calls=calls)


@activity.defn(name=ANALYZE.name)
async def analyze(req: AnalyzeRequest) -> DiagnosisOutput:
    diagnosis, calls = await _carrying(_roles().analyze(req))
    return DiagnosisOutput(diagnosis=diagnosis, calls=calls)


@activity.defn(name=DESIGN_TESTS.name)
async def design_tests(req: TestDesignRequest) -> TestDesignOutput:
    design, calls = await _carrying(_roles().design_tests(req))
    sets = req.package.spec.shapes[req.target]
    review = validate_shapes(design.shapes, shape_symbols(req.package.spec), req.limits, sets.test)
    return TestDesignOutput(design=design, review=review, calls=calls)


@activity.defn(name=SINGLE_AGENT.name)
async def single_agent(req: SingleAgentRequest) -> SingleAgentOutput:
    _check(req.provider)
    if req.provider == "offline":
        the_plan = offline.plan(req)
        if the_plan.exhausted:
            return SingleAgentOutput(plan=the_plan, result=offline.unchanged(req.best), calls=[])
        result = offline.code(CodeRequest(package=req.package, target=req.target, toolchain=req.toolchain,
                                          plan=the_plan, base=req.best, provider=req.provider))
        return SingleAgentOutput(plan=the_plan, result=result, calls=[])
    the_plan, result, calls = await _carrying(_roles().single_agent(req))
    return SingleAgentOutput(plan=the_plan, result=result, calls=calls)


