"""`kopt optimize`: validate input, bring up the embedded default, run the workflow, write the report."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import secrets
import sys
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import structlog
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.service import RPCError

from containment import build
from frontend import exits
from frontend.inputs import package_and_toolchain
from frontend.report import build_report, write_report
from kopt import queues
from kopt.agent_models import PROVIDERS
from kopt.artifacts import ArtifactStore
from kopt.candidates import candidate_id
from kopt.errors import RunFailed, UsageError
from kopt.gpu_classes import KNOWN_GPU_CLASSES
from kopt.holdout import holdout_shapes, split_workload
from kopt.models import Candidate, PackageRef
from kopt.package import read_tunables
from kopt.run_models import OptimizeRequest, OptimizeResult, Progress
from kopt.search_attributes import BEST_KEY, KERNEL_KEY, ROUND_KEY, TARGET_KEY
from kopt.settings import Settings
from workflows.optimize import OptimizeKernel

log = structlog.get_logger(__name__)



def prepare_request(kernel_dir: Path, target: str, gpu_class: str | None, rounds: int, provider: str, seed: int,
                    settings: Settings) -> OptimizeRequest:
    """Check everything that can be checked before a server is touched; UsageError names what to fix."""
    if target not in ("cpu", "cuda"):
        raise UsageError(f"unknown target {target!r}; use --target cpu or --target cuda")
    if rounds < 0:
        raise UsageError(f"--rounds must be >= 0, got {rounds}")
    if provider not in PROVIDERS:
        raise UsageError(f"unknown provider {provider!r}; available: {', '.join(PROVIDERS)}")
    if target == "cpu" and gpu_class:
        raise UsageError("--gpu-class applies to --target cuda only")
    if target == "cuda":
        gpu_class = gpu_class or queues.DEFAULT_GPU_CLASS
        if gpu_class not in KNOWN_GPU_CLASSES:
            raise UsageError(f"unknown GPU class {gpu_class!r}; known: {', '.join(KNOWN_GPU_CLASSES)}")
    spec, toolchain = package_and_toolchain(kernel_dir, target)
    source = (Path(kernel_dir) / spec.sources[target]).read_text()
    flags = list(spec.build[target].flags) if target in spec.build else []
    tunables = read_tunables(source, [t.name for t in spec.tunables_for(target)])
    store = ArtifactStore(settings.artifacts)
    reference = Path(kernel_dir) / "reference.py"
    package = PackageRef(spec=spec, files=store.put_tree(Path(kernel_dir)),
                         baseline_sources={t: (Path(kernel_dir) / spec.sources[t]).read_text() for t in spec.targets})
    baseline = Candidate(id=candidate_id(source, flags, toolchain.name), source=source, flags=flags,
                         tunables=tunables, origin="baseline")
    return OptimizeRequest(package=package, target=target, gpu_class=gpu_class, toolchain=toolchain.name,
                           baseline=baseline, rounds=rounds, provider=provider, seed=seed,
                           reference_source=reference.read_text() if reference.is_file() else "")


BENCH_SHAPES = "bench"  # `--workload bench`: the package's bench shapes, not the workload it serves


def serving_workload(req: OptimizeRequest, args) -> Path | None:
    """The workload file a run optimizes: --workload FILE; else the one the package declares for the
    target (kernel.toml [workloads]); none with `--workload bench` or where the package has none."""
    given = getattr(args, "workload", None)
    if given is not None:
        return None if str(given) == BENCH_SHAPES else Path(given)
    name = req.package.spec.workloads.get(req.target)
    kernel_dir = getattr(args, "kernel_dir", None)
    return Path(kernel_dir) / name if name and kernel_dir is not None else None


def objective_line(req: OptimizeRequest) -> str:
    if not req.workload:
        return f"geomean speedup over the {len(req.package.spec.shapes[req.target].bench)} bench shapes"
    held = f", {len(req.holdout_shapes)} more held out" if req.holdout_shapes else ""
    return f"workload-weighted time over {len(req.workload)} shapes{held} (`--workload bench`: the bench shapes)"


def apply_run_options(req: OptimizeRequest, args, settings: Settings) -> OptimizeRequest:
    """The CLI's search, budget and provider options, checked, applied to a prepared request."""
    from kopt.llm_settings import LLMSettings, llm_config
    from kopt.run_models import Budgets

    if getattr(args, "candidates", None) is None:  # from the GPUs that judge them, where kopt starts the workers
        local_cuda = req.target == "cuda" and not settings.temporal_address
        gpus = len(local_gpu_indices(req.gpu_class, getattr(args, "gpus", "all"))) if local_cuda else 1
        # Offline, in asynchronous slots: two a GPU, so that one is planned and compiled while the other is
        # judged and no GPU waits for a compile (decision 0041). In lockstep: one a GPU (decision 0038).
        slotted = local_cuda and getattr(args, "provider", "offline") == "offline" \
            and not getattr(args, "lockstep", False) and not getattr(args, "single_agent", False)
        args.candidates = 2 * gpus if slotted else gpus
    for name in ("continue_every", "candidates"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("patience", "max_cost", "max_tokens", "max_gpu_seconds", "max_wall_time"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    holdout = getattr(args, "holdout", 0)
    if holdout < 0:
        raise UsageError(f"--holdout must be >= 0, got {holdout}")
    workload_file = serving_workload(req, args)
    if workload_file is not None:
        from kopt.workload import WorkloadError, load_workload

        try:
            workload, held = split_workload(load_workload(workload_file, req.package.spec), req.seed, holdout)
        except WorkloadError as exc:
            named = "" if getattr(args, "workload", None) is not None else " (kernel.toml [workloads] names it)"
            raise UsageError(f"{exc}{named}") from None
    else:
        workload, held = [], holdout_shapes(req.package.spec, req.target, req.seed, holdout)
    min_gain = getattr(args, "min_gain", None)
    if min_gain is not None and not 0 <= min_gain < 1:
        raise UsageError(f"--min-gain must be in [0, 1), got {min_gain}")
    llm = None
    if req.provider == "openai":
        try:
            llm = llm_config(LLMSettings())
        except Exception as exc:  # noqa: BLE001 - a malformed KOPT_OPENAI_* value
            raise UsageError(f"KOPT_OPENAI_* settings: {exc}".splitlines()[0]) from None
        if args.model:
            llm = llm.model_copy(update={"model": args.model})
        llm = llm.model_copy(update={"cache_scope": secrets.token_hex(8)})  # this invocation's lineage
        if not settings.temporal_address and llm.api_key_env and not os.environ.get(llm.api_key_env):
            raise UsageError(f"provider openai: the API key variable {llm.api_key_env} is not set (set it, or name "
                             f"another with KOPT_OPENAI_API_KEY_ENV; empty for endpoints without keys)")
        if not settings.temporal_address:  # the local agents worker would fail every call (and the run wait)
            try:
                importlib.import_module("openai")
            except ImportError as exc:
                raise UsageError(f"provider openai: the openai client does not load here ({type(exc).__name__}: "
                                 f"{exc}); install kopt's dependencies (pip install -e .)") from None
    elif args.model:
        raise UsageError("--model applies to --provider openai only")
    budgets = Budgets(max_cost_usd=args.max_cost, max_tokens=args.max_tokens, max_gpu_seconds=args.max_gpu_seconds,
                      max_wall_time_s=args.max_wall_time)
    return req.model_copy(update={"approve": args.approve, "continue_every": args.continue_every, "llm": llm,
                                  "allow_regressions": getattr(args, "allow_regressions", False),
                                  "candidates_per_round": args.candidates, "single_agent": args.single_agent,
                                  "lockstep": getattr(args, "lockstep", False),
                                  "patience": args.patience, "budgets": budgets,
                                  "min_gain": req.min_gain if min_gain is None else min_gain,
                                  "holdout_shapes": held, "workload": workload,
                                  "time_cap_s": getattr(args, "time_cap", None)})


# What a command does after its workflow closes: write the report, stop the workers and the dev server it
# started. A small CPU run on the 2-core VM: 1.7 s the report (1.1 s of it matplotlib's import, now done
# beside the run), 1.3 s the dev server's stop; 3.9 s in all once in a fresh-clone CI run.
CLOSE_RESERVE_S = 4.0


def workflow_id(req: OptimizeRequest) -> str:
    """Deterministic per request: starting the same run again attaches to it while it is running (the
    reply cache's scope and the wall-time budget's start, fresh for every invocation, are left out of
    the digest)."""
    same = req.model_copy(update={"llm": req.llm.model_copy(update={"cache_scope": None})}) if req.llm else req
    same = same.model_copy(update={"budgets": same.budgets.model_copy(update={"wall_time_from": None})})
    digest = hashlib.sha256(same.model_dump_json().encode()).hexdigest()[:10]
    return f"kopt-{req.package.spec.name}-{req.target}-{digest}"


async def resume_point(client, settings: Settings, run: str, serve: bool = False) -> tuple[OptimizeRequest, str]:
    """The request that continues `run` from its last finished round, and the new run's id. Asks the
    run itself (query `resume_point`, answered by replaying its history on a workflow worker; `serve`:
    this process runs one for the purpose, as the embedded mode has no other)."""
    from temporalio.client import WorkflowExecutionStatus

    from frontend.workers import WorkerPlan, running_workers

    handle = client.get_workflow_handle(run)
    try:
        desc = await handle.describe()
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"unknown run {run!r}: {exc}") from None
    if desc.status == WorkflowExecutionStatus.RUNNING:
        raise UsageError(f"run {run} is still running: follow it with `kopt watch {run}`")
    async with AsyncExitStack() as stack:
        if serve:
            await stack.enter_async_context(running_workers(client, settings, WorkerPlan(roles=("workflows",))))
        point = await handle.query(OptimizeKernel.resume_point)
    if point.state is not None and desc.status == WorkflowExecutionStatus.COMPLETED \
            and point.state.next_round > point.request.rounds:
        raise UsageError(f"run {run} completed all {point.request.rounds} rounds: nothing to resume")
    state = point.state
    if state is not None:
        # The wall-time budget counts from the resume; the unfinished round reads the reply cache.
        state = state.model_copy(update={"started_at": None, "resumed": True})
    req = point.request.model_copy(update={"state": state})
    base = run.split("-resumed-")[0]
    n = 1
    while True:
        new_id = f"{base}-resumed-{n}"
        try:
            await client.get_workflow_handle(new_id).describe()
        except Exception:  # noqa: BLE001 - not found: free
            return req, new_id
        n += 1


def command_started_at() -> float:
    """When this process started (epoch seconds): a `--max-wall-time` counts from the command's start.
    From /proc (its start in clock ticks against the uptime); where that is missing, or says the
    process is older than a command just begun (kopt's main called inside a longer-lived process), now."""
    now = time.time()
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0 <= age <= 30 else now


async def run_optimization(req: OptimizeRequest | None, kernel_dir: Path | None, report_dir: Path | None,
                           settings: Settings, out=sys.stdout, resume: str | None = None, rerun: bool = False,
                           finished: dict[str, int] | None = None, gpus: str = "all",
                           started: float | None = None) -> int:
    """Start (or attach to) a run and follow it to its report; `resume`: instead, continue that run
    from its last finished round in a new run (kopt resume), paid LLM replies reused. The same
    request again: attaches while the run is live, says how it ended once it has (`rerun`: starts a
    fresh run under a new id instead). `finished["code"]` is set to the command's exit code once the
    run's report is written: a signal after that (while workers and server shut down) keeps it.
    `started`: when the command started (epoch seconds; default now): a wall-time budget counts from it,
    less CLOSE_RESERVE_S for what comes after the workflow (the report, the shutdown)."""
    finished = {} if finished is None else finished
    started = time.time() if started is None else started
    from frontend import charts

    threading.Thread(target=charts.warm, name="kopt-warm-charts", daemon=True).start()
    from frontend.client import connect
    from frontend.server import attach_home
    from frontend.workers import running_workers

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    async with AsyncExitStack() as stack:
        ui_url = None
        if settings.temporal_address:
            address = settings.temporal_address
            workers_plan = None  # production: the cluster's workers serve the queues
        else:
            workers_plan = _local_worker_plan(req, gpus) if req is not None else None  # refused before any server
            server = attach_home(settings, say=lambda text: print(f"kopt: {text}", file=sys.stderr))
            stack.callback(server.release)
            address, ui_url = server.address, server.ui_url
            say(f"Temporal dev server {address} (database {settings.server_db}"
                f"{'' if server.started else ', already running'}); Web UI: {ui_url}")
        client = await connect(address, settings)
        wf_id = workflow_id(req) if req is not None else ""
        if req is not None:
            wf_id, ended = await _fresh_or_ended(client, wf_id, rerun)
            if ended is not None:
                outcome = await _outcome_of(client, wf_id, ended)
                return _say_ended(ended, wf_id, report_dir or settings.home / "reports" / wf_id, say, outcome)
        if resume is not None:
            req, wf_id = await resume_point(client, settings, resume, serve=workers_plan is None and
                                            not settings.temporal_address)
            done = req.state.rounds[-1].round if req.state and req.state.rounds else 0
            say(f"resuming {resume} after round {done} as {wf_id}")
            if not settings.temporal_address:
                workers_plan = _local_worker_plan(req, gpus)
        if workers_plan is not None:
            if workers_plan.gpu_indices:
                say(f"GPUs {', '.join(map(str, workers_plan.gpu_indices))} ({workers_plan.gpu_class}) judge "
                    f"candidates side by side; {req.candidates_per_round} candidate(s) a round")
            await stack.enter_async_context(running_workers(client, settings, workers_plan))
        if req.budgets.max_wall_time_s is not None:  # the server's and workers' start-up and the report count
            req = req.model_copy(update={"budgets": req.budgets.model_copy(
                update={"wall_time_from": started - CLOSE_RESERVE_S})})
        handle = await start_run(client, req, wf_id)
        run_id = handle.result_run_id or ""
        say(f"run {wf_id} (Temporal run {run_id}): {req.package.spec.name} on {req.target}"
            f"{' / ' + req.gpu_class if req.gpu_class else ''}, {req.rounds} rounds, provider {req.provider}")
        if ui_url:
            say(f"  history: {ui_url}/namespaces/{settings.namespace}/workflows/{wf_id}")
        say(f"  objective: {objective_line(req)}")
        result = await _follow(handle, say)
        if result.status != "completed":
            raise RunFailed(f"run {wf_id}: {result.reason}")
        report = build_report(wf_id, run_id, req, result, ui_url)
        target_dir = report_dir or settings.home / "reports" / wf_id
        name = req.package.spec.sources[req.target]
        best_source = result.best.source if result.best else req.baseline.source
        write_report(target_dir, report, req.baseline.source, best_source, name)
        best = result.best
        made = "shape-specialized" if result.specialized and result.specialized.accepted else f"round {best.round}"
        say(f"best: {best.candidate_id} ({made}) {'workload-weighted' if req.workload else 'geomean'} "
            f"speedup {best.speedup_geomean:.3f}x over the baseline")
        sp = result.specialized
        if sp is not None:
            say("shape-specialized: " + (f"{sp.speedup_geomean:.3f}x, " if sp.speedup_geomean is not None else "")
                + ("kept as the best" if sp.accepted else f"not kept ({sp.reason})"))
        h = result.holdout
        if h is not None:
            shown = (f"{h.speedup_geomean:.3f}x ({h.verdict})" if h.speedup_geomean is not None
                     else h.reason or ("correct" if h.correct else "not correct"))  # fmt: skip
            say(f"held-out shapes {'; '.join(h.shapes)}: {shown}"
                + (" -- OVERFIT (report: Held-out shapes)" if h.overfit else "")
                + (f" -- slower at {', '.join(h.foretold)}, as on the search shapes" if h.foretold else ""))
        say(f"report: {target_dir / 'report.json'} and report.md")
        finished["code"] = exits.FAILED if result.llm_stopped else exits.OK
        if result.llm_stopped:  # the report holds the best so far; the reason needs a person
            raise RunFailed(f"run {wf_id} stopped early: {result.stop_reason}")
    return 0


async def start_run(client, req: OptimizeRequest, wf_id: str):
    """Start (or attach to) the run, with typed search attributes where the namespace has them."""
    attrs = TypedSearchAttributes([
        SearchAttributePair(KERNEL_KEY, req.package.spec.name),
        SearchAttributePair(TARGET_KEY, req.target),
        SearchAttributePair(ROUND_KEY, 0),
        SearchAttributePair(BEST_KEY, 1.0),
    ])
    spec = req.package.spec
    summary = (f"kopt: {spec.name} on {req.target}{f' ({req.gpu_class})' if req.gpu_class else ''}, "
               f"{req.rounds} rounds, provider {req.provider}")  # the Web UI's one line for the run
    kwargs = dict(id=wf_id, task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult, static_summary=summary,
                  id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                  id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)
    try:
        return await client.start_workflow(OptimizeKernel.run, req, search_attributes=attrs, **kwargs)
    except RPCError as exc:
        if "search attribute" not in str(exc).lower():
            raise
        log.warning("search_attributes_unregistered", hint="register KoptKernel, KoptTarget, KoptRound, "
                    "KoptBestSpeedup on the namespace for `kopt runs`")
        return await client.start_workflow(OptimizeKernel.run, req, **kwargs)


async def _fresh_or_ended(client, wf_id: str, rerun: bool):
    """(id to start or attach to, None), or (id, description) of the run this request already ran to
    its end; `rerun`: the first free id wf_id-rerun-N instead."""
    from temporalio.client import WorkflowExecutionStatus

    async def closed(run: str):
        try:
            desc = await client.get_workflow_handle(run).describe()
        except RPCError:
            return None  # no such run: free
        return None if desc.status == WorkflowExecutionStatus.RUNNING else desc

    desc = await closed(wf_id)
    if desc is None or not rerun:
        return wf_id, desc
    n = 1
    while True:
        candidate = f"{wf_id}-rerun-{n}"
        try:
            await client.get_workflow_handle(candidate).describe()
        except RPCError:
            return candidate, None
        n += 1


async def _outcome_of(client, wf_id: str, desc) -> OptimizeResult | None:
    """The result of a run that completed as a workflow (which it does when its baseline failed too:
    the failure is in the result), or None."""
    from temporalio.client import WorkflowExecutionStatus

    if desc.status != WorkflowExecutionStatus.COMPLETED:
        return None
    try:
        return await client.get_workflow_handle(wf_id, result_type=OptimizeResult).result()
    except Exception:  # noqa: BLE001 - an older result that no longer parses: the status alone speaks
        return None


def _say_ended(desc, wf_id: str, report_dir: Path, say, outcome: OptimizeResult | None = None) -> int:
    failed = outcome is not None and outcome.status != "completed"  # the workflow ended, the run failed
    state = outcome.status.replace("_", " ") if failed else desc.status.name.lower() if desc.status else "closed"
    when = desc.close_time.strftime("%Y-%m-%d %H:%M:%S UTC") if desc.close_time else "earlier"
    say(f"run {wf_id} already ran with these arguments: {state} at {when}"
        + (f": {outcome.reason}" if failed and outcome.reason else ""))
    report = report_dir / "report.md"
    if report.is_file():
        say(f"report: {report}")
    say(f"`kopt status {wf_id}` summarizes it; --rerun starts a fresh run"
        + ("" if state == "completed" else " once what failed is fixed" if failed
           else f"; `kopt resume {wf_id}` continues it from its last finished round"))  # fmt: skip
    if state != "completed":
        raise RunFailed(f"run {wf_id} ended {state}")
    return 0


def local_gpu_indices(gpu_class: str | None, gpus: str = "all") -> list[int]:
    """The local GPUs (nvidia-smi indices) of `gpu_class` that serve an embedded campaign: all of them,
    or the first N (`gpus`: "all" or a count), among those CUDA_VISIBLE_DEVICES names where it is set.
    UsageError where there is none or too few."""
    from gpu_worker.device import local_gpus, visible_gpus

    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    found = [(g.index, g.gpu_class) for g in visible_gpus(local_gpus(), shown)]
    match = [idx for idx, cls in found if cls == gpu_class]
    if not match:
        have = ", ".join(cls for _, cls in found) or "no GPU"
        if shown is not None:
            have += f" that CUDA_VISIBLE_DEVICES={shown!r} shows"
        raise UsageError(f"--target cuda --gpu-class {gpu_class}: this machine has {have}; run on a "
                         f"{gpu_class} machine, pass its class, or set KOPT_TEMPORAL_ADDRESS to use a "
                         f"cluster with GPU workers")
    if gpus == "all":
        return match
    if not gpus.isdigit() or not 1 <= int(gpus) <= len(match):
        raise UsageError(f"--gpus must be 'all' or a count from 1 to {len(match)} (the {gpu_class} GPUs here), "
                         f"got {gpus!r}")
    return match[: int(gpus)]


def _local_worker_plan(req: OptimizeRequest, gpus: str = "all"):
    from frontend.workers import WorkerPlan

    toolchain = build.detect_toolchain(req.target)
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=(toolchain,), exec_target=req.target)
    if req.target == "cuda":
        indices = local_gpu_indices(req.gpu_class, gpus)
        plan.gpu_class = req.gpu_class
        if len(indices) == 1:
            plan.gpu_index = indices[0]
        else:  # an exec slot per GPU (docs/decisions/0038-every-local-gpu.md)
            plan.gpu_indices = tuple(indices)
    return plan


async def _follow(handle, say) -> OptimizeResult:
    """Print the workflow's progress events until it finishes."""
    seen = 0

    async def poll() -> None:
        nonlocal seen
        try:
            progress: Progress = await handle.query(OptimizeKernel.progress)
        except Exception:  # noqa: BLE001 - a query can fail while a worker restarts; the result decides
            return
        fresh = progress.event_total - seen
        for event in progress.events[-fresh:] if fresh > 0 else []:
            say(f"  {event}")
        seen = progress.event_total

    result_task = asyncio.ensure_future(handle.result())
    while not result_task.done():
        await poll()
        await asyncio.wait([result_task], timeout=0.5)
    await poll()
    return result_task.result()
