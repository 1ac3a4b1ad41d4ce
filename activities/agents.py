"""Agent activities on kopt-agents: plan and code, dispatched to the run's provider."""

from __future__ import annotations

from temporalio import activity

from activities.errors import invalid_request
from agents import offline
from kopt.models import CodeRequest, CodeResult, Plan, PlanRequest
from kopt.package import PackageError

PROVIDERS = {"offline": offline}


def _provider(name: str):
    if name not in PROVIDERS:
        raise invalid_request(f"unknown agent provider {name!r}; known: {sorted(PROVIDERS)}")
    return PROVIDERS[name]


@activity.defn(name="plan")
async def plan(req: PlanRequest) -> Plan:
    return _provider(req.provider).plan(req)


@activity.defn(name="code")
async def code(req: CodeRequest) -> CodeResult:
    try:
        return _provider(req.provider).code(req)
    except PackageError as exc:
        raise invalid_request(f"coder could not apply the plan: {exc}") from None
