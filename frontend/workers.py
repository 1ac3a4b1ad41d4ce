"""Workers by role. Embedded mode runs them in-process; production runs one role per process."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import structlog
from temporalio.client import Client
from temporalio.worker import Worker

from activities import agents as agent_activities
from activities.build import BuildActivities
from activities.execution import ExecActivities
from containment import build, jail
from gpu_worker.device import cpu_name
from kopt import queues
from kopt.activity_table import Kind, names
from kopt.artifacts import ArtifactStore
from kopt.settings import Settings
from workflows.optimize import OptimizeKernel
from workflows.reverify import ReverifyBest

log = structlog.get_logger(__name__)

@dataclass
class WorkerPlan:
    """What one process should serve."""

    roles: tuple[str, ...]
    toolchains: tuple[build.Toolchain, ...] = ()
    exec_target: str | None = None  # "cpu" or "cuda"
    gpu_class: str | None = None
    gpu_index: int | None = None  # the one GPU this process drives (kopt worker --gpu-index)
    gpu_indices: tuple[int, ...] = ()  # or: an exec slot on each of these GPUs (the embedded campaign)


def check_sandbox(plan: WorkerPlan) -> None:
    """Build and exec workers run untrusted code only in a jail (containment/jail.py): say so loudly when
    this host cannot build one (every candidate will then fail with that reason)."""
    if not ({"build", "exec"} & set(plan.roles)):
        return
    why = jail.probe()
    if why:
        log.error("sandbox_unavailable", reason=why, hint=f"candidates are refused unless {jail.ESCAPE_HATCH}=1 "
                  "and KOPT_SANDBOX=off (no containment at all)")  # fmt: skip
        print(f"kopt: WARNING: no sandbox for untrusted code on this host: {why}", file=sys.stderr)


def make_workers(client: Client, settings: Settings, plan: WorkerPlan) -> list[Worker]:
    check_sandbox(plan)
    store = ArtifactStore(settings.artifacts)
    workers: list[Worker] = []
    if "workflows" in plan.roles:
        workers.append(Worker(client, task_queue=queues.WORKFLOW_QUEUE, workflows=[OptimizeKernel, ReverifyBest]))
    if "agents" in plan.roles:
        workers.append(Worker(client, task_queue=queues.AGENTS_QUEUE,
                              activities=implementations(agent_activities, "agents"),
                              max_concurrent_activities=8))  # fmt: skip
    if "build" in plan.roles:
        for tc in plan.toolchains:
            acts = BuildActivities(store, tc, settings.work_dir / "build")
            workers.append(Worker(client, task_queue=queues.build_queue(tc.name),
                                  activities=implementations(acts, "build"),
                                  max_concurrent_activities=max(1, os.cpu_count() or 1)))  # fmt: skip
    if "exec" in plan.roles and plan.exec_target:
        queue = queues.exec_queue(plan.exec_target, plan.gpu_class)
        if plan.gpu_index is not None:
            # The harness child inherits this: one worker process drives exactly one GPU.
            os.environ["CUDA_VISIBLE_DEVICES"] = str(plan.gpu_index)
        device_class = plan.gpu_class if plan.exec_target == "cuda" else f"cpu:{cpu_name()}"
        # One activity slot per device: timings are never taken with two kernels on one GPU/CPU. Several
        # GPUs: a slot each, every activity on a GPU of its own (ExecActivities takes a free one for its
        # harness children: spawn.VISIBLE_GPU), so a round's candidates are judged side by side.
        acts = ExecActivities(store, settings.work_dir / "exec", device_class, gpus=plan.gpu_indices)
        workers.append(Worker(client, task_queue=queue, activities=implementations(acts, "exec"),
                              max_concurrent_activities=max(1, len(plan.gpu_indices))))
    return workers


def implementations(provider: object, kind: Kind) -> list:
    """The activities of one kind (kopt/activity_table.py), found by their table names on `provider`
    (the agents module, a BuildActivities or ExecActivities): one missing is a startup error."""
    missing = [name for name in names(kind) if not callable(getattr(provider, name, None))]
    if missing:
        raise RuntimeError(f"no implementation of activities {missing} on {provider!r}")
    return [getattr(provider, name) for name in names(kind)]


@asynccontextmanager
async def running_workers(client: Client, settings: Settings, plan: WorkerPlan) -> AsyncIterator[None]:
    """Every worker of `plan` polling its queue for the duration of the block."""
    async with AsyncExitStack() as stack:
        for worker in make_workers(client, settings, plan):
            await stack.enter_async_context(worker)
        yield


def toolchains_for(names: list[str] | None) -> tuple[build.Toolchain, ...]:
    """Local toolchains, restricted to the names asked for (all found ones when None)."""
    found = [tc for tc in (build.detect_toolchain("cpu"), build.detect_toolchain("cuda")) if tc]
    if names is None:
        return tuple(found)
    by_name = {tc.name: tc for tc in found}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"toolchain(s) {missing} not available here; found {sorted(by_name) or 'none'}")
    return tuple(by_name[n] for n in names)

