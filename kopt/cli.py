"""The `kopt` command: optimize, worker, server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import structlog

from kopt import logs, queues
from kopt.errors import RunFailed, UsageError, failure_chain
from kopt.settings import Settings

log = structlog.get_logger("kopt")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    settings = Settings()
    following = args.command in ("optimize", "resume")
    logs.configure(settings.log_format, "warning" if following else settings.log_level)
    if following:  # an agent attempt that failed is in the run's events and history: no traceback here
        logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
    try:
        return asyncio.run(args.func(args, settings))
    except UsageError as exc:
        print(f"kopt: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as exc:
        print(f"kopt: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("kopt: interrupted; the run is durable and resumes when the same command is started again",
              file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - infrastructure failure: one line, non-zero
        if type(exc).__name__ == "WorkflowFailureError":
            print(f"kopt: run failed: {failure_chain(exc)}", file=sys.stderr)
        else:
            print(f"kopt: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kopt", description="Durable, agent-driven kernel optimization.")
    sub = parser.add_subparsers(dest="command", required=True)

    opt = sub.add_parser("optimize", help="optimize a kernel package")
    opt.add_argument("kernel_dir", type=Path)
    opt.add_argument("--target", default="cpu", help="cpu or cuda (default: cpu)")
    opt.add_argument("--gpu-class", default=None, help=f"GPU class for cuda (default: {queues.DEFAULT_GPU_CLASS})")
    opt.add_argument("--rounds", type=int, default=5)
    opt.add_argument("--provider", default="offline")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--report-dir", type=Path, default=None, help="default: $KOPT_HOME/reports/<run id>")
    opt.add_argument("--model", default=None, help="provider openai: model (default KOPT_OPENAI_MODEL)")
    opt.add_argument("--candidates", type=int, default=1, help="candidates per round, evaluated in parallel")
    opt.add_argument("--single-agent", action="store_true", help="one combined agent instead of the team")
    opt.add_argument("--patience", type=int, default=None, help="stop after K rounds without improvement")
    opt.add_argument("--min-gain", type=float, default=None,
                     help="a new best must beat the best's geomean by this fraction, and its A/B interval must "
                          "clear 1 (default 0.02)")  # fmt: skip
    opt.add_argument("--max-cost", type=float, default=None, help="stop at this LLM cost (USD)")
    opt.add_argument("--max-tokens", type=int, default=None, help="stop at this many LLM tokens")
    opt.add_argument("--max-gpu-seconds", type=float, default=None, help="stop at this much device time")
    opt.add_argument("--max-wall-time", type=float, default=None, help="stop after this many seconds")
    opt.add_argument("--approve", action="store_true", help="wait for `kopt approve` before accepting a new best")
    opt.add_argument("--continue-every", type=int, default=50, help="rounds per history segment")
    opt.set_defaults(func=_cmd_optimize)

    res = sub.add_parser("resume", help="continue a run that failed or was cancelled, from its last finished "
                                          "round (LLM replies it paid for are reused)")
    res.add_argument("run")
    res.add_argument("--report-dir", type=Path, default=None)
    res.set_defaults(func=_cmd_resume)

    ev = sub.add_parser("evaluate", help="test and profile one candidate against the package baseline (no agents)")
    ev.add_argument("kernel_dir", type=Path)
    ev.add_argument("--candidate", type=Path, required=True)
    ev.add_argument("--target", default=None, help="cpu or cuda (default: from the candidate's suffix)")
    ev.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    ev.set_defaults(func=_cmd_evaluate)

    runs = sub.add_parser("runs", help="list runs (kernel, status, round, best speedup)")
    runs.add_argument("--limit", type=int, default=50)
    runs.add_argument("--json", action="store_true")
    runs.set_defaults(func=_cmd_inspect, action="runs")
    hist = sub.add_parser("history", help="every round of a run, from workflow history alone")
    hist.add_argument("run")
    hist.add_argument("--full", action="store_true", help="print every prompt and response in full")
    hist.set_defaults(func=_cmd_inspect, action="history")
    for name, text in (("status", "a run's progress"), ("watch", "follow a run live"),
                       ("replay", "replay a run's histories against the current workflow code"),
                       ("cancel", "cancel a run (running kernels are killed)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("run")
        p.set_defaults(func=_cmd_inspect, action=name)
    exp = sub.add_parser("export", help="export a run's history as json, md or html")
    exp.add_argument("run")
    exp.add_argument("--format", default="json", choices=["json", "md", "html"])
    exp.add_argument("--output", type=Path, default=None)
    exp.set_defaults(func=_cmd_inspect, action="export")
    apr = sub.add_parser("approve", help="accept (or --reject) a candidate a run waits for")
    apr.add_argument("run")
    apr.add_argument("candidate")
    apr.add_argument("--reject", action="store_true")
    apr.set_defaults(func=_cmd_inspect, action="approve")

    wk = sub.add_parser("worker", help="run a worker of one role against a Temporal server")
    wk.add_argument("--role", required=True, choices=["workflows", "agents", "build", "exec"])
    wk.add_argument("--toolchain", action="append", help="build role: toolchain name(s); default all local ones")
    wk.add_argument("--target", default="cpu", help="exec role: cpu or cuda")
    wk.add_argument("--gpu-class", default=None, help="exec role, cuda: default from the device")
    wk.add_argument("--gpu-index", type=int, default=0, help="exec role, cuda: which local GPU")
    wk.set_defaults(func=_cmd_worker)

    srv = sub.add_parser("server", help="run the embedded Temporal dev server in the foreground")
    srv.set_defaults(func=_cmd_server)
    return parser


# ------------------------------------------------------------------------------------------ optimize


async def _cmd_optimize(args: argparse.Namespace, settings: Settings) -> int:
    from kopt.runs import apply_run_options, prepare_request, run_optimization

    req = prepare_request(args.kernel_dir, args.target, args.gpu_class, args.rounds, args.provider, args.seed,
                          settings)
    req = apply_run_options(req, args, settings)
    return await run_optimization(req, args.kernel_dir, args.report_dir, settings)


async def _cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    from kopt.runs import run_optimization

    return await run_optimization(None, None, args.report_dir, settings, resume=args.run)


async def _cmd_evaluate(args: argparse.Namespace, settings: Settings) -> int:
    from kopt.evaluate import evaluate

    return await evaluate(args.kernel_dir, args.candidate, args.target, args.json, settings)


# ------------------------------------------------------------------------------------------ inspect


async def _cmd_inspect(args: argparse.Namespace, settings: Settings) -> int:
    from kopt import inspect

    async with inspect.reader(settings) as client:
        if args.action == "runs":
            rows = await inspect.list_runs(client, args.limit, out=sys.stderr if args.json else sys.stdout)
            if args.json:
                print(inspect.dump_json(rows))
        elif args.action == "status":
            await inspect.status(client, args.run)
        elif args.action == "watch":
            await inspect.watch(client, args.run)
        elif args.action == "history":
            print(inspect.history_text(await inspect.view(client, args.run), full=args.full))
        elif args.action == "export":
            text = inspect.export(await inspect.view(client, args.run), args.format)
            if args.output:
                args.output.write_text(text)
            else:
                print(text)
        elif args.action == "replay":
            return await inspect.replay(client, args.run)
        elif args.action == "approve":
            await inspect.approve(client, args.run, args.candidate, not args.reject)
        elif args.action == "cancel":
            await inspect.cancel(client, args.run)
    return EXIT_OK


# ------------------------------------------------------------------------------------------ worker


async def _cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from gpu_worker.device import local_gpus
    from kopt.client import connect
    from kopt.workers import WorkerPlan, make_workers, toolchains_for

    plan = WorkerPlan(roles=(args.role,))
    if args.role == "build":
        try:
            plan.toolchains = toolchains_for(args.toolchain)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not plan.toolchains:
            raise UsageError("no toolchain found (g++ or nvcc)")
    if args.role == "exec":
        if args.target not in ("cpu", "cuda"):
            raise UsageError(f"unknown target {args.target!r}; use cpu or cuda")
        plan.exec_target = args.target
        if args.target == "cuda":
            gpus = {idx: cls for idx, _name, cls in local_gpus()}
            if args.gpu_index not in gpus:
                raise UsageError(f"no local GPU with index {args.gpu_index} (found {sorted(gpus) or 'none'})")
            plan.gpu_index, plan.gpu_class = args.gpu_index, args.gpu_class or gpus[args.gpu_index]
            if plan.gpu_class != gpus[args.gpu_index]:
                raise UsageError(f"GPU {args.gpu_index} is a {gpus[args.gpu_index]}, not a {plan.gpu_class}")
    address = settings.temporal_address or f"127.0.0.1:{settings.server_port}"
    client = await connect(address, settings)
    workers = make_workers(client, settings, plan)
    log.info("worker_started", role=args.role, address=address, queues=[w.task_queue for w in workers])
    async with AsyncExitStack() as stack:
        for w in workers:
            await stack.enter_async_context(w)
        await _wait_for_signal()
    return EXIT_OK


# ------------------------------------------------------------------------------------------ server


async def _cmd_server(args: argparse.Namespace, settings: Settings) -> int:
    from kopt.server import start_dev_server

    server = start_dev_server(settings.server_db, settings.server_port, settings.ui_port)
    print(f"Temporal dev server at {server.address}; Web UI {server.ui_url}; database {settings.server_db}", flush=True)
    try:
        await _wait_for_signal()
    finally:
        server.stop()
    return EXIT_OK


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


if __name__ == "__main__":
    sys.exit(main())
