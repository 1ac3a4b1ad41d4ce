"""A full OptimizeKernel run on the CPU target against a real dev server, every activity on its queue."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.api.enums.v1 import EventType

from frontend.history import load_run
from frontend.runs import prepare_request
from kopt import queues
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO, cpu_cluster

ROUNDS = 3


async def _run(server, settings: Settings):
    # A small package (out = 2 * x, two dtypes): what is tested is the activities, not the kernel;
    # the full run on kernels/silu_and_mul is tests/test_cli.py's.
    req = prepare_request(REPO / "tests" / "fixtures" / "scale2", "cpu", None, ROUNDS, "offline", 7, settings)
    req = req.model_copy(update={"time_cap_s": 0.25})  # what is tested is where activities run, not timing
    async with cpu_cluster(server.address, settings) as client:
        handle = await client.start_workflow(queues.WORKFLOW_NAME, req, id=f"test-{uuid.uuid4()}",
                                             task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)
        result = await handle.result()
        history = await handle.fetch_history()
        view = await load_run(client, handle.id)
    return req, result, history, view


@pytest.mark.slow
def test_optimize_cpu_records_every_activity_on_its_queue(temporal_server, kopt_home):
    settings = Settings()
    req, result, history, view = asyncio.run(_run(temporal_server, settings))

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
    # History alone tells each round's plan, code change, compile, test and profile.
    assert [r.round for r in view.rounds] == list(range(ROUNDS + 1))
    assert [r.candidate_id for r in view.rounds[1:]] == ids
    assert any(r.code.diff for r in view.rounds[1:]), "no round changed the source"
    for r in view.rounds[1:]:
        assert r.plan.round == r.round and r.compile.candidate_id == r.candidate_id
        assert r.code.candidate.source != req.baseline.source or r.code.candidate.flags != req.baseline.flags
    assert view.rounds[0].profile.ok and view.status == "completed"
    for outcome in result.rounds:
        assert outcome.compile_seconds is not None
        if outcome.correct:
            assert outcome.speedup_geomean and outcome.speedup_geomean > 0
            assert {s.dtype for s in outcome.per_shape} == {"float32", "float16"}
    best = result.best
    assert best.correct and best.speedup_geomean >= 1.0
    assert best.candidate_id in {req.baseline.id, *ids}
    if best.candidate_id != req.baseline.id:
        chosen = next(r for r in result.rounds if r.candidate_id == best.candidate_id)
        assert chosen.speedup_geomean == pytest.approx(best.speedup_geomean)
        assert best.speedup_geomean > 1.0 + req.min_gain
