"""OptimizeKernel: baseline, then rounds of plan -> code -> compile -> test -> profile.

Each activity runs on the queue of its capability: agents on kopt-agents, compile on
kopt-build-<toolchain>, test and profile on kopt-exec-cpu or kopt-gpu-<class>. Compile errors and
wrong results are data in the history; only infrastructure faults are retried. Long runs
continue-as-new every `continue_every` rounds (or when the server suggests it), carrying the best
candidate and a compact summary of the rounds so far.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from kopt import queues
    from kopt.activity_table import (
        ANALYZE,
        CODE,
        COMPILE,
        DESIGN_TESTS,
        PLAN,
        PROFILE,
        REPAIR,
        SINGLE_AGENT,
        TEST,
        ActivityDef,
        activity_id,
    )
    from kopt.agent_models import (
        BAD_REPLY_TYPES,
        EVALUATING,
        STOP_TYPES,
        AgentCodeRequest,
        AgentPlanRequest,
        AnalyzeRequest,
        Diagnosis,
        LLMCall,
        SingleAgentRequest,
        TestDesignRequest,
        repair_request,
    )
    from kopt.candidates import candidate_id, unified_diff
    from kopt.dispatch import (
        bucket_labels,
        bucket_speedup,
        choose,
        edge_shapes,
        interior_shapes,
        specialized_source,
        split_shapes,
    )
    from kopt.models import (
        ArtifactRef,
        Candidate,
        CodeResult,
        CompileRequest,
        ExecRequest,
        Plan,
        ProfileResult,
        RoundRecord,
        RoundStatus,
        Shape,
    )
    from kopt.package import PackageError
    from kopt.plan_history import compact_history
    from kopt.run_models import (
        Approval,
        BestSummary,
        CandidateOutcome,
        HoldoutResult,
        OptimizeRequest,
        OptimizeResult,
        Progress,
        ResumePoint,
        RunState,
        SpecializedResult,
        Usage,
    )
    from kopt.search_attributes import BEST_KEY, KERNEL_KEY, ROUND_KEY
    from workflows import judging, rules
    from workflows.patches import (ACTIVITY_IDS_PATCH, ASYNC_SLOTS_PATCH, BUDGET_CANCELS_PATCH,
                                   BUDGET_HOLDOUT_PATCH, BUDGET_RESERVE_PATCH, COMPACT_HISTORY_PATCH,
                                   HEAD_TO_HEAD_PATCH, HOLDOUT_PATCH, LLM_FAULTS_PATCH, NOISE_FLOOR_PATCH,
                                   SHAPE_GUARD_PATCH, SPECIALIZE_PATCH)  # fmt: skip
    from workflows.rules import Stop, StopKind, geomean, held_out_overfit, significant, speedups

BAD_REPLIES_BEFORE_FALLBACK = 3  # consecutive unusable replies of one role, then its offline stand-in
OFFLINE_FALLBACK = (PLAN.name, CODE.name)  # roles with an offline stand-in (the others are skipped instead)
R = TypeVar("R")
MAX_EVENTS = 200
ANALYST_HISTORY = 8  # the most recent round records the analyst sees
HOLDOUT_ROUND = -1  # the (round, slot) the held-out calls' activity ids name (runs since HOLDOUT_PATCH)
VERSUS_SLOT = -1  # the slot the head-to-head profile's activity id names (its round's; not a candidate's)
SPECIALIZE_ROUND = -2  # likewise for the shape-specialized step (runs since SPECIALIZE_PATCH)


class BadReply(Exception):
    """An agent's reply could not be used (invalid after its repair turn, refused, too long)."""


class StopRun(Exception):
    """The LLM endpoint refuses in a way no retry can fix ("llm"), or the wall-time budget ran out
    waiting for it ("budget")."""

    def __init__(self, text: str, kind: StopKind = "llm") -> None:
        super().__init__(text)
        self.kind = kind


def shape_limits(req: OptimizeRequest) -> dict[str, int]:
    """Upper bound per shape symbol for designed tests: the largest declared test shape's value."""
    limits: dict[str, int] = {}
    for shape in req.package.spec.shapes[req.target].test:
        for k, v in shape.dims.items():
            limits[k] = max(limits.get(k, 1), v)
    return limits


