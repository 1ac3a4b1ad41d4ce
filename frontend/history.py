"""Reconstruct a run, round by round, from workflow history alone (across continue-as-new)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter

from kopt.activity_table import (ACTIVITIES, ANALYZE, CODE, COMPILE, DESIGN_TESTS, PLAN, PROFILE, REPAIR, SINGLE_AGENT,
                                 TEST, parse_activity_id)  # fmt: skip
from kopt.agent_models import Diagnosis, LLMCall
from kopt.models import CodeResult, CompileResult, Plan, ProfileResult, TestResult
from kopt.run_models import OptimizeRequest, OptimizeResult


class ActivityCall(BaseModel):
    activity: str
    task_queue: str
    activity_id: str = ""
    at: tuple[int, int] | None = None  # (round, slot) named by the id (runs since ACTIVITY_IDS_PATCH)
    input: Any = None
    result: Any = None
    failure: str | None = None
    attempts: int = 0  # attempt number of the final try, 0 while not started
    last_failure: str | None = None  # why the attempt before the final one failed (a retried activity)
    # Audit records of LLM calls that rode on failures (ApplicationError details): the previous
    # attempt's and the final one's (which carries the earlier attempts' too: activities/agents.py).
    failed_llm_calls: list[LLMCall] = Field(default_factory=list)


class RoundView(BaseModel):
    round: int
    segment: int
    candidate_id: str | None = None
    plan: Plan | None = None
    code: CodeResult | None = None
    compile: CompileResult | None = None
    test: TestResult | None = None
    profile: ProfileResult | None = None
    versus: ProfileResult | None = None  # timed head to head against the run's best (docs/decisions/0037)
    diagnosis: Diagnosis | None = None
    llm_calls: list[LLMCall] = Field(default_factory=list)  # every prompt and response of the round
    calls: list[ActivityCall] = Field(default_factory=list)


class RunView(BaseModel):
    workflow_id: str
    run_ids: list[str]  # oldest segment first
    request: OptimizeRequest | None = None
    result: OptimizeResult | None = None
    status: str = "running"
    rounds: list[RoundView] = Field(default_factory=list)


def _decode(payloads, type_) -> Any:
    if not payloads.payloads:
        return None
    return pydantic_data_converter.payload_converter.from_payloads(payloads.payloads, [type_])[0]


def _llm_calls_of(failure) -> list[LLMCall]:
    """The LLMCall records an agent activity attached to its ApplicationError (agents/llm.py)."""
    if not failure.HasField("application_failure_info"):
        return []
    calls = []
    for payload in failure.application_failure_info.details.payloads:
        try:
            value = pydantic_data_converter.payload_converter.from_payloads([payload])[0]
            calls.append(LLMCall.model_validate(value))
        except Exception:  # noqa: BLE001 - details of another kind
            continue
    return calls


def activity_calls(history: WorkflowHistory) -> list[ActivityCall]:
    """Every activity of one history segment, in scheduling order, with input, result and attempts."""
    calls: dict[int, ActivityCall] = {}
    started: dict[int, int] = {}
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            a = e.activity_task_scheduled_event_attributes
            name = a.activity_type.name
            known = ACTIVITIES.get(name)
            calls[e.event_id] = ActivityCall(activity=name, task_queue=a.task_queue.name, activity_id=a.activity_id,
                                             at=parse_activity_id(a.activity_id),
                                             input=_decode(a.input, known.request if known else dict))  # fmt: skip
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            a = e.activity_task_started_event_attributes
            started[e.event_id] = a.scheduled_event_id
            call = calls[a.scheduled_event_id]
            call.attempts = a.attempt
            if a.HasField("last_failure"):
                last = a.last_failure
                if last.HasField("server_failure_info") and last.HasField("cause"):
                    last = last.cause  # "Failure exceeds size limit.": the server kept a truncated copy
                call.last_failure = last.message
                call.failed_llm_calls += _llm_calls_of(last)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            a = e.activity_task_completed_event_attributes
            call = calls[a.scheduled_event_id]
            known = ACTIVITIES.get(call.activity)
            call.result = _decode(a.result, known.result if known else dict)
        elif e.event_type in (EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED, EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT):
            a = (e.activity_task_failed_event_attributes if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                 else e.activity_task_timed_out_event_attributes)
            call = calls[a.scheduled_event_id]
            call.failure = a.failure.message
            call.failed_llm_calls += [c for c in _llm_calls_of(a.failure) if c not in call.failed_llm_calls]
    return list(calls.values())


def rounds_of(calls: list[ActivityCall], baseline_id: str | None, segment: int) -> list[RoundView]:
    """A segment's activity calls grouped into rounds: by the (round, slot) their ids name, or, in
    histories recorded before activity ids, by matching candidates (rounds_by_matching)."""
    if calls and all(c.at is not None for c in calls):
        return rounds_by_id(calls, segment)
    return rounds_by_matching(calls, baseline_id, segment)


def rounds_by_id(calls: list[ActivityCall], segment: int) -> list[RoundView]:
    """One view per (round, slot) (round 0: the test design and the baseline); the analyst's diagnosis
    of a round goes to every slot of that round."""
    views: dict[tuple[int, int], RoundView] = {}
    diagnoses: dict[int, tuple[Diagnosis | None, list[LLMCall]]] = {}
    versus: list[ActivityCall] = []  # head-to-head profiles (slot -1): they go to their candidate's view
    for call in calls:
        rnd, slot = call.at
        if rnd < 0:  # the held-out judgement after the last round: OptimizeResult.holdout, not a round
            continue
        if slot < 0:
            versus.append(call)
            continue
        out = call.result
        done = list(getattr(out, "calls", []) or [])  # earlier failed attempts' calls included
        llm = [*[c for c in call.failed_llm_calls if c not in done], *done]
        if call.activity == ANALYZE.name:
            diagnoses[rnd] = (out.diagnosis if out else None, llm)
            continue
        view = views.setdefault((rnd, slot), RoundView(round=rnd, segment=segment))
        view.calls.append(call)
        view.llm_calls += llm
        if call.activity in (PLAN.name, SINGLE_AGENT.name) and out is not None:
            view.plan = out.plan
        if call.activity in (CODE.name, REPAIR.name, SINGLE_AGENT.name) and out is not None and not (
                call.activity == SINGLE_AGENT.name and out.plan.exhausted):  # fmt: skip
            view.code = out.result
            view.candidate_id = out.result.candidate.id
        elif call.activity in (COMPILE.name, TEST.name, PROFILE.name):
            setattr(view, call.activity, out)
            if view.candidate_id is None:  # the baseline's own calls
                compiled = call.activity == COMPILE.name
                view.candidate_id = call.input.candidate.id if compiled else call.input.candidate_id
    for call in versus:
        view = next((v for (r, _), v in views.items() if r == call.at[0] and v.candidate_id == call.input.candidate_id),
                    None)  # fmt: skip
        if view is not None:
            view.calls.append(call)
            view.versus = call.result
    for rnd in diagnoses:  # a round that ended at its analyst's call (a refused request) has no other view
        if not any(r == rnd for r, _ in views):
            views[(rnd, 0)] = RoundView(round=rnd, segment=segment)
    for (rnd, slot), view in views.items():
        if rnd in diagnoses:
            view.diagnosis = diagnoses[rnd][0]
            if slot == min(s for r, s in views if r == rnd):  # the analyst's calls counted once
                view.llm_calls = [*diagnoses[rnd][1], *view.llm_calls]
    return [views[k] for k in sorted(views)]


def rounds_by_matching(calls: list[ActivityCall], baseline_id: str | None, segment: int) -> list[RoundView]:
    """Group a segment's activity calls into rounds (round 0 is the test design and the baseline).

    With several candidates per round there is one view per candidate; an analyst's diagnosis
    belongs to the candidates planned after it.
    """
    rounds: list[RoundView] = []
    by_candidate: dict[str, RoundView] = {}
    zero = RoundView(round=0, segment=segment, candidate_id=baseline_id)
    diagnosis: tuple[Diagnosis | None, list[LLMCall]] = (None, [])
    for call in calls:
        out = call.result
        done = list(getattr(out, "calls", []) or [])  # earlier failed attempts' calls included
        llm = [*[c for c in call.failed_llm_calls if c not in done], *done]
        if call.activity == DESIGN_TESTS.name:
            zero.llm_calls += llm
            zero.calls.append(call)
        elif call.activity == ANALYZE.name:
            diagnosis = (out.diagnosis if out else None, llm)
        elif call.activity in (PLAN.name, SINGLE_AGENT.name):
            view = RoundView(round=call.input.round, segment=segment, plan=out.plan if out else None,
                             diagnosis=diagnosis[0], llm_calls=[*diagnosis[1], *llm], calls=[call])
            diagnosis = (diagnosis[0], [])
            if call.activity == SINGLE_AGENT.name and out is not None and not out.plan.exhausted:  # else the best
                view.code = out.result
                view.candidate_id = out.result.candidate.id
                by_candidate[view.candidate_id] = view
            rounds.append(view)
        elif call.activity in (CODE.name, REPAIR.name):
            view = (by_candidate.get(call.input.failed.id) if call.activity == REPAIR.name
                    else next((r for r in reversed(rounds) if r.plan == call.input.plan and r.code is None),
                              rounds[-1]))
            view.code = out.result if out else None
            view.llm_calls += llm
            view.calls.append(call)
            if out is not None:
                view.candidate_id = out.result.candidate.id
                by_candidate[view.candidate_id] = view
        else:
            cand = call.input.candidate.id if call.activity == COMPILE.name else call.input.candidate_id
            view = by_candidate.get(cand)
            if view is None and cand == baseline_id:
                view = by_candidate[cand] = zero
            if view is None:
                continue
            setattr(view, call.activity, out)
            view.calls.append(call)
    if zero.calls or baseline_id in by_candidate:
        rounds.insert(0, zero)
    return rounds


async def segments(client: Client, workflow_id: str, run_id: str | None = None) -> list[WorkflowHistory]:
    """The histories of a run, oldest first, following continue-as-new links back from `run_id`."""
    chain: list[WorkflowHistory] = []
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    while True:
        history = await handle.fetch_history()
        chain.append(history)
        first = history.events[0].workflow_execution_started_event_attributes
        if not first.continued_execution_run_id:
            break
        handle = client.get_workflow_handle(workflow_id, run_id=first.continued_execution_run_id)
    return list(reversed(chain))


async def load_run(client: Client, workflow_id: str, run_id: str | None = None) -> RunView:
    histories = await segments(client, workflow_id, run_id)
    view = RunView(workflow_id=workflow_id, run_ids=[h.run_id for h in histories])
    for i, history in enumerate(histories, start=1):
        first = history.events[0].workflow_execution_started_event_attributes
        if view.request is None:
            view.request = _decode(first.input, OptimizeRequest)
        baseline_id = view.request.baseline.id if view.request else None
        view.rounds.extend(rounds_of(activity_calls(history), baseline_id, i))
    last = histories[-1].events[-1]
    if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
        view.result = _decode(last.workflow_execution_completed_event_attributes.result, OptimizeResult)
        # The workflow completes when the run fails too (its baseline broken): the result says which.
        view.status = view.result.status.replace("_", " ") if view.result is not None else "completed"
    elif last.event_type in (EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
                             EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
                             EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED,
                             EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT):
        view.status = EventType.Name(last.event_type).removeprefix("EVENT_TYPE_WORKFLOW_EXECUTION_").lower()
    return view
