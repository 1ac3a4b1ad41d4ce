"""OptimizeKernel's decisions with fake activities: the real workflow on the real dev server, every
activity replaced by a scripted one registered under the real name on the real queue (the Temporal
samples' pattern), so a run of several rounds takes seconds and nothing is compiled or timed. The
script gives each round's candidate a speedup, a verdict and per-shape intervals; the test checks
which candidates the workflow accepts (docs/decisions/0033: min-gain, significance, the per-shape
guard, the round's best among several)."""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.worker import Worker

from frontend.client import connect
from frontend.runs import prepare_request
from kopt import queues
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
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO
from workflows.optimize import OptimizeKernel

LIB = ArtifactRef(sha256="1" * 64, size=1, uri="file:///dev/null")
SHAPES = ("T=1", "T=2")


class Script:
    """What each (round, slot)'s candidate measures: (speedup, verdict, slowest shape's interval)."""

    def __init__(self, by_slot: dict[tuple[int, int], tuple[float, str, float]]) -> None:
        self.by_slot = by_slot
        self.ids: dict[str, tuple[int, int]] = {}

    def activities(self) -> dict[str, list]:
        @activity.defn(name="plan")
        async def plan(req: AgentPlanRequest) -> PlanOutput:
            slot = len([1 for r in req.history if r.round == req.round])
            return PlanOutput(plan=Plan(round=req.round, description=f"r{req.round}s{slot}", rationale="scripted",
                                        tunables={}, flags=[f"-DSLOT{slot}"]), calls=[])  # fmt: skip

        @activity.defn(name="code")
        async def code(req: AgentCodeRequest) -> CodeOutput:
            slot = int(req.plan.flags[0].removeprefix("-DSLOT"))
            cid = f"cand-r{req.plan.round}-s{slot}"
            self.ids[cid] = (req.plan.round, slot)
            cand = Candidate(id=cid, source=f"// {cid}\n", flags=req.plan.flags, origin=req.plan.description)
            return CodeOutput(result=CodeResult(candidate=cand, diff=""), calls=[])

        @activity.defn(name="compile")
        async def compile_(req: CompileRequest) -> CompileResult:
            return CompileResult(candidate_id=req.candidate.id, ok=True, library=LIB, seconds=0.01)

        @activity.defn(name="test")
        async def test(req: ExecRequest) -> TestResult:
            return TestResult(candidate_id=req.candidate_id, correct=True, seconds=0.01)

        @activity.defn(name="profile")
        async def profile(req: ExecRequest) -> ProfileResult:
            timings = [ShapeTiming(shape=s, dtype="float32", median_us=10.0, p10_us=9.0, p90_us=11.0, samples=50,
                                   gbytes_per_s=1.0) for s in SHAPES]  # fmt: skip
            if req.candidate_id not in self.ids:  # the baseline (round 0): no A/B
                return ProfileResult(candidate_id=req.candidate_id, ok=True, timings=timings, seconds=0.01)
            speedup, verdict, worst_high = self.by_slot[self.ids[req.candidate_id]]
            per_shape = [ShapeAB(shape=s, dtype="float32", mode="hot-cpu", baseline_us=10.0 * speedup,
                                 candidate_us=10.0, speedup=speedup, ci_low=min(speedup, worst_high) * 0.99,
                                 ci_high=worst_high if i == 0 else speedup * 1.01, baseline_samples=50,
                                 candidate_samples=50) for i, s in enumerate(SHAPES)]  # fmt: skip
            ab = ABResult(per_shape=per_shape, speedup_geomean=speedup, ci_low=speedup * 0.99, ci_high=speedup * 1.01,
                          verdict=verdict, noise_floor=0.01)  # fmt: skip
            return ProfileResult(candidate_id=req.candidate_id, ok=True, timings=timings, ab=ab, seconds=0.01)

        return {"agents": [plan, code], "build": [compile_], "exec": [test, profile]}


async def _run(address: str, home, script: Script, rounds: int, slots: int) -> OptimizeResult:
    settings = Settings(home=home)
    req = prepare_request(REPO / "tests" / "fixtures" / "repeat", "cpu", None, rounds, "offline", 0, settings)
    req = req.model_copy(update={"candidates_per_round": slots, "min_gain": 0.05, "holdout_shapes": []})
    client = await connect(address, settings)
    acts = script.activities()
    workers = [Worker(client, task_queue=queues.WORKFLOW_QUEUE, workflows=[OptimizeKernel]),
               Worker(client, task_queue=queues.AGENTS_QUEUE, activities=acts["agents"]),
               Worker(client, task_queue=queues.build_queue(req.toolchain), activities=acts["build"]),
               Worker(client, task_queue=queues.EXEC_CPU_QUEUE, activities=acts["exec"])]  # fmt: skip
    running = [asyncio.create_task(w.run()) for w in workers]
    try:
        return await client.execute_workflow(OptimizeKernel.run, req, id=f"rules-{uuid.uuid4()}",
                                             task_queue=queues.WORKFLOW_QUEUE)  # fmt: skip
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
    assert result.rounds[3].regressions == ["T=1 float32"]
    assert result.best.candidate_id == "cand-r5-s0" and result.best.speedup_geomean == 1.27


def test_a_round_keeps_its_fastest_eligible_candidate(temporal_server, tmp_path):
    script = Script({
        (1, 0): (1.10, "faster", 1.11),
        (1, 1): (1.50, "faster", 0.80),  # the fastest, but slower than the baseline at one shape
        (1, 2): (1.30, "faster", 1.31),  # the fastest eligible: the round's best
    })  # fmt: skip
    result = asyncio.run(_run(temporal_server.address, tmp_path / "home", script, rounds=1, slots=3))
    assert [(r.slot, r.accepted) for r in result.rounds] == [(0, False), (1, False), (2, True)], result.rounds
    assert result.best.candidate_id == "cand-r1-s2"
