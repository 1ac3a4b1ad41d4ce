"""OptimizeKernel: baseline, then rounds of plan -> code -> compile -> test -> profile.

Each activity runs on the queue of its capability: agents on kopt-agents, compile on
kopt-build-<toolchain>, test and profile on kopt-exec-cpu or kopt-gpu-<class>. Compile errors and
wrong results are data in the history; only infrastructure faults are retried.
"""

from __future__ import annotations

import math

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from kopt import queues
    from kopt.models import (
        BestSummary,
        Candidate,
        CandidateOutcome,
        CodeRequest,
        CodeResult,
        CompileRequest,
        CompileResult,
        ExecRequest,
        OptimizeRequest,
        OptimizeResult,
        Plan,
        PlanRequest,
        ProfileResult,
        Progress,
        RoundRecord,
        ShapeSpeedup,
        TestResult,
    )

NON_RETRYABLE = ["InvalidRequest"]
AGENT_RETRY = RetryPolicy(maximum_attempts=5, non_retryable_error_types=NON_RETRYABLE)
BUILD_RETRY = RetryPolicy(maximum_attempts=3, non_retryable_error_types=NON_RETRYABLE)
EXEC_RETRY = RetryPolicy(maximum_attempts=3, non_retryable_error_types=NON_RETRYABLE)
MAX_EVENTS = 200


def speedups(baseline: ProfileResult, candidate: ProfileResult) -> list[ShapeSpeedup]:
    base = {(t.shape, t.dtype): t for t in baseline.timings}
    out = []
    for t in candidate.timings:
        b = base.get((t.shape, t.dtype))
        if b is None or t.median_us <= 0:
            continue
        out.append(ShapeSpeedup(shape=t.shape, dtype=t.dtype, baseline_us=b.median_us, candidate_us=t.median_us,
                                speedup=b.median_us / t.median_us, pct_sol=t.pct_sol))
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


