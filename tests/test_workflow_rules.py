"""OptimizeKernel's decisions with fake activities: the real workflow on the real dev server, every
activity replaced by a scripted one registered under the real name on the real queue (the Temporal
samples' pattern), so a run of several rounds takes seconds and nothing is compiled or timed. The
script gives each round's candidate a speedup, a verdict and per-shape intervals; the test checks
which candidates the workflow accepts (docs/decisions/0033: min-gain, significance, the per-shape
guard, the round's best among several, allowed regressions, approval, the bucket rule of the
shape-specialized step)."""

from __future__ import annotations

import asyncio
import gc
import shutil
import time
import uuid

import pytest
from temporalio import activity
from temporalio.worker import Worker

from frontend.client import connect
from frontend.runs import prepare_request
from kopt import queues
from kopt.activity_table import CODE, COMPILE, PLAN, PROFILE, TEST
from kopt.agent_models import AgentCodeRequest, AgentPlanRequest, CodeOutput, PlanOutput
from kopt.models import (
    ABResult,
    ArtifactRef,
    Candidate,
    CodeResult,
    CompileRequest,
    CompileResult,
    ExecRequest,
    Plan,
    ProfileResult,
    ShapeAB,
    ShapeTiming,
    TestResult,
)
from kopt.run_models import Approval, OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO
from workflows.optimize import OptimizeKernel

LIB = ArtifactRef(sha256="1" * 64, size=1, uri="file:///dev/null")
SHAPES = ("T=1", "T=2")


class Script:
    """What each (round, slot)'s candidate measures: (speedup, verdict, slowest shape's interval) against
    the baseline, and `versus`: (speed over the best's, verdict) head to head against the run's best; by
    default the ratio of the two speedups, "faster" beyond 1 %."""

    def __init__(self, by_slot: dict[tuple[int, int], tuple[float, str, float]],
                 versus: dict[tuple[int, int], tuple[float, str]] | None = None) -> None:  # fmt: skip
        self.by_slot = by_slot
        self.versus = versus or {}
        self.ids: dict[str, tuple[int, int]] = {}
        self.head_to_head: list[tuple[str, str]] = []  # (candidate, best) of each head-to-head profile

    def activities(self) -> dict[str, list]:
        @activity.defn(name=PLAN.name)
        async def plan(req: AgentPlanRequest) -> PlanOutput:
            slot = len([1 for r in req.history if r.round == req.round])
            return PlanOutput(plan=Plan(round=req.round, description=f"r{req.round}s{slot}", rationale="scripted",
                                        tunables={}, flags=[f"-DSLOT{slot}"]), calls=[])  # fmt: skip

        @activity.defn(name=CODE.name)
        async def code(req: AgentCodeRequest) -> CodeOutput:
            slot = int(req.plan.flags[0].removeprefix("-DSLOT"))
            cid = f"cand-r{req.plan.round}-s{slot}"
            self.ids[cid] = (req.plan.round, slot)
            cand = Candidate(id=cid, source=f"// {cid}\n", flags=req.plan.flags, origin=req.plan.description)
            return CodeOutput(result=CodeResult(candidate=cand, diff=""), calls=[])

        @activity.defn(name=COMPILE.name)
        async def compile_(req: CompileRequest) -> CompileResult:
            return CompileResult(candidate_id=req.candidate.id, ok=True, library=LIB, seconds=0.01)

        @activity.defn(name=TEST.name)
        async def test(req: ExecRequest) -> TestResult:
            return TestResult(candidate_id=req.candidate_id, correct=True, seconds=0.01)

        @activity.defn(name=PROFILE.name)
        async def profile(req: ExecRequest) -> ProfileResult:
            timings = [ShapeTiming(shape=s, dtype="float32", median_us=10.0, p10_us=9.0, p90_us=11.0, samples=50,
                                   gbytes_per_s=1.0) for s in SHAPES]  # fmt: skip
            if req.candidate_id not in self.ids:  # the baseline (round 0): no A/B
                return ProfileResult(candidate_id=req.candidate_id, ok=True, timings=timings, seconds=0.01)
            speedup, verdict, worst_high = self.by_slot[self.ids[req.candidate_id]]
            if req.baseline_id in self.ids:  # head to head against the run's best
                self.head_to_head.append((req.candidate_id, req.baseline_id))
                ratio = speedup / self.by_slot[self.ids[req.baseline_id]][0]
                default = (ratio, "faster" if ratio > 1.01 else "slower" if ratio < 0.99 else "same")
                speedup, verdict = self.versus.get(self.ids[req.candidate_id], default)
                worst_high = speedup * 1.01
            per_shape = [ShapeAB(shape=s, dtype="float32", mode="hot-cpu", baseline_us=10.0 * speedup,
                                 candidate_us=10.0, speedup=speedup, ci_low=min(speedup, worst_high) * 0.99,
                                 ci_high=worst_high if i == 0 else speedup * 1.01, baseline_samples=50,
                                 candidate_samples=50) for i, s in enumerate(SHAPES)]  # fmt: skip
            ab = ABResult(per_shape=per_shape, speedup_geomean=speedup, ci_low=speedup * 0.99, ci_high=speedup * 1.01,
                          verdict=verdict, noise_floor=0.01)  # fmt: skip
            return ProfileResult(candidate_id=req.candidate_id, ok=True, timings=timings, ab=ab, seconds=0.01)

        return {"agents": [plan, code], "build": [compile_], "exec": [test, profile]}


