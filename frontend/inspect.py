"""Reading runs back: runs, status, watch, history, export, replay, approve, cancel."""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Replayer

from frontend.client import connect
from frontend.history import RunView, load_run, segments
from kopt import queues
from kopt.activity_table import ACTIVITIES, names
from kopt.errors import UsageError
from kopt.run_models import Approval, OptimizeResult, Progress
from kopt.search_attributes import BEST_KEY, KERNEL_KEY, ROUND_KEY, TARGET_KEY
from kopt.settings import Settings
from workflows.optimize import OptimizeKernel


@asynccontextmanager
async def reader(settings: Settings):
    """A client for the configured cluster, or for the embedded server (started on its database)."""
    from frontend.server import attach_home

    server = None
    if settings.temporal_address:
        address = settings.temporal_address
    else:
        if not settings.server_db.exists():
            raise UsageError(f"no kopt runs yet: {settings.server_db} does not exist (set KOPT_HOME or "
                             "KOPT_TEMPORAL_ADDRESS)")
        server = attach_home(settings, say=lambda text: print(f"kopt: {text}", file=sys.stderr))
        address = server.address
    try:
        yield await connect(address, settings)
    finally:
        if server is not None:
            server.release()


async def view(client: Client, run: str) -> RunView:
    await describe(client, run)
    return await load_run(client, run)


async def list_runs(client: Client, limit: int, out=sys.stdout) -> list[dict]:
    rows = []
    query = f'WorkflowType = "{queues.WORKFLOW_NAME}"'
    async for wf in client.list_workflows(query, limit=limit):
        sa = wf.typed_search_attributes
        status = wf.status.name.lower() if wf.status else ""
        if status == "completed":  # the workflow completed; a run whose baseline failed does too (#29)
            status = await _run_status(client, wf.id, wf.run_id)
        rows.append({"run": wf.id, "run_id": wf.run_id, "status": status,
                     "kernel": sa.get(KERNEL_KEY), "target": sa.get(TARGET_KEY), "round": sa.get(ROUND_KEY),
                     "best_speedup": sa.get(BEST_KEY), "started": wf.start_time.isoformat()})
    print(f"{'run':44} {'status':15} {'kernel':20} {'target':6} {'round':>5} {'best':>7}", file=out)
    for r in rows:
        best = f"{r['best_speedup']:.3f}x" if r["best_speedup"] is not None else "-"
        print(f"{r['run']:44} {r['status']:15} {str(r['kernel']):20} {str(r['target']):6} "
              f"{str(r['round'] if r['round'] is not None else '-'):>5} {best:>7}", file=out)
    return rows


async def _run_status(client: Client, workflow_id: str, run_id: str) -> str:
    """A completed workflow's run status as its result says it: "completed", or "baseline failed"."""
    try:
        result = await client.get_workflow_handle(workflow_id, run_id=run_id, result_type=OptimizeResult).result()
    except Exception:  # noqa: BLE001 - an older result that no longer parses: the workflow's status speaks
        return "completed"
    return result.status.replace("_", " ")


QUERY_TIMEOUT = timedelta(seconds=3)  # a live run's worker answers in milliseconds; none answers at all


async def describe(client: Client, run: str):
    """(handle, description) of a run; an unknown id is a usage error, worded the same for every command."""
    handle = client.get_workflow_handle(run)
    try:
        return handle, await handle.describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise UsageError(f"unknown run {run!r} (see `kopt runs`)") from None
        raise


async def live_progress(handle) -> Progress | None:
    """The workflow's own progress, or None when no workflow worker answers within QUERY_TIMEOUT."""
    try:
        return await handle.query(OptimizeKernel.progress, rpc_timeout=QUERY_TIMEOUT)
    except Exception:  # noqa: BLE001 - no worker (or one restarting): history tells the rest
        return None


