"""Every activity of an optimization run, in one table: name, request and result types, task queue,
timeouts and retry policy. The workflows call each activity through its constant here (`TEST.execute(...)`,
typed by its result; docs/decisions/0032), the workers register
their implementations by its names (frontend/workers.py checks none is missing or extra), and history
decodes each call's payloads with its types (frontend/history.py).

Activity ids name where a call belongs: ``r<round>.s<slot>.<name>.<n>`` (n counts calls in the run,
so every id is unique). Round 0 is the test design and the baseline; slot is the candidate's place in
its round (0 for round-wide calls: the analyst, the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Literal, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy

from kopt import queues
from kopt import agent_models as am
from kopt.models import CompileRequest, CompileResult, ExecRequest, ProfileResult, TestResult
from kopt.run_models import ActivityTimeouts

Kind = Literal["agents", "build", "exec"]

NON_RETRYABLE = ["InvalidRequest"]
AGENT_RETRY = RetryPolicy(maximum_attempts=5, maximum_interval=timedelta(minutes=2),
                          non_retryable_error_types=NON_RETRYABLE)  # fmt: skip
# Runs started with LLM_FAULTS_PATCH (docs/decisions/0016): an unavailable endpoint is retried with
# backoff for as long as the wall-time budget allows; unusable replies and errors no retry can fix are not.
AGENT_RETRY_PATIENT = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                                  maximum_interval=timedelta(minutes=2), maximum_attempts=0,
                                  non_retryable_error_types=[*NON_RETRYABLE, *am.BAD_REPLY_TYPES,
                                                             *am.STOP_TYPES])  # fmt: skip
BUILD_RETRY = RetryPolicy(maximum_attempts=5, non_retryable_error_types=NON_RETRYABLE)
EXEC_RETRY = RetryPolicy(maximum_attempts=5, non_retryable_error_types=NON_RETRYABLE)


Req = TypeVar("Req")
Res = TypeVar("Res")


@dataclass(frozen=True)
class ActivityDef(Generic[Req, Res]):
    """One activity: workflows call it through `execute` (typed by its request and result), never by a
    string of its name."""

    name: str
    request: type[Req]
    result: type[Res]
    kind: Kind  # which workers serve it: the agents queue, a build queue, an exec queue
    who: str  # how a person calls it (agents: the role)

    async def execute(self, arg: Req, **options: Any) -> Res:
        """workflow.execute_activity of this activity, from workflow code (options: self.options(...),
        an activity id, a schedule-to-close timeout)."""
        return await workflow.execute_activity(self.name, arg, **options)

    def queue(self, target: str, toolchain: str, gpu_class: str | None) -> str:
        if self.kind == "agents":
            return queues.AGENTS_QUEUE
        if self.kind == "build":
            return queues.build_queue(toolchain)
        return queues.exec_queue(target, gpu_class)

    def timeouts(self, t: ActivityTimeouts) -> tuple[timedelta, timedelta]:
        """(start-to-close, heartbeat) from the run's timeouts."""
        seconds = {"agents": (t.agent_s, t.agent_heartbeat_s), "build": (t.compile_s, t.compile_heartbeat_s),
                   "exec": (t.exec_s, t.exec_heartbeat_s)}[self.kind]  # fmt: skip
        return timedelta(seconds=seconds[0]), timedelta(seconds=seconds[1])

    def options(self, target: str, toolchain: str, gpu_class: str | None, timeouts: ActivityTimeouts,
                patient: bool = False) -> dict:  # fmt: skip
        """workflow.execute_activity's keyword arguments for this activity (no id)."""
        start, heartbeat = self.timeouts(timeouts)
        return dict(task_queue=self.queue(target, toolchain, gpu_class), start_to_close_timeout=start,
                    heartbeat_timeout=heartbeat, retry_policy=self.retry(patient), result_type=self.result)

    def retry(self, patient: bool = False) -> RetryPolicy:
        if self.kind == "agents":
            return AGENT_RETRY_PATIENT if patient else AGENT_RETRY
        return BUILD_RETRY if self.kind == "build" else EXEC_RETRY


PLAN = ActivityDef("plan", am.AgentPlanRequest, am.PlanOutput, "agents", "planner")
CODE = ActivityDef("code", am.AgentCodeRequest, am.CodeOutput, "agents", "coder")
REPAIR = ActivityDef("repair", am.RepairRequest, am.CodeOutput, "agents", "coder (repair turn)")
ANALYZE = ActivityDef("analyze", am.AnalyzeRequest, am.DiagnosisOutput, "agents", "profile analyst")
DESIGN_TESTS = ActivityDef("design_tests", am.TestDesignRequest, am.TestDesignOutput, "agents", "test designer")
SINGLE_AGENT = ActivityDef("single_agent", am.SingleAgentRequest, am.SingleAgentOutput, "agents", "single agent")
COMPILE = ActivityDef("compile", CompileRequest, CompileResult, "build", "compiler")
TEST = ActivityDef("test", ExecRequest, TestResult, "exec", "correctness test")
PROFILE = ActivityDef("profile", ExecRequest, ProfileResult, "exec", "profile")

ACTIVITIES: dict[str, ActivityDef] = {
    d.name: d for d in (PLAN, CODE, REPAIR, ANALYZE, DESIGN_TESTS, SINGLE_AGENT, COMPILE, TEST, PROFILE)
}


def names(kind: Kind) -> list[str]:
    return [d.name for d in ACTIVITIES.values() if d.kind == kind]


def activity_id(rnd: int, slot: int, name: str, n: int) -> str:
    return f"r{rnd}.s{slot}.{name}.{n}"


def parse_activity_id(activity_id: str) -> tuple[int, int] | None:
    """(round, slot) of an id made by activity_id; None for Temporal's default ids (older runs)."""
    parts = activity_id.split(".")
    if len(parts) != 4 or not parts[0].startswith("r") or not parts[1].startswith("s"):
        return None
    try:
        return int(parts[0][1:]), int(parts[1][1:])
    except ValueError:
        return None
