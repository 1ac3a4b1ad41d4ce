"""`kopt schedule create|list|pause|unpause|trigger|delete`: nightly campaigns on Temporal Schedules.

A schedule made from a finished run either re-verifies that run's best against the baseline on
every GPU class named (workflow ReverifyBest: a new driver or toolkit can make it wrong or slower)
or, with `--optimize-rounds N`, runs the optimizer again on the run's package with that budget.
Schedules fire only while a server and workers run: a cluster, or `kopt server` with `kopt worker`s
(the embedded server stops with the last kopt command of its home).
"""

from __future__ import annotations

import sys
from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
    WorkflowExecutionStatus,
)
from temporalio.service import RPCError, RPCStatusCode

from frontend.history import load_run
from frontend.inspect import describe
from kopt import queues
from kopt.errors import UsageError
from kopt.models import Candidate
from kopt.run_models import ReverifyRequest
from workflows.optimize import OptimizeKernel
from workflows.reverify import ReverifyBest

PREFIX = "kopt-schedule-"
OVERLAPS = {p.name.lower(): p for p in ScheduleOverlapPolicy if p.name != "UNSPECIFIED"}


async def create(client: Client, name: str, run: str, *, every: timedelta | None, cron: str | None,
                 gpu_classes: list[str], optimize_rounds: int | None, overlap: str, catchup: timedelta,
                 paused: bool, out=sys.stdout) -> str:  # fmt: skip
    """A schedule named `name` for finished run `run`; its id."""
    _, desc = await describe(client, run)
    if desc.status != WorkflowExecutionStatus.COMPLETED:
        raise UsageError(f"run {run} has not completed ({desc.status.name.lower()}): schedule a completed run")
    view = await load_run(client, run)
    req, res = view.request, view.result
    if req is None or res is None or res.best is None:
        raise UsageError(f"run {run} has no best to schedule")
    if optimize_rounds is not None:
        wf, arg = OptimizeKernel.run, req.model_copy(update={"rounds": optimize_rounds, "state": None})
    else:
        if req.target == "cuda" and not gpu_classes:
            gpu_classes = [req.gpu_class] if req.gpu_class else []
        b = res.best
        best = Candidate(id=b.candidate_id, source=b.source, flags=b.flags, tunables=b.tunables, origin="best")
        wf, arg = ReverifyBest.run, ReverifyRequest(run=run, package=req.package, target=req.target,
                                                     toolchain=req.toolchain, baseline=req.baseline, best=best,
                                                     gpu_classes=gpu_classes, seed=req.seed,
                                                     timeouts=req.timeouts)  # fmt: skip
    spec = ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)] if every else [],
                        cron_expressions=[cron] if cron else [])  # fmt: skip
    schedule = Schedule(
        action=ScheduleActionStartWorkflow(wf, arg, id=f"{PREFIX}{name}", task_queue=queues.WORKFLOW_QUEUE),
        spec=spec, policy=SchedulePolicy(overlap=OVERLAPS[overlap], catchup_window=catchup),
        state=ScheduleState(paused=paused, note=f"kopt: {'optimize' if optimize_rounds else 'reverify'} {run}"),
    )  # fmt: skip
    try:
        await client.create_schedule(f"{PREFIX}{name}", schedule)
    except Exception as exc:  # noqa: BLE001 - ScheduleAlreadyRunningError, or the server's refusal
        if type(exc).__name__ == "ScheduleAlreadyRunningError":
            raise UsageError(f"schedule {name!r} already exists (kopt schedule delete {name} first)") from None
        raise
    what = f"optimize {optimize_rounds} round(s)" if optimize_rounds else \
        f"re-verify {res.best.candidate_id} on {', '.join(gpu_classes) or req.target}"  # fmt: skip
    when = f"every {every}" if every else f"cron {cron!r}"
    print(f"schedule {name}: {what} of {run}, {when}; overlap {overlap}, catch-up window {catchup}"
          + (" (paused)" if paused else ""), file=out)  # fmt: skip
    return f"{PREFIX}{name}"


async def list_schedules(client: Client, out=sys.stdout) -> list[dict]:
    rows = []
    async for s in await client.list_schedules():
        if not s.id.startswith(PREFIX):
            continue
        info = s.info
        rows.append({"name": s.id.removeprefix(PREFIX), "paused": bool(s.schedule and s.schedule.state.paused),
                     "note": s.schedule.state.note if s.schedule else "",
                     "next": [t.isoformat() for t in (info.next_action_times if info else [])[:1]],
                     "recent": len(info.recent_actions) if info else 0})  # fmt: skip
    print(f"{'schedule':24} {'paused':6} {'next run':26} {'runs':>4}  what", file=out)
    for r in rows:
        print(f"{r['name']:24} {str(r['paused']).lower():6} {(r['next'] or ['-'])[0]:26} {r['recent']:>4}  {r['note']}",
              file=out)  # fmt: skip
    return rows


async def control(client: Client, name: str, action: str, out=sys.stdout) -> None:
    """pause, unpause, trigger (run now) or delete the schedule `name`."""
    handle = client.get_schedule_handle(f"{PREFIX}{name}")
    try:
        await handle.describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise UsageError(f"unknown schedule {name!r} (see `kopt schedule list`)") from None
        raise
    if action == "pause":
        await handle.pause(note="paused with kopt schedule pause")
    elif action == "unpause":
        await handle.unpause(note="unpaused with kopt schedule unpause")
    elif action == "trigger":
        await handle.trigger()
    elif action == "delete":
        await handle.delete()
    print(f"schedule {name}: {action}{'d' if action.endswith('e') else 'ed'}", file=out)