async def _run(address: str, home, script: Script, rounds: int, slots: int, during=None, kernel_dir=None,
               **update) -> OptimizeResult:  # fmt: skip
    """One run on fresh workers; `during(handle)` runs beside it (an approver); `update`: request fields."""
    settings = Settings(home=home)
    kernel_dir = kernel_dir or REPO / "tests" / "fixtures" / "repeat"
    req = prepare_request(kernel_dir, "cpu", None, rounds, "offline", 0, settings)
    req = req.model_copy(update={"candidates_per_round": slots, "min_gain": 0.05, "holdout_shapes": [], **update})
    client = await connect(address, settings)
    acts = script.activities()
    workers = [Worker(client, task_queue=queues.WORKFLOW_QUEUE, workflows=[OptimizeKernel]),
               Worker(client, task_queue=queues.AGENTS_QUEUE, activities=acts["agents"]),
               Worker(client, task_queue=queues.build_queue(req.toolchain), activities=acts["build"]),
               Worker(client, task_queue=queues.EXEC_CPU_QUEUE, activities=acts["exec"])]  # fmt: skip
    running = [asyncio.create_task(w.run()) for w in workers]
    try:
        handle = await client.start_workflow(OptimizeKernel.run, req, id=f"rules-{uuid.uuid4()}",
                                             task_queue=queues.WORKFLOW_QUEUE)  # fmt: skip
        beside = asyncio.create_task(during(handle)) if during else None
        result = await asyncio.wait_for(handle.result(), 60)
        if beside is not None:
            await asyncio.wait_for(beside, 10)
        return result
    finally:
        await asyncio.gather(*(w.shutdown() for w in workers))
        await asyncio.gather(*running, return_exceptions=True)


def test_the_workflow_accepts_by_min_gain_significance_and_the_shape_guard(temporal_server, tmp_path):
    script = Script({
        (1, 0): (1.04, "faster", 1.05),  # faster, but by less than min_gain (5 %)
        (2, 0): (1.20, "faster", 1.21),  # the new best
        (3, 0): (1.40, "same", 1.41),  # inside the A/B's noise: not significant
        (4, 0): (1.45, "faster", 0.90),  # faster overall, one shape's whole interval below 1: a regression
        (5, 0): (1.27, "faster", 1.28),  # faster than the best by more than min_gain: the new best
    })  # fmt: skip
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=5, slots=1))
    accepted = {r.round: r.accepted for r in result.rounds}
    assert accepted == {1: False, 2: True, 3: False, 4: False, 5: True}, result.rounds
    assert {r.status for r in result.rounds} == {"measured"}
    assert result.rounds[3].regressions == ["T=1 float32"]
    assert result.best.candidate_id == "cand-r5-s0" and result.best.speedup_geomean == 1.27


