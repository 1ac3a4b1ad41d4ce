"""Contracts of the LLM agent roles: configuration, requests, outputs and audit records.

Importable inside the workflow sandbox: pydantic and kopt.models only, no I/O, no openai, no
environment reads. The API key is never part of any model here; `LLMConfig.api_key_env` is the
*name* of the environment variable that the agent worker reads inside each call.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictInt, field_validator

from kopt import expr
from kopt.models import EVALUATING as MODELS_EVALUATING
from kopt.models import Candidate, CodeRequest, CodeResult, CompileResult, KernelSpec, PackageRef, Plan, PlanRequest
from kopt.models import ProfileResult, RoundRecord, Shape, Target

AgentRole = Literal["test_designer", "analyst", "planner", "coder", "repair", "single_agent"]
ROLES: tuple[str, ...] = ("test_designer", "analyst", "planner", "coder", "repair", "single_agent")
# A role without its own override inherits from this one before the global default.
ROLE_FALLBACK: dict[str, str] = {"repair": "coder"}

PROVIDERS = ("offline", "openai")  # the agent providers a run may name
ENV_PREFIX = "KOPT_OPENAI_"
# RoundRecord.failure of a candidate proposed earlier in the same round (not evaluated yet): later
# slots see it in their history so that they propose something else; it is not a failure. Defined
# beside RoundRecord (kopt.models), named here too for the agents.
EVALUATING = MODELS_EVALUATING

# ApplicationError types of the agent activities (agents/llm.py raises them; the workflow sorts them).
RATE_LIMITED = "LLMRateLimited"
SERVER_ERROR = "LLMServerError"
TIMEOUT = "LLMTimeout"
CONNECTION = "LLMConnectionError"
AUTH = "LLMAuthError"
NOT_FOUND = "LLMNotFound"
BAD_REQUEST = "LLMBadRequest"
CONFIG = "LLMConfigError"
OUTPUT_INVALID = "LLMOutputInvalid"
REFUSED = "LLMRefused"
BAD_REPLY_TYPES = [OUTPUT_INVALID, REFUSED]  # the reply was unusable: that candidate fails, the run goes on
STOP_TYPES = [AUTH, NOT_FOUND, BAD_REQUEST, CONFIG]  # no later attempt can succeed: the run stops


def setting_name(field: str) -> str:
    """Environment variable of an LLMSettings field, for messages that say what to fix."""
    return ENV_PREFIX + field.upper()


# ---------------------------------------------------------------- configuration (no secret)


def check_roles(roles: dict[str, Any]) -> dict[str, Any]:
    """Per-role overrides may name known roles only (a typo would silently do nothing)."""
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown roles {unknown} in {setting_name('roles')}; known: {list(ROLES)}")
    return roles


class RoleOverride(BaseModel):
    model: str | None = None  # None: inherit
    temperature: float | None = None  # None: inherit


class LLMConfig(BaseModel):
    """What an agent call needs to know about the endpoint; small enough to carry in a request."""

    base_url: str = "https://api.openai.com/v1"
    model: str = "gpt-4.1"
    api_key_env: str = "OPENAI_API_KEY"  # name of the variable, never its value; "" = no key
    timeout_s: float = 120.0
    temperature: float | None = 0.2  # None: do not send (models that accept only their default)
    max_output_tokens: int = 8192
    # Reasoning models on api.openai.com want max_completion_tokens; most other servers max_tokens.
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    json_mode: bool = True  # send response_format={"type": "json_object"}
    roles: dict[str, RoleOverride] = Field(default_factory=dict)
    prices: dict[str, tuple[float, float]] = Field(default_factory=dict)  # model -> USD per 1M (in, out)
    # Replies are cached per scope (agents/reply_cache.py): every `kopt optimize` draws a fresh scope,
    # `kopt resume` keeps its run's, so a resumed run gets the answers its predecessor paid for.
    cache_scope: str | None = None
    cache_read: bool = False  # answer from the cache (the resumed run's first round only: elsewhere an
    # identical prompt is asked again, as a fresh sample may differ)

    @field_validator("roles")
    @classmethod
    def _known_roles(cls, roles: dict[str, RoleOverride]) -> dict[str, RoleOverride]:
        return check_roles(roles)

    def activity_timeout(self) -> timedelta:
        """A start-to-close timeout for one agent activity: two calls (reply + repair turn) and margin."""
        return timedelta(seconds=2 * self.timeout_s + 30)

    def for_role(self, role: str) -> tuple[str, float | None]:
        """(model, temperature) for a role: its override, then its fallback role's, then the default."""
        model, temperature = self.model, self.temperature
        for name in (ROLE_FALLBACK.get(role), role):
            override = self.roles.get(name) if name else None
            if override is not None:
                model = override.model or model
                temperature = override.temperature if override.temperature is not None else temperature
        return model, temperature

    def cost_usd(self, model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        """Estimated cost from the price table; None when the model is not priced."""
        price = self.prices.get(model)
        if price is None:
            return None
        return (prompt_tokens * price[0] + completion_tokens * price[1]) / 1e6


# ---------------------------------------------------------------- audit records


class LLMMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class LLMUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class LLMCall(BaseModel):
    """One chat-completions request and its answer, as it goes into workflow history."""

    role: AgentRole
    model: str  # the model asked for
    response_model: str | None = None  # the model the server says answered
    temperature: float | None
    base_url_host: str  # host[:port] only: no path, no credentials
    messages: list[LLMMessage]  # the full prompt, as sent
    response_text: str | None = None  # raw content of the reply
    finish_reason: str | None = None
    output: dict[str, Any] | None = None  # the parsed, validated output
    error: str | None = None  # why the reply was rejected, or the HTTP/transport error
    usage: LLMUsage = Field(default_factory=LLMUsage)
    cost_usd: float | None = None
    latency_s: float = 0.0
    cached: bool = False  # answered from the reply cache of an earlier run of the same lineage (nothing spent)
    attempt: int = 1  # 2 = the one repair turn after an invalid reply
    repair: bool = False
    activity_attempt: int = 1  # Temporal's attempt of the agent activity that made the call


# ---------------------------------------------------------------- role outputs


class ShapeProposal(BaseModel):
    dims: dict[str, StrictInt]  # a value for every shape symbol
    reason: str = ""


class TestDesign(BaseModel):
    __test__ = False  # not a pytest class

    shapes: list[ShapeProposal] = Field(default_factory=list)
    notes: str = ""


class Diagnosis(BaseModel):
    bottleneck: str
    evidence: list[str] = Field(default_factory=list)
    suggestions: list[str] = Field(default_factory=list)


class ShapeReview(BaseModel):
    accepted: list[Shape]
    rejected: list[str]  # "T=0,D=8: T=0 is outside [1, 65536]"


def shape_symbols(spec: KernelSpec) -> list[str]:
    """The package's shape symbols (names in the arguments' shape expressions), sorted."""
    symbols: set[str] = set()
    for arg in spec.arguments:
        for dim in arg.shape:
            symbols |= expr.names(dim)
    return sorted(symbols)


def validate_shapes(proposals: list[ShapeProposal], symbols: list[str], limits: dict[str, int],
                    existing: list[Shape] | None = None) -> ShapeReview:
    """Keep the proposals that give every symbol (and no other) an int in [1, limit].

    Duplicates, of each other or of `existing` shapes, are dropped as rejected. Pure, so the
    workflow may call it.
    """
    seen = {tuple(sorted(s.dims.items())) for s in existing or []}
    accepted: list[Shape] = []
    rejected: list[str] = []
    for p in proposals:
        label = ",".join(f"{k}={v}" for k, v in p.dims.items()) or "(empty)"
        problems = [f"missing {s}" for s in symbols if s not in p.dims]
        problems += [f"unknown symbol {k}" for k in p.dims if k not in symbols]
        for k in symbols:
            v = p.dims.get(k)
            if k not in p.dims:
                continue
            if type(v) is not int:
                problems.append(f"{k}={v!r} is not an integer")
            elif k not in limits:
                problems.append(f"{k} has no limit")
            elif not 1 <= v <= limits[k]:
                problems.append(f"{k}={v} is outside [1, {limits[k]}]")
        key = tuple(sorted(p.dims.items()))
        if not problems and key in seen:
            problems.append("duplicate")
        if problems:
            rejected.append(f"{label}: {'; '.join(problems)}")
            continue
        seen.add(key)
        accepted.append(Shape(dims={k: p.dims[k] for k in symbols}))
    return ShapeReview(accepted=accepted, rejected=rejected)


# ---------------------------------------------------------------- role requests
# `llm` None: the agent worker uses its own LLMSettings (KOPT_OPENAI_* environment).


class TestDesignRequest(BaseModel):
    __test__ = False

    package: PackageRef
    target: Target
    limits: dict[str, int]  # upper bound per shape symbol; proposals are checked against it
    max_shapes: int = 8
    llm: LLMConfig | None = None


class AnalyzeRequest(BaseModel):
    package: PackageRef
    target: Target
    candidate: Candidate
    compile: CompileResult | None = None  # its resource_usage holds the ptxas -v report
    profile: ProfileResult
    baseline: ProfileResult | None = None
    llm: LLMConfig | None = None
    # What the run tried since the best (the analyst saw only the best, and asked the same again): the
    # most recent round records, failures with their reasons included.
    history: list[RoundRecord] = Field(default_factory=list)
    toolchain_facts: list[str] = Field(default_factory=list)  # the baseline's compile (CompileResult)


class AgentPlanRequest(PlanRequest):
    """PlanRequest plus what the LLM planner can use; a plain PlanRequest is accepted too. `device` and
    `device_facts`: the machine that timed the baseline (its ProfileResult), as the prompts show it."""

    llm: LLMConfig | None = None
    diagnosis: Diagnosis | None = None
    device: str = ""
    device_facts: list[str] = Field(default_factory=list)
    toolchain_facts: list[str] = Field(default_factory=list)  # the baseline's compile (CompileResult)
    reference_source: str = ""  # the package's reference.py (OptimizeRequest.reference_source)


class AgentCodeRequest(CodeRequest):
    llm: LLMConfig | None = None
    diagnosis: Diagnosis | None = None
    device: str = ""
    device_facts: list[str] = Field(default_factory=list)
    toolchain_facts: list[str] = Field(default_factory=list)
    reference_source: str = ""


class RepairRequest(AgentCodeRequest):
    """The coder's candidate did not compile: fix it. `base` stays the candidate the plan started from."""

    failed: Candidate
    compile_error: str  # the compiler's output (tail), as the coder will see it


COMPILE_ERROR_CHARS = 6000


def repair_request(req: CodeRequest, failed: Candidate, compile_error: CompileResult | str) -> RepairRequest:
    """The request for the one repair turn after `failed` did not compile (keeps the error's tail)."""
    text = compile_error.log_tail if isinstance(compile_error, CompileResult) else compile_error
    text = text.strip() or "(the compiler printed nothing)"
    if len(text) > COMPILE_ERROR_CHARS:
        text = "[...]\n" + text[-COMPILE_ERROR_CHARS:]
    return RepairRequest(**{**dict(req), "failed": failed, "compile_error": text})


class SingleAgentRequest(AgentPlanRequest):
    toolchain: str


# ---------------------------------------------------------------- activity outputs (one model out)


class TestDesignOutput(BaseModel):
    __test__ = False

    design: TestDesign
    review: ShapeReview
    calls: list[LLMCall]


class DiagnosisOutput(BaseModel):
    diagnosis: Diagnosis
    calls: list[LLMCall]


class PlanOutput(BaseModel):
    plan: Plan
    calls: list[LLMCall]


class CodeOutput(BaseModel):
    result: CodeResult
    calls: list[LLMCall]


class SingleAgentOutput(BaseModel):
    plan: Plan
    result: CodeResult
    calls: list[LLMCall]