@workflow.defn(name=queues.WORKFLOW_NAME)
class OptimizeKernel:
    def __init__(self) -> None:
        self._progress = Progress(phase="starting", round=0, rounds=0)
        self._pending: str | None = None
        self._decision: Approval | None = None
        self._usage = Usage()
        self._extra_shapes: list[Shape] = []  # accepted from the test designer, for every candidate
        self._baseline_library: ArtifactRef | None = None  # calibrates and A/B-times every candidate
        self._patient = False  # LLM_FAULTS_PATCH: bad replies fail candidates, outages wait
        self._ids = False  # ACTIVITY_IDS_PATCH: activity ids name their round and slot
        self._guard = False  # SHAPE_GUARD_PATCH: a best slower than the baseline at any shape is refused
        self._calls = 0  # activities scheduled in this segment (makes every id unique)
        self._bad_replies: dict[str, int] = {}  # activity -> consecutive unusable replies
        self._fallback: set[str] = set()  # activities now served by the offline provider
        self._stop: str | None = None  # why the LLM endpoint ended the run
        self._stop_kind: StopKind = "llm"
        self._started_at: float | None = None
        self._req: OptimizeRequest | None = None
        self._cache_round: int | None = None  # the round that may read the reply cache (kopt resume)
        self._state: RunState | None = None  # after the last finished round (resume_point)

    @workflow.query
    def progress(self) -> Progress:
        self._progress.usage = self._usage
        return self._progress

    @workflow.query
    def resume_point(self) -> ResumePoint:
        """The request and the state after the last finished round, for `kopt resume` (a query
        answers for a closed run too: the worker replays its history)."""
        state = None
        if self._state is not None:
            state = self._state.model_copy(deep=True)
            state.next_round = max(r.round for r in state.rounds) + 1 if state.rounds else state.next_round
            state.events, state.event_total, state.usage = (list(self._progress.events), self._progress.event_total,
                                                            self._usage.model_copy())  # fmt: skip
        return ResumePoint(request=self._req, state=state)

    @workflow.update
    async def approve(self, decision: Approval) -> str:
        self._decision = decision
        return f"{'accepted' if decision.accept else 'rejected'} {decision.candidate_id}"

    @approve.validator
    def _validate_approve(self, decision: Approval) -> None:
        if self._pending is None:
            raise ValueError("no candidate is waiting for approval")
        if decision.candidate_id != self._pending:
            raise ValueError(f"unknown candidate id {decision.candidate_id!r}; waiting for {self._pending!r}")

    def _event(self, text: str) -> None:
        self._progress.events = [*self._progress.events, text][-MAX_EVENTS:]
        self._progress.event_total += 1
        # What the Web UI shows as the run's current details (its result panel stays empty until the run
        # closes): kept in the worker, answered through the built-in metadata query, never in history.
        workflow.set_current_details(self._progress.details())

    # ---------------------------------------------------------------------------------- run

    @workflow.run
    async def run(self, req: OptimizeRequest) -> OptimizeResult:
        spec = req.package.spec
        self._req = req.model_copy(update={"state": None})
        self._patient = workflow.patched(LLM_FAULTS_PATCH)
        self._ids = workflow.patched(ACTIVITY_IDS_PATCH)
        self._guard = workflow.patched(SHAPE_GUARD_PATCH)
        self._floored = workflow.patched(NOISE_FLOOR_PATCH)
        self._head_to_head = workflow.patched(HEAD_TO_HEAD_PATCH)
        self._progress.rounds = req.rounds
        state = req.state
        if state is None:
            started = await self._start(req)
            if isinstance(started, OptimizeResult):
                return started
            state = started
        else:
            self._progress.events, self._progress.event_total = state.events, state.event_total
            if state.started_at is None:  # kopt resume: the wall-time budget counts from here
                state.started_at = _budget_start(req)
            if state.resumed:  # kopt resume: the unfinished round's questions were paid for already
                self._cache_round, state.resumed = state.next_round, False
        self._req, self._state = req.model_copy(update={"state": None}), state
        self._usage = state.usage
        self._extra_shapes = state.extra_test_shapes
        self._baseline_library = state.baseline.compile.library if state.baseline.compile else None
        self._progress.segment = state.segment
        self._progress.best_speedup = state.best_summary.speedup_geomean
        self._started_at = state.started_at
        # Offline, several candidates a round: asynchronous slots (ASYNC_SLOTS_PATCH); else rounds in step.
        search = (self._slots if req.candidates_per_round > 1 and req.provider == "offline" and not req.single_agent
                  and not req.lockstep and workflow.patched(ASYNC_SLOTS_PATCH) else self._rounds)
        stop_reason, stop_kind = await search(req, state, state.next_round)

        specialized = None
        dispatch = spec.dispatch.get(req.target)
        best_s = _judging_seconds(state.best_outcome)  # what judging one more library costs, about
        budget_stop = stop_reason if stop_reason and stop_kind == "budget" else None
        if dispatch is not None and workflow.patched(SPECIALIZE_PATCH):
            skip = budget_stop or getattr(self._no_room(req, state, best_s, best_s, "the shape-specialized step"),
                                          "text", None)
            if skip:
                specialized = SpecializedResult(buckets=bucket_labels(dispatch), reason=f"skipped: {skip}")
                if not budget_stop:
                    self._event(f"shape-specialized: skipped, {skip}")
            else:
                specialized = await self._specialize(req, state, dispatch)
        holdout = None
        if req.holdout_shapes and workflow.patched(HOLDOUT_PATCH):
            skip = (budget_stop if budget_stop and workflow.patched(BUDGET_HOLDOUT_PATCH)
                    else getattr(self._no_room(req, state, best_s, best_s, "the held-out step"), "text", None))
            if skip:
                labels = [s.label for s in req.holdout_shapes]
                holdout = HoldoutResult(candidate_id=state.best.id, shapes=labels, correct=False,
                                        reason=f"skipped: {skip}",
                                        search_speedup=state.best_summary.speedup_geomean)  # fmt: skip
                self._event(f"held-out shapes {'; '.join(labels)}: skipped, {skip}")
            else:
                holdout = await self._holdout(req, state)
        self._progress.phase = "done"
        return OptimizeResult(kernel=spec.name, target=req.target, gpu_class=req.gpu_class, status="completed",
                              baseline=state.baseline, rounds=state.rounds, best=state.best_summary,
                              segments=state.segment, stop_reason=stop_reason, usage=self._usage,
                              extra_test_shapes=state.extra_test_shapes,
                              llm_stopped=self._stop is not None and stop_reason == self._stop, holdout=holdout,
                              specialized=specialized)

    async def _rounds(self, req: OptimizeRequest, state: RunState,
                      first_round: int) -> tuple[str | None, StopKind | None]:  # fmt: skip
        """The search in rounds: each round's candidates are proposed, judged side by side, and the
        round's best compared with the run's best once all of them are done. Returns why it stopped."""
        stop_reason: str | None = None
        stop_kind: StopKind | None = None
        for rnd in range(first_round, req.rounds + 1):
            if rnd > first_round and (rnd - first_round >= req.continue_every
                                      or workflow.info().is_continue_as_new_suggested()):
                self._continue_as_new(req, state, rnd)
            stop = self._stop_reason(req, state) or self._no_room(req, state, state.last_round_s,
                                                                  state.last_round_device_s, f"round {rnd}")
            if stop:
                stop_reason, stop_kind = stop.text, stop.kind
                self._event(f"stopping before round {rnd}: {stop_reason}")
                break
            self._progress.round = rnd
            round_start, device_start = workflow.now().timestamp(), self._usage.device_seconds
            try:
                records = await self._round(req, state, rnd)
            except StopRun as stopped:
                stop_reason = self._stop = str(stopped)
                stop_kind = self._stop_kind = stopped.kind
                self._event(f"stopping in round {rnd}: {stop_reason}")
                break
            state.last_round_s = workflow.now().timestamp() - round_start
            state.last_round_device_s = self._usage.device_seconds - device_start
            if records is None:
                stop_reason, stop_kind = "the planner has nothing new to try", "exhausted"
                break
            state.rounds.extend(records)
            improved = any(r.accepted for r in records)
            state.rounds_since_improvement = 0 if improved else state.rounds_since_improvement + 1
            self._upsert_round(rnd, state)
        return stop_reason, stop_kind

    async def _slots(self, req: OptimizeRequest, state: RunState,
                     first_round: int) -> tuple[str | None, StopKind | None]:  # fmt: skip
        """The search in asynchronous slots (ASYNC_SLOTS_PATCH): `candidates_per_round` candidates are
        judged at once; each one is compared with the run's best as soon as it finishes, and its slot
        takes the next proposal (made from the best as it is then, every running configuration counted
        as tried), so no device waits for a slower candidate. Proposal p is round p // N + 1, slot
        p % N; records are kept by (round, slot), events in the order the candidates finished. A history
        segment ends on a round boundary once its running candidates are done. Returns why it stopped."""
        n = req.candidates_per_round
        nxt, last = (first_round - 1) * n, req.rounds * n
        segment_end = (first_round - 1 + req.continue_every) * n
        running: dict[asyncio.Task, tuple[int, int, float, RoundRecord]] = {}  # -> round, slot, start, placeholder
        stop: Stop | None = None
        since = state.rounds_since_improvement * n  # candidates judged since the last new best
        idle = False  # the planner had nothing new while candidates ran: wait for one of them first
        deadline = self._deadline(req)
        while True:
            while stop is None and not idle and len(running) < n and nxt < min(last, segment_end):
                rnd, slot = nxt // n + 1, nxt % n
                if nxt > (first_round - 1) * n and slot == 0 and workflow.info().is_continue_as_new_suggested():
                    segment_end = nxt
                    break
                stop = self._stop_reason(req, state) or self._no_room(
                    req, state, state.last_round_s, state.last_round_device_s, f"round {rnd}/{slot}")
                if stop is not None:
                    still = f" ({len(running)} running candidate(s) finish first)" if running else ""
                    self._event(f"stopping before round {rnd}/{slot}: {stop.text}{still}")
                    break
                self._progress.round = rnd
                tried = [*state.rounds, *(placeholder for *_, placeholder in running.values())]
                try:
                    proposal = await self._propose(req, state, (rnd, slot), tried, None)
                except StopRun as stopped:
                    self._stop, self._stop_kind = str(stopped), stopped.kind
                    stop = Stop(stopped.kind, str(stopped))
                    self._event(f"stopping in round {rnd}/{slot}: {stop.text}")
                    break
                if proposal is None:
                    if not running:
                        stop = Stop("exhausted", "the planner has nothing new to try")
                        self._event(f"round {rnd}/{slot}: planner has nothing new to try; stopping")
                    idle = True
                    break
                nxt += 1
                if isinstance(proposal, str):
                    state.rounds.append(_no_candidate(rnd, slot, proposal))
                    self._event(f"round {rnd}/{slot}: {proposal}")
                    continue
                plan, coded = proposal
                task = asyncio.ensure_future(self._candidate(req, (rnd, slot), state.best, plan, coded, None))
                running[task] = (rnd, slot, workflow.now().timestamp(), _placeholder(rnd, slot, plan, coded))
            if not running:
                break
            left = None if deadline is None else max(deadline - workflow.now().timestamp(), 0.001)
            done, _ = await workflow.wait(list(running), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the wall-time budget ran out with candidates running
                stop = self._stop_reason(req, state) or Stop("budget", "wall-time budget reached")
                cancelled = await self._cancel_running(running, stop)
                for record in cancelled:
                    self._event(f"round {record.round}/{record.slot}: {record.description}: {record.failure}")
                state.rounds = _by_slot([*state.rounds, *cancelled])
                break
            for task in sorted(done, key=lambda t: running[t][:2]):
                rnd, slot, started, _ = running.pop(task)
                try:
                    outcome, cand = task.result()
                except StopRun as stopped:
                    self._stop, self._stop_kind = str(stopped), stopped.kind
                    stop = stop or Stop(stopped.kind, str(stopped))
                    self._event(f"stopping in round {rnd}/{slot}: {stopped}")
                    continue
                records = await self._decide(req, state, rnd, [(outcome, cand)], [slot], [], screen=True)
                state.rounds = _by_slot([*state.rounds, *records])
                state.last_round_s = workflow.now().timestamp() - started
                state.last_round_device_s = _judging_seconds(outcome)
                since = 0 if any(r.accepted for r in records) else since + 1
                state.rounds_since_improvement = since // n
                self._upsert_round(rnd, state)
            idle = False
        if stop is None and nxt < last and nxt == segment_end:
            self._continue_as_new(req, state, nxt // n + 1)
        return (stop.text, stop.kind) if stop is not None else (None, None)

    def _deadline(self, req: OptimizeRequest) -> float | None:
        """When the wall-time budget runs out, in workflow time (BUDGET_CANCELS_PATCH); None without one."""
        wall = req.budgets.max_wall_time_s
        if wall is None or self._started_at is None or not workflow.patched(BUDGET_CANCELS_PATCH):
            return None
        return self._started_at + wall

    async def _cancel_running(self, running: dict, stop: Stop) -> list[RoundRecord]:
        """Cancel the candidates still running when the wall-time budget ran out (BUDGET_CANCELS_PATCH):
        their activities are asked to stop (a harness child is killed at its next heartbeat). Their
        records, with the status cancelled."""
        for task in running:
            task.cancel()
        await workflow.wait(list(running))
        for task in running:  # their ActivityError is the cancellation asked for: read, so never reported
            if not task.cancelled():
                task.exception()
        why = f"cancelled: {stop.text}"
        cancelled = [placeholder.model_copy(update={"failure": why, "status": "cancelled"})
                     for *_, placeholder in sorted(running.values(), key=lambda v: v[:2])]
        running.clear()
        return cancelled

    def _continue_as_new(self, req: OptimizeRequest, state: RunState, rnd: int) -> None:
        self._event(f"continuing as new before round {rnd} (segment {state.segment + 1})")
        state.next_round, state.segment = rnd, state.segment + 1
        state.events, state.event_total, state.usage = self._progress.events, self._progress.event_total, self._usage
        workflow.continue_as_new(req.model_copy(update={"state": state}))

    def _upsert_round(self, rnd: int, state: RunState) -> None:
        if KERNEL_KEY in workflow.info().typed_search_attributes:  # registered on this namespace
            workflow.upsert_search_attributes([ROUND_KEY.value_set(rnd),
                                               BEST_KEY.value_set(state.best_summary.speedup_geomean)])

    async def _holdout(self, req: OptimizeRequest, state: RunState) -> HoldoutResult:
        """The best, tested and then timed against the baseline (interleaved A/B) on the held-out
        shapes. Overfit: the best won on the search shapes and is wrong, or statistically slower than
        the baseline, on a held-out shape (or over all of them)."""
        best, summary = state.best, state.best_summary
        labels = [s.label for s in req.holdout_shapes]
        result = HoldoutResult(candidate_id=best.id, shapes=labels, correct=False,
                               search_speedup=summary.speedup_geomean)
        library = state.best_outcome.compile.library if state.best_outcome.compile else None
        if library is None:
            result.reason = "the best's library is not in the run's state"
            return result
        self._progress.phase = "holdout"
        self._event(f"held-out shapes {'; '.join(labels)}: judging the best {best.id}")
        is_baseline = best.id == req.baseline.id
        baseline = None if is_baseline else self._baseline_library
        request = ExecRequest(package=req.package, target=req.target, candidate_id=best.id, library=library,
                              shapes=req.holdout_shapes, dtypes=req.package.spec.dtypes,
                              seed=req.seed * 1_000_003 + req.rounds + 1, source=best.source,
                              baseline_library=baseline, baseline_id=req.baseline.id if baseline else None,
                              time_cap_s=req.time_cap_s)
        at = (HOLDOUT_ROUND, 0)
        tested = await TEST.execute(request, **self._options(TEST, req, at))
        self._usage.device_seconds += tested.seconds
        if not tested.correct:
            result.reason = f"wrong at a held-out shape: {tested.reason}"
            result.overfit = not is_baseline
            self._event(f"held-out: the best is {result.reason}" + (" (overfit)" if result.overfit else ""))
            return result
        result.correct = True
        if is_baseline:
            result.reason = "the best is the baseline: correct, nothing to time against"
            self._event("held-out: the baseline is correct there; no best to compare")
            return result
        profiled = await PROFILE.execute(request, **self._options(PROFILE, req, at))
        self._usage.device_seconds += profiled.seconds
        if not profiled.ok or profiled.ab is None:
            result.reason = f"not timed: {profiled.reason or 'no A/B against the baseline'}"
            self._event(f"held-out: {result.reason}")
            return result
        ab = profiled.ab
        result.per_shape = speedups(profiled, profiled, self._floored)
        result.speedup_geomean, result.verdict = ab.speedup_geomean, ab.verdict
        result.speedup_ci = [ab.ci_low, ab.ci_high] if ab.ci_low is not None else None
        result.overfit, new, result.foretold = held_out_overfit(result.per_shape, ab.verdict == "slower",
                                                                summary.per_shape)  # fmt: skip
        result.regressions = new + result.foretold
        ci = f" [{ab.ci_low:.3f}, {ab.ci_high:.3f}]" if ab.ci_low is not None else ""
        foretold = f"; slower at {', '.join(result.foretold)} as on the search shapes" if result.foretold else ""
        self._event(f"held-out: {ab.speedup_geomean:.3f}x{ci} ({ab.verdict}) against {summary.speedup_geomean:.3f}x "
                    f"on the search shapes" + (f"; OVERFIT: slower at {', '.join(new)}" if new
                                               else "; OVERFIT" if result.overfit else "") + foretold)
        return result

    async def _specialize(self, req: OptimizeRequest, state: RunState, dispatch) -> SpecializedResult:
        """Per bucket of the dispatch symbol, the tunable values of the measured candidate (with the
        best's flags) fastest on that bucket's timed shapes; if they differ, one library of the best's
        source dispatching on the call's shape, compiled, tested (bucket edges included) and timed.
        It becomes the best under the rules of a round: faster by min_gain, significant, no regression."""
        spec = req.package.spec
        result = SpecializedResult(buckets=bucket_labels(dispatch))
        best = state.best
        baseline_per_shape = [s.model_copy(update={"candidate_us": s.baseline_us, "speedup": 1.0, "ci_low": None,
                                                   "ci_high": None}) for s in state.best_summary.per_shape]
        options = [(best.id, best.tunables, state.best_summary.per_shape)]
        if best.id != req.baseline.id and req.baseline.flags == best.flags:
            options.append((req.baseline.id, req.baseline.tunables, baseline_per_shape))
        options += [(r.candidate_id, r.tunables, r.per_shape) for r in state.rounds
                    if r.correct and r.per_shape and r.flags == best.flags and r.candidate_id != best.id]
        timed = req.workload or spec.shapes[req.target].bench  # what every option was timed at
        picks = choose(dispatch, timed, [(t, p) for _, t, p in options])
        if picks is None:
            result.reason = f"a bucket has no timed shape ({', '.join(result.buckets)})"
            self._event(f"shape-specialized: nothing to build: {result.reason}")
            return result
        result.settings = [dict(options[i][1]) for i in picks]
        result.picked_from = [options[i][0] for i in picks]
        if all(s == best.tunables for s in result.settings):
            result.reason = "the best's values are the fastest in every bucket"
            self._event(f"shape-specialized: nothing to build: {result.reason}")
            return result
        try:
            source = specialized_source(spec, best.source, dispatch, result.settings)
        except PackageError as exc:
            result.reason = f"the best's source does not take these values: {exc}"
            self._event(f"shape-specialized: nothing to build: {result.reason}")
            return result
        cand = Candidate(id=candidate_id(source, best.flags, req.toolchain), source=source, flags=list(best.flags),
                         tunables=dict(best.tunables), parent_id=best.id, origin="shape-specialized")
        result.candidate_id = cand.id
        plan = "; ".join(f"{b}: {s}" for b, s in zip(result.buckets, result.settings))
        self._progress.phase = "specialize"
        self._event(f"shape-specialized {cand.id}: {plan}")
        outcome = await self._evaluate(req, (SPECIALIZE_ROUND, 0), cand, f"shape-specialized ({plan})",
                                       unified_diff(best.source, source, spec.sources[req.target]),
                                       [*self._extra_shapes, *edge_shapes(spec, req.target, dispatch),
                                        *interior_shapes(spec, req.target, dispatch, req.seed)])
        result.correct = outcome.correct
        if outcome.test is not None:
            result.tested = list(dict.fromkeys(c.shape for c in outcome.test.checks))
        if not (outcome.correct and outcome.profile and outcome.profile.ok):
            result.reason = _failure(outcome) or "not measured"
            self._event(f"shape-specialized: {result.reason}")
            return result
        result.regressions = _score(state, outcome, self._floored)
        result.per_shape, result.speedup_ci = outcome.per_shape, outcome.speedup_ci
        result.speedup_geomean = outcome.speedup_geomean
        before = state.best_summary.speedup_geomean
        # A bucket is the unit of specialization: a gain of min_gain in one bucket, with no bucket losing
        # more than that and the objective no lower, is kept even where the weighted objective hardly
        # moves (decode-heavy time hides a prefill win).
        ratios = []
        for bucket in split_shapes(dispatch, timed):
            ours, best_s = bucket_speedup(outcome.per_shape, bucket), bucket_speedup(state.best_summary.per_shape, bucket)
            ratios.append(ours / best_s if ours and best_s else 1.0)
        result.bucket_gains = [round(r, 4) for r in ratios]
        gain = rules.bucket_gain(outcome.speedup_geomean, before, ratios, req.min_gain)
        if result.regressions and not req.allow_regressions:
            result.reason = f"slower than the baseline at {', '.join(result.regressions)}"
        elif not gain or not significant(outcome.profile):
            result.reason = (f"beats the best by less than {req.min_gain:.0%} overall and in every bucket "
                             f"(bucket ratios {', '.join(f'{r:.3f}' for r in ratios)})")
        elif req.approve and not await self._await_approval(cand.id, outcome.speedup_geomean):
            result.reason = "rejected at approval"
        else:
            result.accepted = True
            state.best, state.best_outcome = cand, outcome
            state.best_summary = BestSummary(
                candidate_id=cand.id, round=state.best_summary.round, correct=True,
                speedup_geomean=outcome.speedup_geomean, per_shape=outcome.per_shape, speedup_ci=outcome.speedup_ci,
                tunables=cand.tunables, flags=cand.flags, source=cand.source, nsight=_nsight(outcome))
            self._progress.best_speedup = outcome.speedup_geomean
        self._event(f"shape-specialized: {outcome.speedup_geomean:.3f}x against the best's {before:.3f}x"
                    + (" -> new best" if result.accepted else f"; kept the best ({result.reason})"))
        return result

    def _no_room(self, req: OptimizeRequest, state: RunState, wall_s: float | None, device_s: float | None,
                 what: str) -> Stop | None:  # fmt: skip
        """A budget stop where the run's wall-time or device-time budget has no room for a step of about
        `wall_s` and `device_s` seconds (BUDGET_RESERVE_PATCH; runs without those budgets never ask)."""
        b = req.budgets
        if (b.max_wall_time_s is None and b.max_gpu_seconds is None) or not workflow.patched(BUDGET_RESERVE_PATCH):
            return None
        elapsed = workflow.now().timestamp() - state.started_at if state.started_at is not None else None
        why = rules.no_room(b, self._usage, elapsed, wall_s, device_s, what)
        return Stop("budget", why) if why else None

    def _stop_reason(self, req: OptimizeRequest, state: RunState) -> Stop | None:
        if self._stop:
            return Stop(self._stop_kind, self._stop)
        elapsed = workflow.now().timestamp() - state.started_at if state.started_at is not None else None
        return rules.stop_reason(req.budgets, self._usage, elapsed, req.patience, state.rounds_since_improvement)

    async def _start(self, req: OptimizeRequest) -> RunState | OptimizeResult:
        """Round 0: the test designer (LLM providers), then the baseline's compile, test and profile."""
        spec = req.package.spec
        started_at = _budget_start(req)
        self._started_at = started_at
        extra: list[Shape] = []
        if req.provider != "offline":
            self._progress.phase = "design_tests"
            try:
                design = await self._agent(
                    DESIGN_TESTS, TestDesignRequest(package=req.package, target=req.target,
                                                      limits=shape_limits(req), llm=req.llm), req, (0, 0))
            except BadReply as bad:
                self._event(f"round 0: no designed tests ({bad})")
            except StopRun as stop:
                self._stop, self._stop_kind = str(stop), stop.kind  # the baseline is still measured; the loop stops
                # before round 1
            else:
                self._usage.add_calls(design.calls)
                extra = design.review.accepted
                self._event(f"round 0: test designer added {len(extra)} shape(s)"
                            f"{', rejected ' + str(len(design.review.rejected)) if design.review.rejected else ''}")
        self._progress.phase = "baseline"
        self._event(f"round 0: baseline {req.baseline.id} on {queues.exec_queue(req.target, req.gpu_class)}")
        baseline = await self._evaluate(req, (0, 0), req.baseline, "baseline", "", extra)
        if not baseline.correct or baseline.profile is None or not baseline.profile.ok:
            reason = _failure(baseline) or "baseline failed"
            self._progress.phase = "baseline_failed"
            self._event(f"baseline failed: {reason}")
            return OptimizeResult(kernel=spec.name, target=req.target, gpu_class=req.gpu_class,
                                  status="baseline_failed", reason=reason, baseline=baseline, rounds=[], best=None,
                                  usage=self._usage)
        baseline.per_shape = speedups(baseline.profile, baseline.profile)
        baseline.speedup_geomean = 1.0
        self._event(f"baseline: {_times(baseline)}")
        best = req.baseline
        summary = BestSummary(candidate_id=best.id, round=0, correct=True, speedup_geomean=1.0,
                              per_shape=baseline.per_shape, tunables=best.tunables, flags=best.flags,
                              source=best.source)
        return RunState(baseline=baseline, best=best, best_summary=summary, best_outcome=baseline,
                        extra_test_shapes=extra, started_at=started_at, usage=self._usage)

    # ---------------------------------------------------------------------------------- rounds

    async def _round(self, req: OptimizeRequest, state: RunState, rnd: int) -> list[RoundRecord] | None:
        """Propose N candidates, evaluate them in parallel, keep the best correct one if it is real."""
        diagnosis = (await self._diagnose(req, state, rnd) if req.provider != "offline" and not req.single_agent
                     else None)
        proposals: list[tuple[Plan, CodeResult]] = []
        slots: list[int] = []  # the round slot of each proposal
        failed: list[RoundRecord] = []  # slots whose agent gave no usable reply
        pending = list(state.rounds)
        for slot in range(req.candidates_per_round):
            proposal = await self._propose(req, state, (rnd, slot), pending, diagnosis)
            if isinstance(proposal, str):
                failed.append(_no_candidate(rnd, slot, proposal))
                continue
            if proposal is None:
                break
            plan, coded = proposal
            proposals.append(proposal)
            slots.append(slot)
            # Later slots see this one as tried, so each slot proposes something different.
            pending.append(_placeholder(rnd, slot, plan, coded))
        if not proposals and failed:
            for record in failed:
                self._event(f"round {rnd}/{record.slot}: {record.failure}")
            return failed
        if not proposals:
            self._event(f"round {rnd}: planner has nothing new to try; stopping")
            return None
        deadline = self._deadline(req)
        if deadline is None:
            outcomes = await asyncio.gather(*[
                self._candidate(req, (rnd, slot), state.best, plan, coded, diagnosis)
                for slot, (plan, coded) in zip(slots, proposals)])
            return await self._decide(req, state, rnd, outcomes, slots, failed)
        # A wall-time budget (BUDGET_CANCELS_PATCH): the candidates still running when it runs out are cancelled.
        running = {asyncio.ensure_future(self._candidate(req, (rnd, slot), state.best, plan, coded, diagnosis)):
                   (rnd, slot, 0.0, _placeholder(rnd, slot, plan, coded))
                   for slot, (plan, coded) in zip(slots, proposals)}  # fmt: skip
        tasks = list(running)
        done, _ = await workflow.wait(tasks, timeout=max(deadline - workflow.now().timestamp(), 0.001))
        finished = [(task, running.pop(task)[1]) for task in tasks if task in done]
        outcomes = [task.result() for task, _ in finished]
        if running:
            stop = self._stop_reason(req, state) or Stop("budget", "wall-time budget reached")
            failed = [*failed, *await self._cancel_running(running, stop)]
        return await self._decide(req, state, rnd, outcomes, [slot for _, slot in finished], failed)

    async def _decide(self, req: OptimizeRequest, state: RunState, rnd: int,
                      outcomes: list[tuple[CandidateOutcome, Candidate]], slots: list[int], failed: list[RoundRecord],
                      screen: bool = False) -> list[RoundRecord]:  # fmt: skip
        """The judged candidates of round `rnd` (`outcomes`, in the round slots `slots`) against the run's
        best: the best of them replaces it if the rules say so. Their records and the failed slots',
        by slot. `screen` (asynchronous slots): a candidate no faster than the best against the baseline
        is refused without its head-to-head measurement."""
        regressed: dict[int, list[str]] = {}  # slot -> its slower shapes (SHAPE_GUARD_PATCH)
        measured: list[tuple[int, float, bool]] = []  # (slot, speedup, eligible as the round's best)
        for slot, (outcome, _) in enumerate(outcomes):
            if outcome.correct and outcome.profile and outcome.profile.ok:
                slower = _score(state, outcome, self._floored)
                if self._guard:
                    regressed[slot] = slower
                measured.append((slot, outcome.speedup_geomean,
                                 not (self._guard and slower and not req.allow_regressions)))
        best_slot = rules.round_best(measured)
        accepted = None
        refused: str | None = None  # why the round's best is not the run's new best
        versus: ProfileResult | None = None  # the round's best against the best, head to head
        if best_slot is not None:
            outcome, cand = outcomes[best_slot]
            screened = (rules.why_no_head_to_head(outcome.speedup_geomean, state.best_summary.speedup_geomean,
                                                  req.min_gain) if screen and state.best.id != req.baseline.id
                        else None)  # fmt: skip
            if screened is None and self._head_to_head and state.best.id != req.baseline.id:
                versus = await self._versus_best(req, state, rnd, outcome, cand)
            if screened is not None:
                refused = screened
            elif versus is not None:
                refused = rules.why_not_better_head_to_head(versus, req.min_gain, significant(outcome.profile))
            else:  # against the baseline (the best so far, a best whose library the state lacks, or a run
                # recorded before HEAD_TO_HEAD_PATCH)
                refused = rules.why_not_best(outcome.speedup_geomean, state.best_summary.speedup_geomean,
                                             req.min_gain, significant(outcome.profile))
            if refused is None:
                refused = "not the new best: rejected at approval"
                if not req.approve or await self._await_approval(cand.id, outcome.speedup_geomean):
                    accepted = best_slot
                    state.best, state.best_outcome = cand, outcome
                    state.best_summary = BestSummary(
                        candidate_id=cand.id, round=rnd, correct=True, speedup_geomean=outcome.speedup_geomean,
                        per_shape=outcome.per_shape, speedup_ci=outcome.speedup_ci, tunables=cand.tunables,
                        flags=cand.flags, source=cand.source, nsight=_nsight(outcome))
                    self._progress.best_speedup = outcome.speedup_geomean

        records = []
        for slot, (outcome, cand) in enumerate(outcomes):
            ci = f" [{outcome.speedup_ci[0]:.3f}, {outcome.speedup_ci[1]:.3f}]" if outcome.speedup_ci else ""
            verdict = (f"{outcome.speedup_geomean:.3f}x{ci}" if outcome.speedup_geomean is not None
                       else f"rejected ({_failure(outcome)})")
            tag = f"round {rnd}" + (f"/{slots[slot]}" if len(outcomes) + len(failed) > 1 or screen else "")
            slow = regressed.get(slot, [])
            if slow:
                verdict += (f"; slower than the baseline at {', '.join(slow)}"
                            + ("" if req.allow_regressions else " (not eligible as the best)"))
            if slot == best_slot and versus is not None and versus.ab is not None:
                ab = versus.ab
                verdict += (f"; head to head against the best: {ab.speedup_geomean:.3f}x "
                            f"[{ab.ci_low:.3f}, {ab.ci_high:.3f}] ({ab.verdict})")
            if slot == best_slot and slot != accepted and refused:
                verdict += f"; {refused}"
            gpu = outcome.profile.gpu_index if outcome.profile is not None else None
            on_gpu = f" (GPU {gpu})" if gpu is not None else ""
            self._event(f"{tag}: {outcome.description}: {verdict}{' -> new best' if slot == accepted else ''}{on_gpu}")
            status, failure = _judged(outcome)
            records.append(RoundRecord(
                round=rnd, candidate_id=cand.id, description=outcome.description, tunables=cand.tunables,
                flags=cand.flags, slot=slots[slot], compiled=bool(outcome.compile and outcome.compile.ok),
                correct=outcome.correct, speedup_geomean=outcome.speedup_geomean, failure=failure,
                compile_seconds=outcome.compile.seconds if outcome.compile else None, per_shape=outcome.per_shape,
                speedup_ci=outcome.speedup_ci, accepted=slot == accepted, regressions=slow, status=status,
                gpu_index=gpu, refusal=refused if slot == best_slot and slot != accepted else None,
                **(_versus_fields(versus) if slot == best_slot else {})))
        for record in failed:
            self._event(f"round {rnd}/{record.slot}: {record.failure}")
        return sorted([*records, *failed], key=lambda r: r.slot)

    def _llm(self, req: OptimizeRequest, rnd: int):
        """The round's LLM settings: the resumed round reads the reply cache."""
        if req.llm is None or rnd != self._cache_round:
            return req.llm
        return req.llm.model_copy(update={"cache_read": True})

    async def _diagnose(self, req: OptimizeRequest, state: RunState, rnd: int) -> Diagnosis | None:
        best = state.best_outcome
        if best.profile is None:
            return None
        self._progress.phase = "analyze"
        try:
            out = await self._agent(
                ANALYZE, AnalyzeRequest(package=req.package, target=req.target, candidate=state.best,
                                          compile=best.compile, profile=best.profile,
                                          baseline=state.baseline.profile, llm=self._llm(req, rnd),
                                          history=state.rounds[-ANALYST_HISTORY:],
                                          toolchain_facts=_device(state, req.provider).get("toolchain_facts", [])),
                req, (rnd, 0))
        except BadReply as bad:
            self._event(f"no diagnosis this round ({bad})")
            return None
        self._usage.add_calls(out.calls)
        return out.diagnosis

    async def _propose(self, req: OptimizeRequest, state: RunState, at: tuple[int, int], history: list[RoundRecord],
                       diagnosis: Diagnosis | None) -> tuple[Plan, CodeResult] | str | None:
        """A plan and its code for slot at[1] of round at[0]; None when the planner has nothing new; the
        reason when an agent's reply was unusable (LLM_FAULTS_PATCH: that slot fails, the round goes on)."""
        rnd = at[0]
        recent, earlier = history, None
        if workflow.patched(COMPACT_HISTORY_PATCH):
            recent, earlier = compact_history(history)
        plan_req = AgentPlanRequest(package=req.package, target=req.target, round=rnd, best=state.best,
                                    best_speedup=state.best_summary.speedup_geomean, history=recent,
                                    earlier=earlier, provider=self._provider(req, PLAN), seed=req.seed,
                                    llm=self._llm(req, rnd), diagnosis=diagnosis, reference_source=req.reference_source,
                                    **_device(state, self._provider(req, PLAN)))
        if req.single_agent:
            self._progress.phase = "single_agent"
            try:
                both = await self._agent(
                    SINGLE_AGENT, SingleAgentRequest(**dict(plan_req), toolchain=req.toolchain), req, at)
            except BadReply as bad:
                return str(bad)
            self._usage.add_calls(both.calls)
            return None if both.plan.exhausted else (both.plan, both.result)
        self._progress.phase = "plan"
        try:
            planned = await self._agent(PLAN, plan_req, req, at)
        except BadReply as bad:
            return str(bad)
        self._usage.add_calls(planned.calls)
        if planned.plan.exhausted:
            return None
        self._progress.phase = "code"
        try:
            coded = await self._agent(
                CODE, AgentCodeRequest(package=req.package, target=req.target, toolchain=req.toolchain,
                                         plan=planned.plan, base=state.best, provider=self._provider(req, CODE),
                                         llm=self._llm(req, rnd), diagnosis=diagnosis,
                                         **_device(state, self._provider(req, CODE)),
                                         reference_source=req.reference_source), req, at)
        except BadReply as bad:
            return str(bad)
        self._usage.add_calls(coded.calls)
        return planned.plan, coded.result

    async def _candidate(self, req: OptimizeRequest, at: tuple[int, int], base: Candidate, plan: Plan,
                         coded: CodeResult, diagnosis: Diagnosis | None) -> tuple[CandidateOutcome, Candidate]:
        """Evaluate one candidate; a compile error gets one repair turn with LLM providers."""
        rnd = at[0]
        cand = coded.candidate
        outcome = await self._evaluate(req, at, cand, plan.description, coded.diff, self._extra_shapes)
        if (outcome.compile is not None and not outcome.compile.ok and req.provider != "offline"
                and CODE.name not in self._fallback):
            self._event(f"round {rnd}: {cand.id} did not compile; one repair turn")
            code_req = AgentCodeRequest(package=req.package, target=req.target, toolchain=req.toolchain, plan=plan,
                                        base=base, provider=req.provider, llm=self._llm(req, rnd), diagnosis=diagnosis)
            try:
                fixed = await self._agent(REPAIR, repair_request(code_req, cand, outcome.compile), req, at)
            except BadReply as bad:
                self._event(f"round {rnd}: {cand.id}: no repair ({bad})")
                return outcome, cand
            self._usage.add_calls(fixed.calls)
            cand = fixed.result.candidate
            outcome = await self._evaluate(req, at, cand, f"{plan.description} (repaired)", fixed.result.diff,
                                           self._extra_shapes)
        return outcome, cand

    def _provider(self, req: OptimizeRequest, defn: ActivityDef) -> str:
        return "offline" if defn.name in self._fallback else req.provider

    def _options(self, defn: ActivityDef, req: OptimizeRequest, at: tuple[int, int]) -> dict:
        """execute_activity's options for `defn`, from the activity table (and the id, ACTIVITY_IDS_PATCH)."""
        opts = defn.options(req.target, req.toolchain, req.gpu_class, req.timeouts, self._patient)
        if self._ids:
            self._calls += 1
            opts["activity_id"] = activity_id(at[0], at[1], defn.name, self._calls)
        return opts

    async def _agent(self, defn: ActivityDef[Any, R], arg, req: OptimizeRequest, at: tuple[int, int]) -> R:
        name = defn.name
        opts = self._options(defn, req, at)
        if req.llm is not None:
            opts["start_to_close_timeout"] = max(opts["start_to_close_timeout"], req.llm.activity_timeout())
        if not self._patient:
            return await defn.execute(arg, **opts)
        # An unavailable endpoint is retried (the patient retry policy, or the server's Retry-After) until the
        # wall-time budget.
        left = None
        if req.budgets.max_wall_time_s is not None and self._started_at is not None:
            left = timedelta(seconds=max(req.budgets.max_wall_time_s - (workflow.now().timestamp() - self._started_at),
                                         1.0))
        who = defn.who
        try:
            out = await defn.execute(arg, schedule_to_close_timeout=left, **opts)
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                self._usage.add_calls(_calls_in(cause))  # what the failed attempts spent, counted once
                if cause.type in BAD_REPLY_TYPES or (cause.type == "InvalidRequest" and name in self._fallback):
                    self._note_bad_reply(name, who)
                    raise BadReply(f"{who}: unusable reply: {cause.message}") from None
                if not cause.non_retryable and cause.type not in STOP_TYPES and left is not None:
                    # Temporal ends an unlimited retry with the last failure when the next attempt would
                    # start after the schedule-to-close deadline: the wall-time budget.
                    raise StopRun(f"wall-time budget reached while waiting for the LLM endpoint ({who}; last "
                                  f"error: {cause.message})", "budget") from None
                raise StopRun(f"{who}: {cause.message}") from None
            if isinstance(cause, TimeoutError) and left is not None:
                last = cause.cause.message if isinstance(cause.cause, ApplicationError) else "no reply"
                raise StopRun(f"wall-time budget reached while waiting for the LLM endpoint ({who}; last error: "
                              f"{last})", "budget") from None
            raise
        self._bad_replies[name] = 0
        return out

    def _note_bad_reply(self, name: str, who: str) -> None:
        self._bad_replies[name] = self._bad_replies.get(name, 0) + 1
        if self._bad_replies[name] >= BAD_REPLIES_BEFORE_FALLBACK and name in OFFLINE_FALLBACK \
                and name not in self._fallback:
            self._fallback.add(name)
            self._event(f"{who}: {self._bad_replies[name]} unusable replies in a row; the offline {who} takes over")

    async def _await_approval(self, candidate_id: str, speedup: float) -> bool:
        self._pending, self._decision = candidate_id, None
        self._progress.phase, self._progress.pending_approval = "awaiting approval", candidate_id
        self._event(f"candidate {candidate_id} ({speedup:.3f}x) waits for approval: kopt approve RUN {candidate_id}")
        await workflow.wait_condition(lambda: self._decision is not None)
        accepted = self._decision.accept
        self._pending, self._progress.pending_approval = None, None
        self._event(f"candidate {candidate_id} {'approved' if accepted else 'rejected'}")
        return accepted

    # ---------------------------------------------------------------------------------- evaluation

    async def _versus_best(self, req: OptimizeRequest, state: RunState, rnd: int, outcome: CandidateOutcome,
                           cand: Candidate) -> ProfileResult | None:  # fmt: skip
        """The round's best timed head to head against the run's best (its library in the baseline's
        place, interleaved A/B on the timed shapes); None where a library is missing."""
        best_library = state.best_outcome.compile.library if state.best_outcome.compile else None
        library = outcome.compile.library if outcome.compile else None
        if best_library is None or library is None:
            return None
        shapes = req.package.spec.shapes[req.target]
        request = ExecRequest(package=req.package, target=req.target, candidate_id=cand.id, library=library,
                              shapes=req.workload or shapes.bench, dtypes=req.package.spec.dtypes,
                              seed=req.seed * 1_000_003 + rnd, source=cand.source, baseline_library=best_library,
                              baseline_id=state.best.id, time_cap_s=req.time_cap_s)  # fmt: skip
        self._progress.phase = "head to head"
        versus = await PROFILE.execute(request, **self._options(PROFILE, req, (rnd, VERSUS_SLOT)))
        self._usage.device_seconds += versus.seconds
        return versus

    async def _evaluate(self, req: OptimizeRequest, at: tuple[int, int], cand: Candidate, description: str,
                        diff: str, extra_shapes: list[Shape]) -> CandidateOutcome:
        rnd = at[0]
        outcome = CandidateOutcome(round=rnd, candidate_id=cand.id, description=description,
                                   tunables=cand.tunables, flags=cand.flags, diff=diff)
        self._progress.phase = "compile"
        compiled = await COMPILE.execute(
            CompileRequest(package=req.package, target=req.target, toolchain=req.toolchain, candidate=cand,
                           describe_toolchain=cand.id == req.baseline.id),
            **self._options(COMPILE, req, at))
        shapes = req.package.spec.shapes[req.target]

        async def run_exec(defn: ActivityDef, shape_list: list[Shape]):
            baseline = self._baseline_library if cand.id != req.baseline.id else None
            request = ExecRequest(package=req.package, target=req.target, candidate_id=cand.id,
                                  library=compiled.library, shapes=shape_list, dtypes=req.package.spec.dtypes,
                                  seed=req.seed * 1_000_003 + rnd, source=cand.source, baseline_library=baseline,
                                  baseline_id=req.baseline.id if baseline else None, time_cap_s=req.time_cap_s,
                                  nsight=defn is PROFILE and req.target == "cuda",
                                  nsight_above=self._progress.best_speedup if baseline else None)
            self._progress.phase = defn.name
            result = await defn.execute(request, **self._options(defn, req, at))
            self._usage.device_seconds += result.seconds
            if getattr(result, "nsight", None) is not None:
                self._usage.nsight_seconds += result.nsight.seconds
            return result

        judged = await judging.judge(compiled, lambda: run_exec(TEST, [*shapes.test, *extra_shapes]),
                                     lambda: run_exec(PROFILE, req.workload or shapes.bench))  # fmt: skip
        outcome.compile, outcome.test, outcome.profile = judged.compiled, judged.tested, judged.profiled
        outcome.correct = judged.tested is not None and judged.tested.correct
        return outcome


def _no_candidate(rnd: int, slot: int, reason: str) -> RoundRecord:
    """The record of a slot whose agent gave no usable reply."""
    return RoundRecord(round=rnd, candidate_id=f"round{rnd}-slot{slot}-no-candidate", description="(no candidate)",
                       tunables={}, flags=[], slot=slot, compiled=False, correct=False, failure=reason,
                       status="no candidate")


def _budget_start(req: OptimizeRequest) -> float:
    """Workflow time the wall-time budget counts from: the command's start where the front end gave it
    (its server and workers' start-up count), never later than now."""
    now = workflow.now().timestamp()
    given = req.budgets.wall_time_from
    return now if given is None else min(now, given)


def _by_slot(records: list[RoundRecord]) -> list[RoundRecord]:
    """Records in (round, slot) order, as asynchronous slots keep them whatever order they finished in."""
    return sorted(records, key=lambda r: (r.round, r.slot))


def _placeholder(rnd: int, slot: int, plan: Plan, coded: CodeResult) -> RoundRecord:
    """The record of a candidate still being judged: the planner counts its configuration as tried."""
    return RoundRecord(round=rnd, candidate_id=coded.candidate.id, description=plan.description,
                       tunables=plan.tunables, flags=plan.flags, slot=slot, compiled=False, correct=False,
                       failure=EVALUATING, status="evaluating")


def _score(state: RunState, outcome: CandidateOutcome, floored: bool) -> list[str]:
    """Fill a measured outcome's per-shape speedups, geomean and interval against the baseline;
    return the (shape, dtype) where it is statistically slower than the baseline."""
    outcome.per_shape = speedups(state.baseline.profile, outcome.profile, floored)
    ab = outcome.profile.ab
    outcome.speedup_geomean = (ab.speedup_geomean if ab and ab.speedup_geomean
                               else geomean([s.speedup for s in outcome.per_shape]))
    if ab and ab.ci_low is not None:
        outcome.speedup_ci = [ab.ci_low, ab.ci_high]
    return [f"{s.shape} {s.dtype}" for s in outcome.per_shape if s.regression()]


def _nsight(outcome: CandidateOutcome):
    return outcome.profile.nsight if outcome.profile is not None else None


def _judging_seconds(outcome: CandidateOutcome) -> float | None:
    """The device seconds a candidate's compile, test and profile took: about what judging one more
    library of its kind costs (the held-out and shape-specialized steps)."""
    steps = [outcome.compile, outcome.test, outcome.profile]
    total = sum(s.seconds for s in steps if s is not None)
    return total or None


def _device(state: RunState, provider: str) -> dict:
    """The machine that timed the baseline and the toolchain that built it, for an LLM agent's request
    (empty before the baseline is timed, and for the offline agent, which reads none of it: each round's
    requests stay in history)."""
    profile = state.baseline.profile if state.baseline is not None else None
    if profile is None or provider == "offline":
        return {}
    built = state.baseline.compile
    return {"device": profile.device, "device_facts": profile.device_facts,
            "toolchain_facts": built.toolchain_facts if built is not None else []}


def _versus_fields(versus: ProfileResult | None) -> dict:
    """A round record's head-to-head figures (the round's best against the best), where measured."""
    if versus is None or versus.ab is None:
        return {}
    ab = versus.ab
    return {"versus_best": ab.speedup_geomean, "versus_best_ci": [ab.ci_low, ab.ci_high]}


def _calls_in(err: ApplicationError) -> list[LLMCall]:
    """The audit records an agent activity's failure carries in its details."""
    calls = []
    for detail in err.details:
        try:
            calls.append(LLMCall.model_validate(detail))
        except Exception:  # noqa: BLE001 - details of another shape
            continue
    return calls


def _judged(outcome: CandidateOutcome) -> tuple[RoundStatus, str | None]:
    """What became of a judged candidate: its status word and, where it failed, the reason
    (workflows/judging.py)."""
    return judging.outcome(outcome.compile, outcome.test, outcome.profile, outcome.speedup_geomean is not None)


def _failure(outcome: CandidateOutcome) -> str | None:
    return _judged(outcome)[1]


def _times(outcome: CandidateOutcome) -> str:
    if not outcome.profile:
        return ""
    return ", ".join(f"{t.shape} {t.dtype} {t.median_us:.1f}us" for t in outcome.profile.timings)
