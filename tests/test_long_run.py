"""A 200-round offline run on the CPU target: continue-as-new keeps every history segment small, and
each round adds about as much history late in the run as early (plan requests carry a bounded view
of the earlier rounds: kopt.plan_history)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid

import pytest
from google.protobuf.json_format import MessageToJson
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from frontend.history import activity_calls, segments
from frontend.runs import prepare_request
from kopt import queues
from kopt.plan_history import PLAN_WINDOW, config_key
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO, cpu_cluster
from workflows.optimize import OptimizeKernel

ROUNDS = 200
SEGMENT_LIMIT = 10 * 1024 * 1024
# History (JSON) one round adds. When every plan request carried every earlier record, a round
# added about 40 KiB at the start of this run and 160 KiB by round 200 (~650 bytes more per round).
# Now the plan request's window fills in the first PLAN_WINDOW rounds; after that only the digest
# grows, by one short entry per configuration tried (~60 bytes of JSON per round here). A round whose
# best is timed head to head against the run's best (docs/decisions/0037) carries one more profile
# activity: about 90 KiB a round here, up from about 75. Measured 2026-11-27: 58 KiB at round 2, 92 KiB
# at round 49 and 100 KiB at round 199 (the plan request 37 KiB of it: the window of records, the
# agents' context and the digest; the test result 15 KiB); one of three runs reached 103.7 KiB.
ROUND_LIMIT = 120 * 1024
GROWTH_PER_ROUND_LIMIT = 150  # bytes, once the window is full


def round_bytes(history: WorkflowHistory) -> dict[int, int]:
    """JSON bytes of a segment's events by round, from each round's plan activity to the next one's
    (round 0: what comes before the first plan; a segment's last round includes its end event)."""
    sizes: dict[int, int] = {}
    rnd = 0
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            a = e.activity_task_scheduled_event_attributes
            if a.activity_type.name == "plan":
                rnd = json.loads(a.input.payloads[0].data)["round"]
        sizes[rnd] = sizes.get(rnd, 0) + len(MessageToJson(e))
    return sizes


async def _run(server, home):
    settings = Settings(home=home)
    req = prepare_request(REPO / "tests" / "fixtures" / "knobs", "cpu", None, ROUNDS, "offline", 0, settings)
    # Timing precision is not what this test is about: a short sampling cap (the default is 2 s a
    # shape) takes the run from ~520 s to about a third of that.
    req = req.model_copy(update={"continue_every": 50, "time_cap_s": 0.05})
    async with cpu_cluster(server.address, settings) as client:
        wf_id = f"long-{uuid.uuid4()}"
        start = time.monotonic()
        result = await client.execute_workflow(queues.WORKFLOW_NAME, req, id=wf_id, task_queue=queues.WORKFLOW_QUEUE,
                                               result_type=OptimizeResult)
        elapsed = time.monotonic() - start
        return result, await segments(client, wf_id), elapsed


@pytest.mark.slow
def test_two_hundred_rounds_in_small_segments(temporal_server, tmp_path):
    result, histories, elapsed = asyncio.run(_run(temporal_server, tmp_path / "home"))
    sizes = [len(h.to_json()) for h in histories]
    per_round: dict[int, int] = {}
    for h in histories:
        inner = round_bytes(h)
        last = max(inner)
        per_round.update({r: n for r, n in inner.items() if 0 < r < last})  # not a segment's start or end
    first, last = min(per_round), max(per_round)
    full = min(r for r in per_round if r > PLAN_WINDOW)  # the first round after the window filled
    # Growth per round: the least-squares slope over every round after the window filled (two single
    # rounds would also measure whatever one of them happened to carry, a retried activity say).
    xs = [r for r in per_round if r >= full]
    mx, my = statistics.fmean(xs), statistics.fmean(per_round[r] for r in xs)
    growth = sum((r - mx) * (per_round[r] - my) for r in xs) / sum((r - mx) ** 2 for r in xs)
    print(f"\n{ROUNDS} rounds in {elapsed:.0f} s; {len(sizes)} segments of {[s // 1024 for s in sizes]} KiB; "
          f"history added by round {first}: {per_round[first] / 1024:.1f} KiB, round {full}: "
          f"{per_round[full] / 1024:.1f} KiB, round {last}: {per_round[last] / 1024:.1f} KiB "
          f"(+{growth:.0f} bytes per round)")
    assert result.status == "completed" and result.stop_reason is None
    assert [r.round for r in result.rounds] == list(range(1, ROUNDS + 1))
    assert len({r.candidate_id for r in result.rounds}) == ROUNDS
    assert len({config_key(r.tunables, r.flags) for r in result.rounds}) == ROUNDS  # no configuration repeated
    assert result.segments == len(sizes) >= ROUNDS // 50  # every 50 rounds, or sooner when the server suggests
    assert max(sizes) < SEGMENT_LIMIT
    assert max(per_round) > ROUNDS - 20  # measured late in the run
    assert max(per_round.values()) < ROUND_LIMIT
    assert growth < GROWTH_PER_ROUND_LIMIT
    # The last plan request: the window in full, every older record in the digest; the run recorded the
    # patch marker, and every segment replays against the current code.
    last_plan = [c.input for c in activity_calls(histories[-1]) if c.activity == "plan"][-1]
    assert [r.round for r in last_plan.history] == list(range(ROUNDS - PLAN_WINDOW, ROUNDS))
    assert last_plan.earlier.records == len(last_plan.earlier.tried) == ROUNDS - 1 - PLAN_WINDOW
    assert any(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED for e in histories[-1].events)
    replayer = Replayer(workflows=[OptimizeKernel], data_converter=pydantic_data_converter)
    for h in histories:
        replayed = asyncio.run(replayer.replay_workflow(h, raise_on_replay_failure=False))
        assert replayed.replay_failure is None, replayed.replay_failure
