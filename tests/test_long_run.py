"""A 200-round offline run on the CPU target: continue-as-new keeps every history segment small."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from kopt import queues
from kopt.client import connect
from kopt.history import segments
from kopt.run_models import OptimizeResult
from kopt.runs import prepare_request
from kopt.settings import Settings
from kopt.workers import WorkerPlan, make_workers, toolchains_for
from tests.conftest import REPO

ROUNDS = 200
SEGMENT_LIMIT = 10 * 1024 * 1024


async def _run(server, home):
    settings = Settings(home=home)
    req = prepare_request(REPO / "tests" / "fixtures" / "knobs", "cpu", None, ROUNDS, "offline", 0, settings)
    req = req.model_copy(update={"continue_every": 50})
    client = await connect(server.address, settings)
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=toolchains_for(["cpu"]),
                      exec_target="cpu")
    workers = make_workers(client, settings, plan)
    for w in workers:
        await w.__aenter__()
    try:
        wf_id = f"long-{uuid.uuid4()}"
        start = time.monotonic()
        result = await client.execute_workflow(queues.WORKFLOW_NAME, req, id=wf_id, task_queue=queues.WORKFLOW_QUEUE,
                                               result_type=OptimizeResult)
        elapsed = time.monotonic() - start
        sizes = [len(h.to_json()) for h in await segments(client, wf_id)]
        return result, sizes, elapsed
    finally:
        for w in workers:
            await w.__aexit__(None, None, None)


@pytest.mark.slow
def test_two_hundred_rounds_in_small_segments(temporal_server, tmp_path):
    result, sizes, elapsed = asyncio.run(_run(temporal_server, tmp_path / "home"))
    print(f"\n{ROUNDS} rounds in {elapsed:.0f} s; {len(sizes)} segments of {[s // 1024 for s in sizes]} KiB")
    assert result.status == "completed" and result.stop_reason is None
    assert [r.round for r in result.rounds] == list(range(1, ROUNDS + 1))
    assert len({r.candidate_id for r in result.rounds}) == ROUNDS
    assert result.segments == len(sizes) >= ROUNDS // 50  # every 50 rounds, or sooner when the server suggests
    assert max(sizes) < SEGMENT_LIMIT
