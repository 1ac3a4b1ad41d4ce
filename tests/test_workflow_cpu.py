"""A full OptimizeKernel run on the CPU target against a real dev server, every activity on its queue."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack

import pytest
from temporalio.api.enums.v1 import EventType

from kopt import queues
from kopt.client import connect
from kopt.models import OptimizeResult
from kopt.runs import prepare_request
from kopt.settings import Settings
from kopt.workers import WorkerPlan, make_workers, toolchains_for
from tests.conftest import REPO

ROUNDS = 3


async def _run(server, settings: Settings):
    req = prepare_request(REPO / "kernels" / "silu_and_mul", "cpu", None, ROUNDS, "offline", 7, settings)
    client = await connect(server.address, settings)
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=toolchains_for(["cpu"]),
                      exec_target="cpu")
    async with AsyncExitStack() as stack:
        for worker in make_workers(client, settings, plan):
            await stack.enter_async_context(worker)
        handle = await client.start_workflow(queues.WORKFLOW_NAME, req, id=f"test-{uuid.uuid4()}",
                                             task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)
        result = await handle.result()
        history = await handle.fetch_history()
    return req, result, history


@pytest.mark.slow
def test_optimize_cpu_records_every_activity_on_its_queue(temporal_server, kopt_home):
    settings = Settings()
    req, result, history = asyncio.run(_run(temporal_server, settings))

    scheduled = [
        (e.activity_task_scheduled_event_attributes.activity_type.name,
         e.activity_task_scheduled_event_attributes.task_queue.name)
        for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    expected_queue = {"plan": queues.AGENTS_QUEUE, "code": queues.AGENTS_QUEUE, "compile": "kopt-build-cpu",
                      "test": queues.EXEC_CPU_QUEUE, "profile": queues.EXEC_CPU_QUEUE}
    assert {name for name, _ in scheduled} == set(expected_queue)
    for name, queue in scheduled:
        assert queue == expected_queue[name], (name, queue)
    counts = {name: sum(1 for n, _ in scheduled if n == name) for name in expected_queue}
    assert counts["plan"] == counts["code"] == ROUNDS
    assert counts["compile"] == ROUNDS + 1  # baseline + one candidate per round

    assert result.status == "completed"
    assert result.baseline.correct and result.baseline.profile.ok
    assert len(result.rounds) == ROUNDS
    # Each round's candidate is a real, distinct code change, visible in history.
    ids = [r.candidate_id for r in result.rounds]
    assert len(set(ids)) == ROUNDS and req.baseline.id not in ids
    assert any(r.diff for r in result.rounds), "no round changed the source"
    for outcome in result.rounds:
        assert outcome.compile is not None
        if outcome.correct:
            assert outcome.speedup_geomean and outcome.speedup_geomean > 0
            assert {s.dtype for s in outcome.per_shape} == {"float16", "bfloat16"}
    best = result.best
    assert best.correct and best.speedup_geomean >= 1.0
    assert best.candidate_id in {req.baseline.id, *ids}
    if best.candidate_id != req.baseline.id:
        chosen = next(r for r in result.rounds if r.candidate_id == best.candidate_id)
        assert chosen.speedup_geomean == pytest.approx(best.speedup_geomean)
        assert best.speedup_geomean > 1.0 + req.min_gain