def history_summary(view: RunView, reports: Path | None = None) -> list[str]:
    """What a closed (or unattended) run did, from its history alone."""
    req, res = view.request, view.result
    done = max((r.round for r in view.rounds), default=0)
    lines = []
    if req is not None:
        lines.append(f"{req.package.spec.name} on {req.target}{' / ' + req.gpu_class if req.gpu_class else ''}, "
                     f"round {done}/{req.rounds} ({len(view.run_ids)} segment(s))")  # fmt: skip
    if res is not None:
        if res.best is not None:
            lines.append(f"best: {res.best.candidate_id} (round {res.best.round}) "
                         f"{res.best.speedup_geomean:.3f}x over the baseline")  # fmt: skip
        if res.stop_reason:
            lines.append(f"stopped early: {res.stop_reason}")
        if res.reason:
            lines.append(f"reason: {res.reason}")
    elif view.status != "running":
        lines.append("no result: see `kopt history` (and `kopt resume` to continue it)")
    if reports is not None and (reports / view.workflow_id / "report.json").is_file():
        lines.append(f"report: {reports / view.workflow_id / 'report.json'}")
    return lines


# How a run that did not succeed reads (kopt status exits 1 for these: a CI job that reports on a run
# stays red when the run failed).
FAILED_STATES = ("baseline failed", "failed", "terminated", "timed_out", "canceled")


async def status(client: Client, run: str, out=sys.stdout, reports: Path | None = None
                 ) -> tuple[Progress | None, str]:  # fmt: skip
    """A finished run: from its history (no worker needed); a live one: its own progress query, else
    its history. Returns the live progress (None without) and the state it printed."""
    handle, desc = await describe(client, run)
    running = desc.status == WorkflowExecutionStatus.RUNNING
    progress = await live_progress(handle) if running else None
    ran = await load_run(client, run) if progress is None else None
    state = ran.status if ran is not None and not running else desc.status.name.lower() if desc.status else "unknown"
    print(f"run {run}: {state} (Temporal run {desc.run_id})", file=out)
    if progress is None:
        if running:
            print("  no workflow worker is serving it (is its `kopt optimize` running?); from history:", file=out)
        for line in history_summary(ran, reports):
            print(f"  {line}", file=out)
        for line in await llm_waits(handle, desc):
            print(f"  {line}", file=out)
        return None, state
    best = f"{progress.best_speedup:.3f}x" if progress.best_speedup else "-"
    print(f"  phase {progress.phase}, round {progress.round}/{progress.rounds}, segment {progress.segment}, "
          f"best {best}", file=out)
    if progress.pending_approval:
        print(f"  waiting for approval of {progress.pending_approval}", file=out)
    for line in await llm_waits(handle, desc):
        print(f"  {line}", file=out)
    for event in progress.events[-5:]:
        print(f"  {event}", file=out)
    return progress, state


async def llm_waits(handle, desc) -> list[str]:
    """One line per agent activity being retried because the endpoint failed: "waiting for the LLM
    endpoint since <first attempt's start> (planner, attempt 4): HTTP 500 from ..."."""
    pending = [p for p in desc.raw_description.pending_activities
               if p.activity_type.name in names("agents") and p.attempt > 1 and p.HasField("last_failure")]
    if not pending:
        return []
    scheduled: dict[str, datetime] = {}
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.activity_task_scheduled_event_attributes.activity_id] = event.event_time.ToDatetime(
                tzinfo=timezone.utc)
    lines = []
    for p in pending:
        since = scheduled.get(p.activity_id)
        when = since.strftime("%Y-%m-%d %H:%M:%S UTC") if since else "an earlier attempt"
        error = p.last_failure.message.strip().splitlines()[0] if p.last_failure.message.strip() else "no detail"
        lines.append(f"waiting for the LLM endpoint since {when} ({ACTIVITIES[p.activity_type.name].who}, "
                     f"attempt {p.attempt}): {error}")
    return lines