def test_a_round_keeps_its_fastest_eligible_candidate(temporal_server, tmp_path):
    script = Script({
        (1, 0): (1.10, "faster", 1.11),
        (1, 1): (1.50, "faster", 0.80),  # the fastest, but slower than the baseline at one shape
        (1, 2): (1.30, "faster", 1.31),  # the fastest eligible: the round's best
    })  # fmt: skip
    # In lockstep (LLM runs always are): the round's candidates judged together, only the fastest compared.
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=1, slots=3, lockstep=True))
    assert [(r.slot, r.accepted) for r in result.rounds] == [(0, False), (1, False), (2, True)], result.rounds
    assert result.best.candidate_id == "cand-r1-s2"


class SlowScript(Script):
    """A Script whose candidates in `slow` take `delay` seconds to profile; every exec call's (candidate,
    start, end) on the clock of this process."""

    def __init__(self, by_slot, slow: set[tuple[int, int]], delay: float) -> None:
        super().__init__(by_slot)
        self.slow, self.delay = slow, delay
        self.spans: dict[str, tuple[float, float]] = {}

    def activities(self) -> dict[str, list]:
        acts = super().activities()
        profile_fn = acts["exec"][1]

        @activity.defn(name=PROFILE.name)
        async def profile(req: ExecRequest) -> ProfileResult:
            start = time.monotonic()
            if self.ids.get(req.candidate_id) in self.slow and req.baseline_id not in self.ids:
                await asyncio.sleep(self.delay)
            out = await profile_fn(req)
            if req.baseline_id not in self.ids:  # not a head-to-head
                self.spans[req.candidate_id] = (start, time.monotonic())
            return out

        return {**acts, "exec": [acts["exec"][0], profile]}


def test_asynchronous_slots_judge_each_candidate_as_it_finishes(temporal_server, tmp_path):
    """Offline, two slots (#28 item 2): round 1's slot 0 is slow. Its slot 1 finishes first and becomes
    the best at once, and its slot takes the next proposals, round 2's, while slot 0 still runs: round 2
    is judged before round 1 ends. Each finished candidate is compared with the best as it is then: one
    not above the best's speedup over the baseline is refused without a head-to-head measurement."""
    script = SlowScript({
        (1, 0): (1.30, "faster", 1.31),  # slow; finishes last: beats the best of then (2/1) head to head
        (1, 1): (1.10, "faster", 1.11),  # the first best (against the baseline)
        (2, 0): (1.05, "faster", 1.06),  # below the best's 1.10: refused, no head to head
        (2, 1): (1.20, "faster", 1.21),  # 1.09x the best's speed head to head: the new best
    }, slow={(1, 0)}, delay=3.0)  # fmt: skip
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=2, slots=2))
    assert [(r.round, r.slot, r.accepted) for r in result.rounds] == [
        (1, 0, True), (1, 1, True), (2, 0, False), (2, 1, True)], result.rounds
    spans = script.spans
    assert spans["cand-r2-s1"][1] < spans["cand-r1-s0"][1], spans  # no barrier at the end of round 1
    assert script.head_to_head == [("cand-r2-s1", "cand-r1-s1"), ("cand-r1-s0", "cand-r2-s1")]
    assert "no head-to-head" in result.rounds[2].refusal, result.rounds[2]
    assert result.best.candidate_id == "cand-r1-s0" and result.best.round == 1