@workflow.defn(name=queues.WORKFLOW_NAME)
class OptimizeKernel:
    def __init__(self) -> None:
        self._progress = Progress(phase="starting", round=0, rounds=0)

    @workflow.query
    def progress(self) -> Progress:
        return self._progress

    def _event(self, text: str) -> None:
        self._progress.events = [*self._progress.events, text][-MAX_EVENTS:]
        self._progress.event_total += 1

    @workflow.run
    async def run(self, req: OptimizeRequest) -> OptimizeResult:
        spec = req.package.spec
        self._progress.rounds = req.rounds
        self._progress.phase = "baseline"
        self._event(f"round 0: baseline {req.baseline.id} on {queues.exec_queue(req.target, req.gpu_class)}")

        baseline = await self._evaluate(req, 0, req.baseline, "baseline", "")
        if not baseline.correct or baseline.profile is None or not baseline.profile.ok:
            reason = _failure(baseline) or "baseline failed"
            self._progress.phase = "baseline_failed"
            self._event(f"baseline failed: {reason}")
            return OptimizeResult(kernel=spec.name, target=req.target, gpu_class=req.gpu_class,
                                  status="baseline_failed", reason=reason, baseline=baseline, rounds=[], best=None)
        baseline.per_shape = speedups(baseline.profile, baseline.profile)
        baseline.speedup_geomean = 1.0
        self._event(f"baseline: {_times(baseline)}")

        best, best_outcome, best_speedup = req.baseline, baseline, 1.0
        history: list[RoundRecord] = []
        outcomes: list[CandidateOutcome] = []
        for rnd in range(1, req.rounds + 1):
            self._progress.round, self._progress.phase = rnd, "plan"
            plan: Plan = await workflow.execute_activity(
                "plan",
                PlanRequest(package=req.package, target=req.target, round=rnd, best=best, best_speedup=best_speedup,
                            history=history, provider=req.provider, seed=req.seed),
                task_queue=queues.AGENTS_QUEUE, start_to_close_timeout=queues.PLAN_TIMEOUT,
                retry_policy=AGENT_RETRY, result_type=Plan,
            )
            if plan.exhausted:
                self._event(f"round {rnd}: planner has nothing new to try; stopping")
                break
            self._progress.phase = "code"
            coded: CodeResult = await workflow.execute_activity(
                "code",
                CodeRequest(package=req.package, target=req.target, toolchain=req.toolchain, plan=plan, base=best,
                            provider=req.provider),
                task_queue=queues.AGENTS_QUEUE, start_to_close_timeout=queues.CODE_TIMEOUT,
                retry_policy=AGENT_RETRY, result_type=CodeResult,
            )
            outcome = await self._evaluate(req, rnd, coded.candidate, plan.description, coded.diff)
            if outcome.correct and outcome.profile and outcome.profile.ok:
                outcome.per_shape = speedups(baseline.profile, outcome.profile)
                outcome.speedup_geomean = geomean([s.speedup for s in outcome.per_shape])
            improved = outcome.speedup_geomean is not None and outcome.speedup_geomean > best_speedup * (1 + req.min_gain)
            if improved:
                best, best_outcome, best_speedup = coded.candidate, outcome, outcome.speedup_geomean
                self._progress.best_speedup = best_speedup
            outcomes.append(outcome)
            history.append(RoundRecord(
                round=rnd, candidate_id=coded.candidate.id, description=plan.description,
                tunables=coded.candidate.tunables, flags=coded.candidate.flags,
                compiled=bool(outcome.compile and outcome.compile.ok), correct=outcome.correct,
                speedup_geomean=outcome.speedup_geomean, failure=_failure(outcome),
            ))
            verdict = (f"{outcome.speedup_geomean:.3f}x" if outcome.speedup_geomean is not None
                       else f"rejected ({_failure(outcome)})")
            self._event(f"round {rnd}: {plan.description}: {verdict}{' -> new best' if improved else ''}")

        self._progress.phase = "done"
        return OptimizeResult(
            kernel=spec.name, target=req.target, gpu_class=req.gpu_class, status="completed", baseline=baseline,
            rounds=outcomes,
            best=BestSummary(candidate_id=best.id, round=best_outcome.round, correct=best_outcome.correct,
                             speedup_geomean=best_speedup, per_shape=best_outcome.per_shape,
                             tunables=best.tunables, flags=best.flags, source=best.source),
        )

    async def _evaluate(self, req: OptimizeRequest, rnd: int, cand: Candidate, description: str,
                        diff: str) -> CandidateOutcome:
        outcome = CandidateOutcome(round=rnd, candidate_id=cand.id, description=description,
                                   tunables=cand.tunables, flags=cand.flags, diff=diff)
        self._progress.phase = "compile"
        compiled: CompileResult = await workflow.execute_activity(
            "compile", CompileRequest(package=req.package, target=req.target, toolchain=req.toolchain, candidate=cand),
            task_queue=queues.build_queue(req.toolchain), start_to_close_timeout=queues.COMPILE_TIMEOUT,
            retry_policy=BUILD_RETRY, result_type=CompileResult,
        )
        outcome.compile = compiled
        if not compiled.ok or compiled.library is None:
            return outcome
        shapes = req.package.spec.shapes[req.target]
        exec_q = queues.exec_queue(req.target, req.gpu_class)

        def exec_request(kind: str) -> ExecRequest:
            return ExecRequest(package=req.package, target=req.target, candidate_id=cand.id,
                               library=compiled.library, shapes=getattr(shapes, kind),
                               dtypes=req.package.spec.dtypes, seed=req.seed * 1_000_003 + rnd)

        self._progress.phase = "test"
        tested: TestResult = await workflow.execute_activity(
            "test", exec_request("test"), task_queue=exec_q, start_to_close_timeout=queues.EXEC_TIMEOUT,
            heartbeat_timeout=queues.EXEC_HEARTBEAT, retry_policy=EXEC_RETRY, result_type=TestResult,
        )
        outcome.test = tested
        outcome.correct = tested.correct
        if not tested.correct:
            return outcome
        self._progress.phase = "profile"
        outcome.profile = await workflow.execute_activity(
            "profile", exec_request("bench"), task_queue=exec_q, start_to_close_timeout=queues.EXEC_TIMEOUT,
            heartbeat_timeout=queues.EXEC_HEARTBEAT, retry_policy=EXEC_RETRY, result_type=ProfileResult,
        )
        return outcome


def _failure(outcome: CandidateOutcome) -> str | None:
    if outcome.compile is not None and not outcome.compile.ok:
        tail = outcome.compile.log_tail.strip().splitlines()
        return "compile error: " + (tail[-1] if tail else "no compiler output")
    if outcome.test is not None and not outcome.test.correct:
        return f"wrong result: {outcome.test.reason}"
    if outcome.profile is not None and not outcome.profile.ok:
        return f"profile failed: {outcome.profile.reason}"
    return None


def _times(outcome: CandidateOutcome) -> str:
    if not outcome.profile:
        return ""
    return ", ".join(f"{t.shape} {t.dtype} {t.median_us:.1f}us" for t in outcome.profile.timings)