async def watch(client: Client, run: str, out=sys.stdout, interval: float = 1.0, reports: Path | None = None) -> None:
    """Live view: new events, and a progress line redrawn in place (on a terminal), until the run
    closes; a closed run is summarized from history at once."""
    handle, desc = await describe(client, run)
    tty = out.isatty()
    seen, shown_waits, bar_shown, unattended = 0, [], False, False

    def emit(text: str) -> None:
        nonlocal bar_shown
        if bar_shown and tty:
            out.write("\r\x1b[2K")  # the progress line gives way to the new text
            bar_shown = False
        print(text, file=out, flush=True)

    while desc.status == WorkflowExecutionStatus.RUNNING:
        p = await live_progress(handle)
        if p is None and not unattended:
            emit(f"  run {run} is running, but no workflow worker serves it (is its `kopt optimize` running?)")
        unattended = p is None
        if p is not None:
            fresh = p.event_total - seen
            for event in p.events[-fresh:] if fresh > 0 else []:
                emit(f"  {event}")
            seen = p.event_total
            done = min(p.round, p.rounds)
            best = f"{p.best_speedup:.3f}x" if p.best_speedup else "-"
            line = f"[{'#' * int(30 * done / max(p.rounds, 1)):30}] round {done}/{p.rounds} {p.phase:18} best {best}"
            if tty:
                out.write(f"\r\x1b[2K{line}")
                out.flush()
                bar_shown = True
            else:
                print(line, file=out, flush=True)
        waits = await llm_waits(handle, desc)
        if waits != shown_waits:
            for w in waits:
                emit(f"  {w}")
            shown_waits = waits
        await asyncio.sleep(interval)
        desc = await handle.describe()
    emit(f"run {run}: {desc.status.name.lower() if desc.status else 'unknown'}")
    for line in history_summary(await load_run(client, run), reports):
        print(f"  {line}", file=out, flush=True)


def _reused(candidate: str | None) -> str:
    return f" (same library bytes as {candidate}: its verdict, not run again)" if candidate else ""


def history_text(view: RunView, full: bool = False) -> str:
    """Per round: plan, LLM calls (with every prompt and response when full), diff, compile, test, timings."""
    lines = [f"run {view.workflow_id}: {view.status}, {len(view.run_ids)} segment(s)"]
    for r in view.rounds:
        head = f"round {r.round} (segment {r.segment}) candidate {r.candidate_id}"
        lines.append(head)
        if r.plan:
            lines.append(f"  plan: {r.plan.description}")
            lines.append(f"    why: {r.plan.rationale}")
        if r.code:
            lines.append(f"  code: flags {' '.join(r.code.candidate.flags)}")
            lines.extend(f"    {d}" for d in r.code.diff.splitlines())
        if r.compile:
            lines.append(f"  compile: {'ok' if r.compile.ok else 'FAILED'} in {r.compile.seconds:.2f}s "
                         f"({' '.join(r.compile.command[:1])})")
            lines.extend(f"    {u}" for u in r.compile.resource_usage.splitlines()[:4])
            if not r.compile.ok:
                lines.extend(f"    {t}" for t in r.compile.log_tail.splitlines()[-5:])
        if r.test:
            lines.append(f"  test: {'correct' if r.test.correct else 'REJECTED: ' + str(r.test.reason)}"
                         + _reused(r.test.reused_from))
        if r.profile:
            if r.profile.reused_from:
                lines.append(f"  time:{_reused(r.profile.reused_from)}")
            for t in r.profile.timings:
                sol = f" {t.pct_sol:.1f}%SOL" if t.pct_sol is not None else ""
                lines.append(f"  time: {t.shape} {t.dtype} median {t.median_us:.2f}us ({t.samples} samples){sol}")
            if r.profile.nsight is not None:
                lines.extend(f"  profiler: {line}" for line in r.profile.nsight.lines())
        for c in r.llm_calls:
            cost = f" ${c.cost_usd:.4f}" if c.cost_usd is not None else ""
            lines.append(f"  llm {c.role}: {c.model}, {c.usage.prompt_tokens}+{c.usage.completion_tokens} tokens"
                         f"{cost}, {c.latency_s:.1f}s{' (repair turn)' if c.repair else ''}"
                         f"{' ERROR: ' + c.error if c.error else ''}")
            if full:
                for m in c.messages:
                    lines.append(f"    [{m.role}]")
                    lines.extend(f"      {t}" for t in m.content.splitlines())
                lines.append("    [response]")
                lines.extend(f"      {t}" for t in (c.response_text or "").splitlines())
        retries = [f"{c.activity} x{c.attempts}" for c in r.calls if c.attempts > 1]
        if retries:
            lines.append(f"  retried: {', '.join(retries)}")
    if view.result and view.result.best:
        b = view.result.best
        lines.append(f"best: {b.candidate_id} (round {b.round}) {b.speedup_geomean:.3f}x")
    return "\n".join(lines)