def test_asynchronous_slots_continue_as_new_on_a_round_boundary(temporal_server, tmp_path):
    script = Script({(r, s): (1.0 + r / 10 + s / 100, "faster", 1.5) for r in (1, 2, 3) for s in (0, 1)})
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=3, slots=2,
                              continue_every=1))  # fmt: skip
    assert [(r.round, r.slot) for r in result.rounds] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert result.segments == 3 and result.stop_reason is None  # a segment a round
    assert result.best.round == 3 and sum(r.accepted for r in result.rounds if r.round == 3) == 1, result.rounds


def test_allowed_regressions_let_a_candidate_slower_at_one_shape_become_the_best(temporal_server, tmp_path):
    script = Script({
        (1, 0): (1.20, "faster", 1.21),
        (2, 0): (1.45, "faster", 0.90),  # faster overall, slower than the baseline at one shape
    })  # fmt: skip
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=2, slots=1,
                              allow_regressions=True))  # fmt: skip
    assert [(r.round, r.accepted) for r in result.rounds] == [(1, True), (2, True)], result.rounds
    assert result.rounds[1].regressions == ["T=1 float32"]  # accepted, and the regression still on record
    assert result.best.candidate_id == "cand-r2-s0"


def test_a_new_best_waits_for_approval_and_a_rejected_one_is_not_taken(temporal_server, tmp_path):
    script = Script({
        (1, 0): (1.20, "faster", 1.21),  # approved: the new best
        (2, 0): (1.40, "faster", 1.41),  # would be the new best; rejected
        (3, 0): (1.02, "faster", 1.03),  # below min-gain: never asked about
    })  # fmt: skip
    asked: list[str] = []
    refused: list[str] = []

    async def approver(handle) -> None:
        while len(asked) < 2:
            progress = await handle.query(OptimizeKernel.progress)
            pending = progress.pending_approval
            if pending is None or pending in asked:
                await asyncio.sleep(0.05)
                continue
            try:  # an approval for a candidate that is not waiting is refused by the validator
                await handle.execute_update(OptimizeKernel.approve, Approval(candidate_id="cand-nope"))
            except Exception as exc:  # noqa: BLE001 - WorkflowUpdateFailedError carrying the validator's message
                refused.append(str(getattr(exc, "cause", None) or exc))
            asked.append(pending)
            await handle.execute_update(OptimizeKernel.approve, Approval(candidate_id=pending, accept=len(asked) == 1))

    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=3, slots=1,
                              during=approver, approve=True))  # fmt: skip
    assert asked == ["cand-r1-s0", "cand-r2-s0"]
    assert len(refused) == 2 and all("unknown candidate id 'cand-nope'" in r for r in refused), refused
    assert [(r.round, r.accepted) for r in result.rounds] == [(1, True), (2, False), (3, False)], result.rounds
    assert result.best.candidate_id == "cand-r1-s0"


