"""Fault injection: SIGKILL every part of a running cluster, repeatedly, during a multi-round run.

The run must finish with the same best candidate as an undisturbed run of the same request, with
no round lost or recorded twice, and every kernel evaluation executed at most once per recorded
activity attempt (results are cached by content, so a retry after a crash does not run it again).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus

from kopt import queues
from kopt.client import connect
from kopt.history import load_run
from kopt.run_models import ActivityTimeouts, OptimizeResult
from kopt.runs import prepare_request
from kopt.settings import Settings
from kopt.workers import WorkerPlan, make_workers, toolchains_for
from tests.cluster import Cluster
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "repeat"
ROUNDS = 10
MIN_KILLS = 20
VICTIMS = ["workflows", "agents", "build", "exec", "server"]
# Short heartbeats: a killed worker's activity is retried after seconds, not minutes.
TIMEOUTS = ActivityTimeouts(agent_s=60, agent_heartbeat_s=3, compile_s=120, compile_heartbeat_s=3,
                            exec_s=300, exec_heartbeat_s=6)


def _request(home, seed=3):
    settings = Settings(home=home)
    req = prepare_request(FIXTURE, "cpu", None, ROUNDS, "offline", seed, settings)
    return req.model_copy(update={"min_gain": 0.1, "continue_every": 4, "timeouts": TIMEOUTS})


async def _undisturbed(server, home):
    settings = Settings(home=home)
    req = _request(home)
    client = await connect(server.address, settings)
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=toolchains_for(["cpu"]),
                      exec_target="cpu")
    workers = make_workers(client, settings, plan)
    for w in workers:
        await w.__aenter__()
    try:
        start = time.monotonic()
        result = await client.execute_workflow(queues.WORKFLOW_NAME, req, id=f"calm-{uuid.uuid4()}",
                                               task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)
        return result, time.monotonic() - start
    finally:
        for w in workers:
            await w.__aexit__(None, None, None)


async def _wait_done(cluster: Cluster, wf_id: str, kills: list[str], rng: random.Random, deadline: float):
    """Kill random parts at random moments until the run closes and enough kills happened."""
    settings = Settings(home=cluster.home)
    done = False
    while not done or len(kills) < MIN_KILLS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run not done after {len(kills)} kills; logs in {cluster.logs}")
        await asyncio.sleep(rng.uniform(0.3, 1.5))
        if len(kills) < MIN_KILLS:
            victim = VICTIMS[len(kills) % len(VICTIMS)] if len(kills) < len(VICTIMS) else rng.choice(VICTIMS)
            cluster.kill(victim)
            kills.append(victim)
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            cluster.restart(victim)
        if not done:
            try:
                client = await connect(cluster.address, settings, attempts=100)
                desc = await client.get_workflow_handle(wf_id).describe()
                done = desc.status == WorkflowExecutionStatus.COMPLETED
            except Exception:  # noqa: BLE001 - the server may be down right now
                pass
    return done


async def _chaos(home, seed_rng):
    cluster = Cluster(home)
    cluster.start()
    kills: list[str] = []
    try:
        cluster.wait_ready()
        settings = Settings(home=home)
        client = await connect(cluster.address, settings)
        req = _request(home)
        wf_id = f"chaos-{uuid.uuid4()}"
        start = time.monotonic()
        await client.start_workflow(queues.WORKFLOW_NAME, req, id=wf_id, task_queue=queues.WORKFLOW_QUEUE)
        await _wait_done(cluster, wf_id, kills, seed_rng, deadline=start + 1200)
        elapsed = time.monotonic() - start
        client = await connect(cluster.address, settings, attempts=100)
        result = await client.get_workflow_handle(wf_id, result_type=OptimizeResult).result()
        view = await load_run(client, wf_id)
        return result, view, kills, elapsed
    finally:
        cluster.stop()


@pytest.mark.slow
def test_run_survives_repeated_kills_of_every_part(temporal_server, tmp_path):
    calm, calm_s = asyncio.run(_undisturbed(temporal_server, tmp_path / "calm"))
    chaos_home = tmp_path / "chaos"
    result, view, kills, chaos_s = asyncio.run(_chaos(chaos_home, random.Random(11)))

    for name, res in (("calm", calm), ("chaos", result)):
        print(name, [(r.round, r.description, round(r.speedup_geomean or 0, 3), r.speedup_ci, r.accepted)
                     for r in res.rounds])
    counts = collections.Counter(kills)
    print(f"\nkills: {len(kills)} {dict(counts)}; undisturbed {calm_s:.1f}s, disturbed {chaos_s:.1f}s, "
          f"segments {result.segments}")
    assert len(kills) >= MIN_KILLS and set(counts) == set(VICTIMS)
    assert result.status == "completed", result.reason

    # Same outcome as the undisturbed run: same best, same rounds, none lost or twice.
    assert result.best.candidate_id == calm.best.candidate_id
    assert [r.round for r in result.rounds] == list(range(1, ROUNDS + 1))
    assert [r.candidate_id for r in result.rounds] == [r.candidate_id for r in calm.rounds]
    assert result.best.tunables == {"REPEAT": 1}
    assert [r.round for r in view.rounds] == list(range(ROUNDS + 1))

    # Executions on the device: at most one per recorded attempt of each test/profile activity.
    attempts: collections.Counter = collections.Counter()
    for r in view.rounds:
        for call in r.calls:
            if call.activity in ("test", "profile"):
                attempts[(call.activity, call.input.candidate_id)] += max(call.attempts, 1)
    log = (chaos_home / "work" / "exec" / "executions.log").read_text().split("\n")
    ran = collections.Counter((line.split()[1], line.split()[2]) for line in log if line)
    extra = sum(ran.values()) - len(attempts)
    print(f"evaluations: {sum(ran.values())} executions for {len(attempts)} activities "
          f"({extra} re-executions after kills); activity attempts recorded: {sum(attempts.values())}")
    for key, n in ran.items():
        assert n <= attempts[key], (key, n, attempts[key])