def export(view: RunView, fmt: str) -> str:
    if fmt == "json":
        return view.model_dump_json(indent=2)
    text = history_text(view, full=True)
    if fmt == "md":
        return _markdown(view, text)
    if fmt == "html":
        return _html(view, text)
    raise UsageError(f"unknown export format {fmt!r}; use json, md or html")


def _report_of(view: RunView):
    """(report, source file name) of a finished run; None for a run without a result yet."""
    from frontend.report import build_report

    if view.result is None or view.request is None:
        return None
    req = view.request
    report = build_report(view.workflow_id, view.run_ids[-1] if view.run_ids else "", req, view.result, None)
    return report, Path(req.package.spec.sources.get(req.target, "kernel")).name


def _markdown(view: RunView, history: str) -> str:
    """The run's report as `kopt optimize` writes report.md (for a finished run), then its full history;
    a run without a result yet has the history alone, headed so."""
    from frontend.report import render_markdown

    fence = f"```\n{history}\n```\n"
    found = _report_of(view)
    if found is None:
        return f"# kopt run {view.workflow_id} ({view.status}: no report yet)\n\n## History\n\n{fence}"
    return f"{render_markdown(*found)}\n## History\n\n{fence}"


def _html(view: RunView, history: str) -> str:
    """The page a reviewer opens (frontend/report_html.py): the report with its charts, the diff of the
    best against the baseline, and the history folded away; for a run without a result, the history."""
    from frontend.report import report_page
    from frontend.report_html import render_html

    found = _report_of(view)
    if found is None:
        return render_html(f"# kopt run {view.workflow_id} ({view.status}: no report yet)", {}, "", history,
                           title=f"kopt run {view.workflow_id}")
    report, source = found
    best = view.result.best.source if view.result.best else view.request.baseline.source
    return report_page(report, view_charts(view), view.request.baseline.source, best, source, history)


def view_charts(view: RunView) -> dict[str, bytes]:
    """The report's charts (frontend/charts.py) from a run's history: per-shape speedup and %SOL of the
    best, and the rounds; none for a run without a result."""
    from frontend.charts import run_charts

    res = view.result
    if res is None or view.request is None:
        return {}
    from frontend.report import baseline_sol

    base, best = res.baseline.profile, (res.best.per_shape if res.best else [])
    return run_charts(res.kernel, res.target, baseline_sol(best, base.timings if base else []), best, res.rounds)


async def replay(client: Client, run: str, out=sys.stdout) -> int:
    """Replay every segment of a run against the current workflow code; report non-determinism."""
    await describe(client, run)
    histories = await segments(client, run)
    replayer = Replayer(workflows=[OptimizeKernel], data_converter=pydantic_data_converter)
    failures = 0
    for h in histories:
        result = await replayer.replay_workflow(h, raise_on_replay_failure=False)
        if result.replay_failure:
            failures += 1
            print(f"segment {h.run_id}: NON-DETERMINISTIC: {result.replay_failure}", file=out)
        else:
            print(f"segment {h.run_id}: replayed OK ({len(h.events)} events)", file=out)
    return 1 if failures else 0


async def approve(client: Client, run: str, candidate: str, accept: bool, out=sys.stdout) -> None:
    handle, _ = await describe(client, run)
    try:
        answer = await handle.execute_update(OptimizeKernel.approve, Approval(candidate_id=candidate, accept=accept),
                                             result_type=str)
    except Exception as exc:  # noqa: BLE001 - the validator's message is the useful part
        cause = getattr(exc, "cause", None) or exc
        raise UsageError(f"approval refused: {getattr(cause, 'message', None) or cause}") from None
    print(answer, file=out)


async def cancel(client: Client, run: str, out=sys.stdout) -> None:
    handle, desc = await describe(client, run)
    if desc.status != WorkflowExecutionStatus.RUNNING:
        print(f"run {run} is not running ({desc.status.name.lower() if desc.status else 'unknown'}): "
              "nothing to cancel", file=out)
        return
    await handle.cancel()
    print(f"cancellation requested for {run}", file=out)


def dump_json(rows) -> str:
    return json.dumps(rows, indent=2, default=str)