class BucketScript(Script):
    """Candidates with tunables and per-shape speedups at the bench shapes N=64 and N=4096 of a package
    with [dispatch.cpu] on N (edge 100), and what the shape-specialized library then measures."""

    def __init__(self, by_round: dict[int, tuple[int, dict[str, float]]], specialized: dict[str, float]) -> None:
        super().__init__({})
        self.by_round, self.specialized = by_round, specialized
        self.source = (REPO / "tests" / "fixtures" / "repeat" / "kernel.cpp").read_text()

    def activities(self) -> dict[str, list]:
        acts = super().activities()

        @activity.defn(name=PLAN.name)
        async def plan(req: AgentPlanRequest) -> PlanOutput:
            value = self.by_round[req.round][0]
            return PlanOutput(plan=Plan(round=req.round, description=f"REPEAT {value}", rationale="scripted",
                                        tunables={"REPEAT": value}, flags=["-DSLOT0"]), calls=[])  # fmt: skip

        @activity.defn(name=CODE.name)
        async def code(req: AgentCodeRequest) -> CodeOutput:
            cid = f"cand-r{req.plan.round}"
            self.ids[cid] = (req.plan.round, 0)
            value = req.plan.tunables["REPEAT"]
            cand = Candidate(id=cid, source=self.source.replace("#define REPEAT 16", f"#define REPEAT {value}"),
                             flags=req.plan.flags, tunables=dict(req.plan.tunables), origin=req.plan.description)
            return CodeOutput(result=CodeResult(candidate=cand, diff=""), calls=[])

        @activity.defn(name=COMPILE.name)
        async def compile_(req: CompileRequest) -> CompileResult:
            if req.candidate.origin == "shape-specialized":
                self.ids[req.candidate.id] = (-2, 0)
            return CompileResult(candidate_id=req.candidate.id, ok=True, library=LIB, seconds=0.01)

        @activity.defn(name=PROFILE.name)
        async def profile(req: ExecRequest) -> ProfileResult:
            timings = [ShapeTiming(shape=s.label, dtype="float32", median_us=10.0, p10_us=9.0, p90_us=11.0,
                                   samples=50, gbytes_per_s=1.0) for s in req.shapes]  # fmt: skip
            at = self.ids.get(req.candidate_id)
            if at is None:  # the baseline
                return ProfileResult(candidate_id=req.candidate_id, ok=True, timings=timings, seconds=0.01)
            by_shape = self.specialized if at[0] == -2 else self.by_round[at[0]][1]
            best = self.ids.get(req.baseline_id)
            if best is not None:  # head to head against the run's best: the ratio of the two, shape by shape
                best_shape = self.by_round[best[0]][1]
                by_shape = {s: v / best_shape[s] for s, v in by_shape.items()}
            per_shape = [ShapeAB(shape=s.label, dtype="float32", mode="hot-cpu", baseline_us=10.0 * by_shape[s.label],
                                 candidate_us=10.0, speedup=by_shape[s.label], ci_low=by_shape[s.label] * 0.99,
                                 ci_high=by_shape[s.label] * 1.01, baseline_samples=50, candidate_samples=50)
                         for s in req.shapes]  # fmt: skip
            g = (by_shape["N=64"] * by_shape["N=4096"]) ** 0.5
            ab = ABResult(per_shape=per_shape, speedup_geomean=g, ci_low=g * 0.99, ci_high=g * 1.01, verdict="faster",
                          noise_floor=0.01)  # fmt: skip
            return ProfileResult(candidate_id=req.candidate_id, ok=True, timings=timings, ab=ab, seconds=0.01)

        return {"agents": [plan, code], "build": [compile_], "exec": [acts["exec"][0], profile]}


def _bucketed_package(tmp_path):
    pkg = tmp_path / "bucketed"
    shutil.copytree(REPO / "tests" / "fixtures" / "repeat", pkg)
    toml = (pkg / "kernel.toml").read_text()
    toml = toml.replace('bench = [{ N = 4096 }]', 'bench = [{ N = 64 }, { N = 4096 }]', 1)
    assert 'bench = [{ N = 64 }, { N = 4096 }]' in toml
    (pkg / "kernel.toml").write_text(toml + '\n[dispatch.cpu]\nsymbol = "N"\nedges = [100]\n')
    return pkg


