"""`kopt cancel` reaches a running kernel: the harness child is killed within seconds."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from frontend.inspect import cancel
from frontend.runs import prepare_request
from kopt import queues
from kopt.run_models import ActivityTimeouts
from kopt.settings import Settings
from tests.conftest import REPO, cpu_cluster

SPIN = """
#include <stdint.h>
#include "kopt_abi.h"
#define REPEAT 16
KOPT_EXPORT int kopt_repeat(const kopt_tensor *args, int32_t nargs, void *stream) {
  volatile int64_t spin = 0;
  for (;;) spin += REPEAT;  // never returns: only a kill ends it
  return KOPT_OK;
}
"""


def _procs() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process."""
    procs = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                procs[int(proc.name)] = (ppid, (proc / "cmdline").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    return procs


def _harness_pids() -> list[int]:
    """Harness children: `-m gpu_worker.harness` processes, or forks of the harness zygote."""
    procs = _procs()
    zygotes = {pid for pid, (_, cmd) in procs.items() if b"gpu_worker.zygote" in cmd}
    return [pid for pid, (ppid, cmd) in procs.items()
            if b"gpu_worker.harness" in cmd or (pid in zygotes and ppid in zygotes)]


async def _run(server, home: Path, pkg: Path) -> tuple[float, list[int]]:
    settings = Settings(home=home)
    req = prepare_request(pkg, "cpu", None, 1, "offline", 0, settings)
    req = req.model_copy(update={"timeouts": ActivityTimeouts(exec_s=600, exec_heartbeat_s=4)})
    async with cpu_cluster(server.address, settings) as client:
        wf_id = f"cancel-{uuid.uuid4()}"
        handle = await client.start_workflow(queues.WORKFLOW_NAME, req, id=wf_id, task_queue=queues.WORKFLOW_QUEUE)
        log = home / "work" / "exec" / "executions.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "test" in log.read_text()):
            assert time.monotonic() < deadline, "the test activity never started"
            await asyncio.sleep(0.2)
        while not _harness_pids():  # the harness child starts (and its kernel spins) a moment after the audit line
            assert time.monotonic() < deadline, "no harness child is running"
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)
        start = time.monotonic()
        await cancel(client, wf_id)
        while _harness_pids():
            assert time.monotonic() - start < 30, "harness child still alive 30 s after cancel"
            await asyncio.sleep(0.2)
        killed_after = time.monotonic() - start
        desc = await handle.describe()
        return killed_after, [desc.status]


@pytest.mark.slow
@pytest.mark.serial  # a machine-wide process check: the parallel phase's other harness children kept it at 24 s once
def test_cancel_kills_running_kernel(temporal_server, tmp_path):
    pkg = tmp_path / "spin"
    shutil.copytree(REPO / "tests" / "fixtures" / "repeat", pkg)
    (pkg / "kernel.cpp").write_text(SPIN)
    killed_after, status = asyncio.run(_run(temporal_server, tmp_path / "home", pkg))
    print(f"\nharness child gone {killed_after:.1f} s after `kopt cancel`")
    assert killed_after < 15  # a heartbeat (4 s) and the kill; 11.2 s once on the 2-core CI VM under the parallel phase
    assert status == [WorkflowExecutionStatus.CANCELED]
