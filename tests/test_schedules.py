"""Nightly campaigns on Temporal Schedules (`kopt schedule`), against the dev server: a schedule made
from a completed run re-verifies its best against the baseline when it fires, with the overlap policy
and catch-up window asked for; pause, trigger and delete work; unknown names and runs are exit 2."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from temporalio.client import ScheduleOverlapPolicy

from frontend.runs import prepare_request
from kopt import queues
from kopt.run_models import OptimizeResult, ReverifyResult
from kopt.settings import Settings
from tests.conftest import REPO, cpu_cluster, kopt_env

REPEAT = REPO / "tests" / "fixtures" / "repeat"


def cli(address: str, home, *args: str):
    return subprocess.run([sys.executable, "-m", "kopt", "schedule", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=kopt_env(home, KOPT_TEMPORAL_ADDRESS=address))  # fmt: skip


@pytest.mark.slow
def test_a_schedule_reverifies_a_runs_best_when_it_fires(temporal_server, kopt_home, tmp_path):
    settings = Settings()
    address = temporal_server.address
    name = f"nightly-{uuid.uuid4().hex[:6]}"

    async def scenario():
        req = prepare_request(REPEAT, "cpu", None, 1, "offline", 0, settings)
        async with cpu_cluster(address, settings) as client:
            run = f"sched-{uuid.uuid4()}"
            result = await client.execute_workflow(queues.WORKFLOW_NAME, req, id=run, task_queue=queues.WORKFLOW_QUEUE,
                                                   result_type=OptimizeResult)  # fmt: skip
            assert result.best.candidate_id != req.baseline.id  # REPEAT 16 -> 8: about twice as fast

            call = lambda *a: asyncio.to_thread(cli, address, tmp_path / "home", *a)  # noqa: E731
            made = await call("create", name, "--run", run, "--every", "24h", "--catchup-window", "2h")
            assert made.returncode == 0, made.stderr
            assert f"re-verify {result.best.candidate_id} on cpu" in made.stdout
            again = await call("create", name, "--run", run, "--every", "24h")
            assert again.returncode == 2 and "already exists" in again.stderr
            desc = await client.get_schedule_handle(f"kopt-schedule-{name}").describe()
            assert desc.schedule.spec.intervals[0].every == timedelta(hours=24)
            assert desc.schedule.policy.overlap == ScheduleOverlapPolicy.SKIP
            assert desc.schedule.policy.catchup_window == timedelta(hours=2)
            listed = await call("list")
            assert listed.returncode == 0 and name in listed.stdout

            fired = await call("trigger", name)
            assert fired.returncode == 0, fired.stderr
            for _ in range(600):  # the action's workflow, then its result
                desc = await client.get_schedule_handle(f"kopt-schedule-{name}").describe()
                if desc.info.recent_actions:
                    break
                await asyncio.sleep(0.1)
            started = desc.info.recent_actions[-1].action
            handle = client.get_workflow_handle(started.workflow_id, run_id=started.first_execution_run_id)
            verdict = await asyncio.wait_for(handle.result(rpc_timeout=timedelta(seconds=300)), 300)
            verdict = ReverifyResult.model_validate(verdict) if isinstance(verdict, dict) else verdict
            assert verdict.ok and verdict.candidate_id == result.best.candidate_id and verdict.run == run
            (v,) = verdict.verdicts
            assert v.gpu_class is None and v.correct and v.regressions == [] and v.speedup_geomean > 1.3

            paused = await call("pause", name)
            assert paused.returncode == 0
            assert (await client.get_schedule_handle(f"kopt-schedule-{name}").describe()).schedule.state.paused
            gone = await call("delete", name)
            assert gone.returncode == 0
            unknown = await call("pause", name)
            assert unknown.returncode == 2 and f"unknown schedule {name!r}" in unknown.stderr
            no_run = await call("create", "x", "--run", "no-such-run", "--every", "1h")
            assert no_run.returncode == 2 and "unknown run 'no-such-run'" in no_run.stderr

    asyncio.run(scenario())