def test_the_shape_specialized_step_keeps_a_one_bucket_gain_and_refuses_a_bucket_loss(temporal_server, tmp_path):
    rounds = {
        1: (8, {"N=64": 1.30, "N=4096": 1.00}),  # the best: 1.140x
        2: (4, {"N=64": 1.00, "N=4096": 1.25}),  # 1.118x: not 5 % above the best, but the fastest at N=4096
    }
    pkg = _bucketed_package(tmp_path)
    outcomes = {}
    for name, specialized in (
        ("one bucket gains", {"N=64": 1.30, "N=4096": 1.06}),  # 1.174x overall (+3 %): bucket N > 100 +6 %
        ("one bucket loses", {"N=64": 1.22, "N=4096": 1.12}),  # 1.169x overall (+2.5 %): bucket N <= 100 -6 %
    ):
        script = BucketScript(rounds, specialized)
        outcomes[name] = asyncio.run(_run(temporal_server.address, tmp_path / name, script, rounds=2, slots=1,
                                          kernel_dir=pkg))  # fmt: skip
    gained, lost = outcomes["one bucket gains"], outcomes["one bucket loses"]
    for result in (gained, lost):
        assert [(r.round, r.accepted) for r in result.rounds] == [(1, True), (2, False)], result.rounds
        assert result.specialized is not None and result.specialized.picked_from == ["cand-r1", "cand-r2"]
        assert result.specialized.settings == [{"REPEAT": 8}, {"REPEAT": 4}]
    assert gained.specialized.accepted and gained.specialized.bucket_gains == [1.0, 1.06], gained.specialized
    assert gained.best.candidate_id == gained.specialized.candidate_id
    assert not lost.specialized.accepted and "in every bucket" in lost.specialized.reason, lost.specialized
    assert lost.best.candidate_id == "cand-r1"


def test_a_new_best_beats_the_best_head_to_head_whatever_its_ratio_to_a_drifting_baseline(temporal_server,
                                                                                        tmp_path):
    """Each candidate's speedup is measured against a fresh baseline at another time; on a loaded machine
    the baseline moved by a third between measurements (issue #27). A best that is not the baseline is
    replaced only by a candidate faster than it in one interleaved A/B, min-gain judged on that ratio:
    round 2's ratio to the baseline is lower than the best's, yet it beats the best head to head and is
    taken; round 3's ratio is far higher, yet head to head it is slower, and it is refused; round 4 is
    faster head to head, but by less than min-gain."""
    script = Script({
        (1, 0): (1.20, "faster", 1.21),  # the first best: judged against the baseline, no head to head
        (2, 0): (1.15, "faster", 1.16),  # a slower baseline measurement, ...
        (3, 0): (1.40, "faster", 1.41),  # a faster one, ...
        (4, 0): (1.30, "faster", 1.31),
    }, versus={(2, 0): (1.10, "faster"), (3, 0): (0.97, "slower"), (4, 0): (1.03, "faster")})  # fmt: skip
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=4, slots=1))
    assert [(r.round, r.accepted) for r in result.rounds] == [(1, True), (2, True), (3, False), (4, False)]
    assert script.head_to_head == [("cand-r2-s0", "cand-r1-s0"), ("cand-r3-s0", "cand-r2-s0"),
                                   ("cand-r4-s0", "cand-r2-s0")]  # fmt: skip
    versus = {r.round: r.versus_best for r in result.rounds}
    assert versus == {1: None, 2: 1.10, 3: 0.97, 4: 1.03}
    assert result.best.candidate_id == "cand-r2-s0" and result.best.speedup_geomean == 1.15  # the figure users read


def test_a_run_stopped_by_a_budget_skips_the_held_out_step_with_a_note(temporal_server, tmp_path):
    """A run stopped by its wall-time budget went on to judge the best on the held-out shapes and ran
    past the budget (issue #28: still running at 176 s of 140). The held-out step is skipped, as the
    shape-specialized one was, and says why; nothing more is timed."""
    from kopt.models import Shape
    from kopt.run_models import Budgets

    script = Script({(1, 0): (1.20, "faster", 1.21)})
    calls = []
    acts = script.activities()
    test_fn, profile_fn = acts["exec"]

    @activity.defn(name=PROFILE.name)
    async def counted_profile(req: ExecRequest) -> ProfileResult:
        calls.append([s.label for s in req.shapes])
        return await profile_fn(req)

    script.activities = lambda: {**acts, "exec": [test_fn, counted_profile]}
    held = [Shape(dims={"N": 77})]
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=3, slots=1,
                              holdout_shapes=held, budgets=Budgets(max_gpu_seconds=0.015)))  # fmt: skip
    assert result.stop_reason.startswith("device-time budget reached") and result.rounds == []
    assert result.holdout is not None and result.holdout.reason == f"skipped: {result.stop_reason}"
    assert ["N=77"] not in calls and len(calls) == 1  # the baseline's profile only


