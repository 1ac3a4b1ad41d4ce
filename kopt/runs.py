"""`kopt optimize`: validate input, bring up the embedded default, run the workflow, write the report."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from temporalio.common import WorkflowIDConflictPolicy

from kopt import build, queues
from kopt.artifacts import ArtifactStore
from kopt.candidates import candidate_id
from kopt.errors import RunFailed, UsageError
from kopt.models import Candidate, OptimizeRequest, OptimizeResult, PackageRef, Progress
from kopt.package import PackageError, load_spec, read_tunables
from kopt.report import build_report, write_report
from kopt.settings import Settings

PROVIDERS = ("offline",)


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
        if gpu_class not in queues.KNOWN_GPU_CLASSES:
            raise UsageError(f"unknown GPU class {gpu_class!r}; known: {', '.join(queues.KNOWN_GPU_CLASSES)}")
    try:
        spec = load_spec(kernel_dir)
    except PackageError as exc:
        raise UsageError(str(exc)) from None
    if target not in spec.targets:
        raise UsageError(f"{Path(kernel_dir) / 'kernel.toml'}: field 'targets': {spec.name} has no {target!r} target "
                         f"(it has {', '.join(spec.targets)})")
    toolchain = build.detect_toolchain(target)
    if toolchain is None:
        raise UsageError("no CUDA compiler: nvcc not found on PATH or in /usr/local/cuda/bin" if target == "cuda"
                         else "no C++ compiler: g++ not found on PATH")
    source = (Path(kernel_dir) / spec.sources[target]).read_text()
    flags = list(spec.build[target].flags) if target in spec.build else []
    tunables = read_tunables(source, [t.name for t in spec.tunables_for(target)])
    store = ArtifactStore(settings.artifacts)
    package = PackageRef(spec=spec, files=store.put_tree(Path(kernel_dir)),
                         baseline_sources={t: (Path(kernel_dir) / spec.sources[t]).read_text() for t in spec.targets})
    baseline = Candidate(id=candidate_id(source, flags, toolchain.name), source=source, flags=flags,
                         tunables=tunables, origin="baseline")
    return OptimizeRequest(package=package, target=target, gpu_class=gpu_class, toolchain=toolchain.name,
                           baseline=baseline, rounds=rounds, provider=provider, seed=seed)


def workflow_id(req: OptimizeRequest) -> str:
    """Deterministic per request: starting the same run again attaches to it while it is running."""
    digest = hashlib.sha256(req.model_dump_json().encode()).hexdigest()[:10]
    return f"kopt-{req.package.spec.name}-{req.target}-{digest}"


async def run_optimization(req: OptimizeRequest, kernel_dir: Path, report_dir: Path | None,
                           settings: Settings, out=sys.stdout) -> int:
    from kopt.client import connect
    from kopt.server import start_dev_server
    from kopt.workers import make_workers

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    async with AsyncExitStack() as stack:
        ui_url = None
        if settings.temporal_address:
            address = settings.temporal_address
            workers_plan = None  # production: the cluster's workers serve the queues
        else:
            server = start_dev_server(settings.server_db, settings.server_port, settings.ui_port)
            stack.callback(server.stop)
            address, ui_url = server.address, server.ui_url
            say(f"Temporal dev server {address} (database {settings.server_db}); Web UI: {ui_url}")
            workers_plan = _local_worker_plan(req)
        client = await connect(address, settings)
        if workers_plan is not None:
            for worker in make_workers(client, settings, workers_plan):
                await stack.enter_async_context(worker)
        wf_id = workflow_id(req)
        handle = await client.start_workflow(
            queues.WORKFLOW_NAME, req, id=wf_id, task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        run_id = handle.result_run_id or ""
        say(f"run {wf_id} (Temporal run {run_id}): {req.package.spec.name} on {req.target}"
            f"{' / ' + req.gpu_class if req.gpu_class else ''}, {req.rounds} rounds, provider {req.provider}")
        if ui_url:
            say(f"  history: {ui_url}/namespaces/{settings.namespace}/workflows/{wf_id}")
        result = await _follow(handle, say)
        if result.status != "completed":
            raise RunFailed(f"run {wf_id}: {result.reason}")
        report = build_report(wf_id, run_id, req, result, ui_url)
        target_dir = report_dir or settings.home / "reports" / wf_id
        name = req.package.spec.sources[req.target]
        write_report(target_dir, report, req.baseline.source, result.best.source if result.best else req.baseline.source,
                     name)
        best = result.best
        say(f"best: {best.candidate_id} (round {best.round}) geomean speedup {best.speedup_geomean:.3f}x over "
            f"the baseline")
        say(f"report: {target_dir / 'report.json'} and report.md")
    return 0


def _local_worker_plan(req: OptimizeRequest):
    from gpu_worker.device import local_gpus
    from kopt.workers import WorkerPlan

    toolchain = build.detect_toolchain(req.target)
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=(toolchain,), exec_target=req.target)
    if req.target == "cuda":
        gpus = [(idx, cls) for idx, _name, cls in local_gpus()]
        match = [idx for idx, cls in gpus if cls == req.gpu_class]
        if not match:
            found = ", ".join(cls for _, cls in gpus) or "no GPU"
            raise UsageError(f"--target cuda --gpu-class {req.gpu_class}: this machine has {found}; run on a "
                             f"{req.gpu_class} machine, pass its class, or set KOPT_TEMPORAL_ADDRESS to use a "
                             f"cluster with GPU workers")
        plan.gpu_class, plan.gpu_index = req.gpu_class, match[0]
    return plan


async def _follow(handle, say) -> OptimizeResult:
    """Print the workflow's progress events until it finishes."""
    seen = 0

    async def poll() -> None:
        nonlocal seen
        try:
            progress: Progress = await handle.query("progress", result_type=Progress)
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