@pytest.mark.parametrize("slots", [1, 2])
def test_a_wall_time_budget_is_not_overrun_by_a_round_begun_near_its_end(temporal_server, tmp_path, slots):
    """#28 item 3: a run stopped only once its wall time was spent, so the round begun just before ran past
    the budget (and the held-out step after it). A round now starts only where the budget has room for it
    (as long as the last round took), and the steps after the search likewise. With two asynchronous
    slots, likewise each candidate (as long as the last candidate took)."""
    import time

    from kopt.models import Shape
    from kopt.run_models import Budgets

    script = Script({(r, s): (1.0, "same", 1.01) for r in range(1, 10) for s in (0, 1)})  # nothing accepted
    acts = script.activities()
    test_fn, profile_fn = acts["exec"]

    @activity.defn(name=PROFILE.name)
    async def slow_profile(req: ExecRequest) -> ProfileResult:
        await asyncio.sleep(3.0)
        return await profile_fn(req)

    script.activities = lambda: {**acts, "exec": [test_fn, slow_profile]}
    # About 3.5 rounds of 3.2 s (the baseline's included): a round takes 3.1 to 3.9 s on a loaded machine,
    # and the budget stays between two rounds' ends (with 1.5-s rounds and 6 s, 2.0-s rounds under load
    # put it on one: the last round's estimate fitted exactly and it ended at the budget).
    budget = 12.0
    start = time.monotonic()
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=9, slots=slots,
                              holdout_shapes=[Shape(dims={"N": 77})], budgets=Budgets(max_wall_time_s=budget)))
    took = time.monotonic() - start  # the run, and the start and stop of its workers (about a second)
    # Under load the last estimate can fit exactly and the budget be reached as a round or candidate ends
    # (CI, 2026-11-27: "wall-time budget reached (12 s >= 12.0 s)"): within the budget too, which the bound on
    # `took` below checks; otherwise the next round (or proposal) is refused before it begins.
    predicted = result.stop_reason.startswith("wall-time budget: round ")
    assert predicted or result.stop_reason.startswith("wall-time budget reached"), result.stop_reason
    if predicted:
        assert "would end past it" in result.stop_reason
    if slots == 1:
        assert not predicted or result.stop_reason.startswith(f"wall-time budget: round {len(result.rounds) + 1} (~")
        assert 1 <= len(result.rounds) <= 3
    else:  # the next proposal (round r, slot s) is refused; two candidates judged at a time
        assert 2 <= len(result.rounds) <= 6
    assert result.holdout is not None and result.holdout.reason == f"skipped: {result.stop_reason}"
    assert took < budget * 1.05 + 1.5, took  # before: a round and the held-out step past it (>= 9 s)
    print(f"budget {budget} s: {len(result.rounds)} rounds, {took:.1f} s with the workers' start and stop")


@pytest.mark.parametrize("lockstep, earlier", [(False, 0.0), (True, 0.0), (False, 3.0)],
                         ids=["slots", "lockstep", "slots-counted-from-the-command"])
def test_the_candidates_running_when_the_wall_time_budget_runs_out_are_cancelled(temporal_server, tmp_path,
                                                                                  lockstep, earlier, capfd, caplog):
    """On an H100 a 140-s budget ended at 186 s: the first candidates began with no estimate of their time
    and ran on past it. In asynchronous slots a timer wakes the workflow at the budget; the candidates still
    running are cancelled (their activities see it at their next heartbeat), recorded as cancelled, and
    the run ends there, the held-out step skipped. Rounds in lockstep (LLM runs) likewise. `earlier`: the
    budget counts from a moment before the workflow's start (Budgets.wall_time_from: the command's start,
    so that `kopt optimize --max-wall-time S` ends within S), and the workflow runs that much less."""
    from kopt.models import Shape
    from kopt.run_models import Budgets

    script = Script({(r, s): (1.2, "faster", 1.21) for r in (1, 2) for s in (0, 1)})
    acts = script.activities()
    test_fn, profile_fn = acts["exec"]
    cancelled: list[str] = []

    @activity.defn(name=PROFILE.name)
    async def endless_profile(req: ExecRequest) -> ProfileResult:
        if req.candidate_id in script.ids:  # a candidate (not the baseline): far longer than the budget
            try:
                for _ in range(600):
                    activity.heartbeat()
                    await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                cancelled.append(req.candidate_id)
                raise
        return await profile_fn(req)

    script.activities = lambda: {**acts, "exec": [test_fn, endless_profile]}
    budget = 6.0
    ids: list[str] = []

    async def note_id(handle) -> None:
        ids.append(handle.id)

    start = time.monotonic()
    budgets = Budgets(max_wall_time_s=budget, wall_time_from=time.time() - earlier if earlier else None)
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=2, slots=2,
                              holdout_shapes=[Shape(dims={"N": 77})], budgets=budgets,
                              lockstep=lockstep, during=note_id))  # fmt: skip
    took = time.monotonic() - start
    gc.collect()  # a task whose exception nobody read says so when it is collected
    # On an H100 each cancelled candidate left "Task exception was never retrieved" and its traceback on
    # stderr: the cancellation is expected, and read.
    assert "never retrieved" not in capfd.readouterr().err + caplog.text
    assert result.stop_reason.startswith("wall-time budget reached"), result.stop_reason
    assert [(r.round, r.slot, r.status) for r in result.rounds] == [(1, 0, "cancelled"), (1, 1, "cancelled")]
    assert all(r.failure == f"cancelled: {result.stop_reason}" for r in result.rounds)
    assert sorted(cancelled) == ["cand-r1-s0", "cand-r1-s1"]  # each activity was told, not abandoned
    assert result.holdout is not None and result.holdout.reason.startswith("skipped: wall-time budget")
    assert result.best.candidate_id == result.baseline.candidate_id
    # The workflow's own time, from its start to its close (the test's also counts the workers' start and
    # stop, seconds on a loaded machine): the budget, a timer's latency and the cancellation.
    async def lifetime() -> float:
        client = await connect(temporal_server.address, Settings(home=tmp_path / "home"))
        desc = await client.get_workflow_handle(ids[0]).describe()
        return (desc.close_time - desc.start_time).total_seconds()

    ran = asyncio.run(lifetime())
    # A 6-s budget: timer and task latency are not 5 % of it. The workers' start before the workflow's
    # counts where the budget counts from before it (`earlier`).
    assert budget - earlier - 1.5 < ran < (budget - earlier) * 1.05 + 1.5, (ran, took)
    print(f"budget {budget} s: the workflow ran {ran:.2f} s, {took:.2f} s with the workers' start and stop")
    # The report lists them as cancelled.
    from frontend.report import build_report, render_markdown

    req = prepare_request(REPO / "tests" / "fixtures" / "repeat", "cpu", None, 2, "offline", 0,
                          Settings(home=tmp_path / "home"))  # fmt: skip
    markdown = render_markdown(build_report("run", "temporal-run", req, result, None), "kernel.cpp")
    assert markdown.count("cancelled: wall-time budget reached") >= 2, markdown
    # `kopt history` reads them back from workflow history: each slot's compile and test, its cancelled profile.
    from frontend.history import load_run
    from frontend.inspect import history_text

    async def read_back():
        return await load_run(await connect(temporal_server.address, Settings(home=tmp_path / "home")), ids[0])

    view = asyncio.run(read_back())
    assert [(v.round, v.candidate_id) for v in view.rounds[1:]] == [(1, "cand-r1-s0"), (1, "cand-r1-s1")]
    assert all(v.test is not None and v.test.correct and v.profile is None for v in view.rounds[1:])
    text = history_text(view)
    assert "cand-r1-s0" in text and "cand-r1-s1" in text, text
