"""The `kopt` command: optimize, worker, server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import signal
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import structlog
from pydantic import ValidationError

from frontend import exits
from frontend.server import ServerError
from gpu_worker.protocol import TIME_CAP_S
from kopt import logs, queues
from kopt.agent_models import PROVIDERS
from kopt.errors import RunFailed, UsageError, failure_chain
from kopt.settings import Settings

log = structlog.get_logger("kopt")

TARGETS = ("cpu", "cuda")
WITHOUT_HOME = ("evaluate", "verify", "workload")  # commands that neither start nor read a server
OVERLAPS = ("skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other", "allow_all")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"kopt: error: {setting_error(exc)}", file=sys.stderr)
        return exits.USAGE
    if args.command not in WITHOUT_HOME:
        try:
            settings.home.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"kopt: error: KOPT_HOME={str(settings.home)!r}: cannot create it: {exc.strerror}", file=sys.stderr)
            return exits.USAGE
    following = args.command in ("optimize", "resume")
    logs.configure(settings.log_format, "warning" if following else settings.log_level)
    if following:  # an agent attempt that failed is in the run's events and history: no traceback here
        logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
    received = _terminate_like_interrupt()
    try:
        return asyncio.run(args.func(args, settings))
    except UsageError as exc:
        print(f"kopt: error: {exc}", file=sys.stderr)
        return exits.USAGE
    except RunFailed as exc:
        print(f"kopt: {exc}", file=sys.stderr)
        return exits.FAILED
    except KeyboardInterrupt:
        how = signal.Signals(received[-1]).name if received else "interrupted"
        ended = getattr(args, "finished", {}).get("code")
        if ended is not None:  # after the run's last word (its report): the run's own exit code
            print(f"kopt: {how} after the run ended (workers stopped with this process)", file=sys.stderr)
            return ended
        if following:
            print(f"kopt: {how}; the run is durable: it goes on when the same command is started again "
                  "(workers stopped with this process)", file=sys.stderr)  # fmt: skip
        else:
            print(f"kopt: {how}", file=sys.stderr)
        return 128 + (received[-1] if received else signal.SIGINT)
    except ServerError as exc:
        print(f"kopt: error: {exc}", file=sys.stderr)
        return exits.FAILED
    except Exception as exc:  # noqa: BLE001 - infrastructure failure: one line, non-zero
        if type(exc).__name__ == "WorkflowFailureError":
            print(f"kopt: run failed: {failure_chain(exc)}", file=sys.stderr)
        else:
            print(f"kopt: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exits.FAILED


def entry() -> None:
    """The `kopt` console script: main(), then out without interpreter finalization (where the
    Temporal client's native threads could still call into Python and abort the process)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def setting_error(exc: ValidationError) -> str:
    """A KOPT_* variable that does not parse, named as the user set it."""
    first = exc.errors()[0]
    name = "KOPT_" + "_".join(str(p) for p in first["loc"]).upper()
    value = os.environ.get(name)
    msg = first["msg"].removeprefix("Value error, ")
    return f"{name}={value!r}: {msg}" if value is not None else f"{name}: {msg}"


def _terminate_like_interrupt() -> list[int]:
    """SIGTERM and SIGHUP (a CI runner cancelling a job, `timeout`, a closed terminal) end a command the
    way Ctrl-C does: asyncio cancels it, its cleanup runs (workers stop, the server is released), and
    it exits 128+signal with one line. The list gets the signal's number."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        signal.getsignal(signal.SIGINT)(signum, frame)  # asyncio.run's own Ctrl-C handler, once it runs

    # A job started with `&` by a script inherits SIGINT ignored, and asyncio.run then installs no
    # handler: give it the default one to replace.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    return received


class _Parser(argparse.ArgumentParser):
    """Usage errors in kopt's one-line form (exit 2), like every other bad input; no abbreviated options
    (`--round 3` was taken as `--rounds 3`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(exits.USAGE, f"kopt: error: {message} (see `{self.prog} --help`)\n")


TIME_CAP_HELP = (f"sampling time per shape and dtype and side of an A/B (default: "
                 f"{', '.join(f'{s:g} on {t}' for t, s in TIME_CAP_S.items())}); "
                 "shorter is faster and noisier: the verdict's interval says how much")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kopt", description="Durable, agent-driven kernel optimization.")
    sub = parser.add_subparsers(dest="command", required=True)

    opt = sub.add_parser("optimize", help="optimize a kernel package")
    opt.add_argument("kernel_dir", type=Path)
    opt.add_argument("--target", default="cpu", choices=TARGETS, help="default: cpu")
    opt.add_argument("--gpu-class", default=None, help=f"GPU class for cuda (default: {queues.DEFAULT_GPU_CLASS})")
    opt.add_argument("--rounds", type=int, default=5)
    opt.add_argument("--provider", default="offline", choices=PROVIDERS)
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--report-dir", type=Path, default=None, help="default: $KOPT_HOME/reports/<run id>")
    opt.add_argument("--model", default=None, help="provider openai: model (default KOPT_OPENAI_MODEL)")
    opt.add_argument("--candidates", type=int, default=None,
                     help="candidates per round, evaluated in parallel (default with --target cuda: two per local "
                          "GPU in use, offline, one per GPU with --lockstep or an LLM provider; else 1)")
    opt.add_argument("--lockstep", action="store_true",
                     help="with several candidates a round (offline provider): judge a round's candidates together "
                          "and compare only the fastest with the best; the default judges each as soon as it "
                          "finishes and gives its GPU the next proposal (decisions then follow finishing order)")
    opt.add_argument("--gpus", default="all", help="--target cuda, local workers: how many of this machine's GPUs "
                                                    "of the class judge candidates, one exec worker each (a count, "
                                                    "or all; default all), among those CUDA_VISIBLE_DEVICES names "
                                                    "where it is set")
    opt.add_argument("--single-agent", action="store_true", help="one combined agent instead of the team")
    opt.add_argument("--patience", type=int, default=None, help="stop after K rounds without improvement")
    opt.add_argument("--min-gain", type=float, default=None,
                     help="a new best must beat the best's geomean by this fraction, and its A/B interval must "
                          "clear 1 (default 0.02)")  # fmt: skip
    opt.add_argument("--max-cost", type=float, default=None, help="stop at this LLM cost (USD)")
    opt.add_argument("--max-tokens", type=int, default=None, help="stop at this many LLM tokens")
    opt.add_argument("--max-gpu-seconds", type=float, default=None, help="stop at this much device time")
    opt.add_argument("--max-wall-time", type=float, default=None,
                     help="end within this many seconds of the command's start")
    opt.add_argument("--approve", action="store_true", help="wait for `kopt approve` before accepting a new best")
    opt.add_argument("--allow-regressions", action="store_true",
                     help="accept a new best even where it is statistically slower than the baseline at some "
                          "(shape, dtype) beyond 2%% (refused by default; the report lists every such shape)")
    opt.add_argument("--workload", type=Path, default=None, metavar="FILE|bench",
                     help="time and optimize for the shapes a model really calls the kernel at, by weight "
                          "(TOML or CSV; `kopt workload from-trace` writes one): the objective is the "
                          "workload-weighted time instead of the geomean over the bench shapes. Default: "
                          "the workload the package serves on the target (kernel.toml [workloads]), if it "
                          "declares one; `bench`: the bench shapes")  # fmt: skip
    opt.add_argument("--holdout", type=int, default=2, metavar="N",
                     help="judge the best, after the last round, on shapes the search never saw: the package's "
                          "[shapes.<target>] holdout list, else N shapes derived from the bench shapes by the "
                          "seed, or with --workload N of its shapes kept out of the search (default 2; 0: none)")  # fmt: skip
    opt.add_argument("--time-cap", type=_seconds, default=None, metavar="SECONDS", help=TIME_CAP_HELP)
    opt.add_argument("--continue-every", type=int, default=50, help="rounds per history segment")
    opt.add_argument("--rerun", action="store_true",
                     help="start a fresh run even if one with these arguments already ended (new run id)")
    opt.set_defaults(func=_cmd_optimize)

    res = sub.add_parser("resume", help="continue a run that failed or was cancelled, from its last finished "
                                          "round (LLM replies it paid for are reused)")
    res.add_argument("run")
    res.add_argument("--report-dir", type=Path, default=None)
    res.set_defaults(func=_cmd_resume)

    ev = sub.add_parser("evaluate", help="test and profile one candidate against the package baseline (no agents)")
    ev.add_argument("kernel_dir", type=Path)
    ev.add_argument("--candidate", type=Path, required=True)
    ev.add_argument("--target", default=None, choices=TARGETS, help="default: from the candidate's suffix")
    ev.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    ev.add_argument("--flags", type=_flag_list, default=None, metavar="'FLAG ...'",
                    help="the candidate's compiler flags instead of the package's, e.g. --flags='-O3 -funroll-loops'")
    ev.add_argument("--no-holdout", dest="holdout", action="store_false",
                    help="leave out the package's held-out shapes (tested and timed by default, as by verify)")
    ev.add_argument("--time-cap", type=_seconds, default=None, metavar="SECONDS", help=TIME_CAP_HELP)
    ev.set_defaults(func=_cmd_evaluate)

    ver = sub.add_parser("verify", help="the CI regression gate: judge a candidate against the baseline; exit 0 pass, "
                                        "1 wrong, 2 bad input, 3 slower, 4 infrastructure (no Temporal needed)")
    ver.add_argument("kernel_dir", type=Path)
    ver.add_argument("--candidate", type=Path, required=True)
    ver.add_argument("--target", default=None, choices=TARGETS, help="default: from the candidate's suffix")
    ver.add_argument("--flags", type=_flag_list, default=None, metavar="'FLAG ...'",
                     help="the candidate's compiler flags instead of the package's")
    ver.add_argument("--baseline", type=Path, default=None,
                     help="the source to compare with (default: the package's own), e.g. the kernel on main")
    ver.add_argument("--junit", type=Path, default=None, help="write a JUnit XML report here")
    ver.add_argument("--json", type=Path, default=None, help="write the verdict as JSON here")
    ver.add_argument("--max-slowdown", type=float, default=0.02,
                     help="a shape fails when its whole 95%% interval is slower than this fraction (default 0.02)")
    ver.add_argument("--no-holdout", dest="holdout", action="store_false",
                     help="leave out the package's held-out shapes (tested and timed by default)")
    ver.add_argument("--time-cap", type=_seconds, default=None, metavar="SECONDS", help=TIME_CAP_HELP)
    ver.set_defaults(func=_cmd_verify)

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
    exp.add_argument("--torch-op", type=Path, default=None, metavar="DIR",
                     help="instead: write the run's best as a torch custom op kopt::<kernel> (extension built with "
                          "ninja on import, fake implementation for torch.compile, and a test against the reference)")
    exp.set_defaults(func=_cmd_inspect, action="export")
    apr = sub.add_parser("approve", help="accept (or --reject) a candidate a run waits for")
    apr.add_argument("run")
    apr.add_argument("candidate")
    apr.add_argument("--reject", action="store_true")
    apr.set_defaults(func=_cmd_inspect, action="approve")

    sch = sub.add_parser("schedule", help="nightly campaigns on Temporal Schedules: re-verify a run's best on "
                                          "every GPU class, or re-run the optimizer with a budget")
    sch_sub = sch.add_subparsers(dest="schedule_action", required=True)
    mk = sch_sub.add_parser("create", help="a schedule for a completed run")
    mk.add_argument("name")
    mk.add_argument("--run", required=True, help="the completed run whose best (or package) to schedule")
    when = mk.add_mutually_exclusive_group(required=True)
    when.add_argument("--every", type=_duration, help="interval: 90s, 30m, 24h, 7d")
    when.add_argument("--cron", help="a cron expression, e.g. '0 2 * * *' (02:00 UTC)")
    mk.add_argument("--gpu-class", action="append", default=[], dest="gpu_classes",
                    help="re-verify on this class too (repeatable; default: the run's class)")
    mk.add_argument("--optimize-rounds", type=int, default=None,
                    help="instead of re-verifying, run the optimizer again for this many rounds")
    mk.add_argument("--overlap", default="skip", choices=OVERLAPS,
                    help="when the previous action still runs (default skip)")
    mk.add_argument("--catchup-window", type=_duration, default="1h",
                    help="how late a missed action may still run after the server was down (default 1h)")
    mk.add_argument("--paused", action="store_true", help="create it paused")
    sch_sub.add_parser("list", help="kopt's schedules: paused, next run, runs so far")
    for name, text in (("pause", "stop firing"), ("unpause", "fire again"), ("trigger", "run its action now"),
                       ("delete", "remove it (running actions go on)")):
        sch_sub.add_parser(name, help=text).add_argument("name")
    sch.set_defaults(func=_cmd_schedule)

    wl = sub.add_parser("workload", help="workloads: the shapes a model calls a kernel at, by weight")
    wl_sub = wl.add_subparsers(dest="workload_action", required=True)
    ft = wl_sub.add_parser("from-trace", help="count a kernel's calls by shape in a torch profiler trace (chrome "
                                              "JSON, recorded with record_shapes=True) and write a workload CSV")
    ft.add_argument("trace", type=Path)
    ft.add_argument("kernel_dir", type=Path, help="the kernel package (its arguments, in order, name the op's inputs)")
    ft.add_argument("--op", required=True, help="the op's name in the trace, e.g. kopt::silu_and_mul")
    ft.add_argument("-o", "--output", type=Path, required=True, help="the workload CSV to write")
    show = wl_sub.add_parser("show", help="the weighted shapes a workload file gives for a package")
    show.add_argument("workload", type=Path)
    show.add_argument("kernel_dir", type=Path)
    wl.set_defaults(func=_cmd_workload)

    wk = sub.add_parser("worker", help="run a worker of one role against a Temporal server")
    wk.add_argument("--role", required=True, choices=["workflows", "agents", "build", "exec"])
    wk.add_argument("--toolchain", action="append", help="build role: toolchain name(s); default all local ones")
    wk.add_argument("--target", default="cpu", choices=TARGETS, help="exec role (default: cpu)")
    wk.add_argument("--gpu-class", default=None, help="exec role, cuda: default from the device")
    wk.add_argument("--gpu-index", type=int, default=0, help="exec role, cuda: which local GPU")
    wk.set_defaults(func=_cmd_worker)

    srv = sub.add_parser("server", help="the embedded Temporal dev server of this KOPT_HOME: run it in the "
                                        "foreground (default), show its status, or stop it")
    srv.add_argument("action", nargs="?", default="run", choices=["run", "status", "stop"])
    srv.add_argument("--force", action="store_true", help="stop: even while a kopt command uses it")
    srv.set_defaults(func=_cmd_server)
    return parser


# ------------------------------------------------------------------------------------------ optimize


async def _cmd_optimize(args: argparse.Namespace, settings: Settings) -> int:
    from frontend.runs import apply_run_options, command_started_at, prepare_request, run_optimization

    started = command_started_at()

    req = prepare_request(args.kernel_dir, args.target, args.gpu_class, args.rounds, args.provider, args.seed,
                          settings)
    req = apply_run_options(req, args, settings)
    args.finished = {}
    return await run_optimization(req, args.kernel_dir, args.report_dir, settings, rerun=args.rerun,
                                  finished=args.finished, gpus=args.gpus, started=started)


async def _cmd_resume(args: argparse.Namespace, settings: Settings) -> int:
    from frontend.runs import command_started_at, run_optimization

    args.finished = {}
    return await run_optimization(None, None, args.report_dir, settings, resume=args.run, finished=args.finished,
                                  started=command_started_at())


async def _cmd_evaluate(args: argparse.Namespace, settings: Settings) -> int:
    from frontend.evaluate import evaluate

    return await evaluate(args.kernel_dir, args.candidate, args.target, args.json, settings, flags=args.flags,
                          time_cap_s=args.time_cap, holdout=args.holdout)


async def _cmd_verify(args: argparse.Namespace, settings: Settings) -> int:
    from frontend.verify import verify

    return await verify(args.kernel_dir, args.candidate, args.target, args.flags, args.baseline, args.junit, args.json,
                        args.max_slowdown, holdout=args.holdout, time_cap_s=args.time_cap)


async def _cmd_workload(args: argparse.Namespace, settings: Settings) -> int:
    from kopt.package import PackageError, load_spec
    from kopt.workload import WorkloadError, load_workload, shapes_from_trace, write_csv

    try:
        spec = load_spec(args.kernel_dir)
        if args.workload_action == "from-trace":
            counts = shapes_from_trace(args.trace, args.op, spec)
            out = write_csv(counts, spec, args.output)
            print(f"{sum(counts.values())} calls of {args.op} at {len(counts)} shapes -> {out}")
            shapes = load_workload(out, spec)
        else:
            shapes = load_workload(args.workload, spec)
    except (PackageError, WorkloadError) as exc:
        raise UsageError(str(exc)) from None
    for s in shapes:
        print(f"  {s.label:32s} weight {s.weight:.4f}")
    return exits.OK


async def _cmd_schedule(args: argparse.Namespace, settings: Settings) -> int:
    from frontend import inspect, schedules

    if args.schedule_action == "create" and args.optimize_rounds is not None and args.optimize_rounds < 1:
        raise UsageError(f"--optimize-rounds must be >= 1, got {args.optimize_rounds}")
    async with inspect.reader(settings) as client:
        if args.schedule_action == "create":
            await schedules.create(client, args.name, args.run, every=args.every, cron=args.cron,
                                   gpu_classes=args.gpu_classes, optimize_rounds=args.optimize_rounds,
                                   overlap=args.overlap, catchup=args.catchup_window, paused=args.paused)
        elif args.schedule_action == "list":
            await schedules.list_schedules(client)
        else:
            await schedules.control(client, args.name, args.schedule_action)
    return exits.OK


def _duration(text: str):
    from datetime import timedelta

    m = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number and a unit: 90s, 30m, 24h, 7d")
    return timedelta(seconds=int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)])


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number of seconds")
    return value


def _flag_list(text: str) -> list[str]:
    """--flags='-O3 -funroll-loops': the items, split on spaces (no flag contains one)."""
    return text.split()


# ------------------------------------------------------------------------------------------ inspect


async def _cmd_inspect(args: argparse.Namespace, settings: Settings) -> int:
    from frontend import inspect

    if args.action == "runs" and not settings.temporal_address and not settings.server_db.exists():
        print(f"no runs yet in {settings.home}", file=sys.stderr if args.json else sys.stdout)
        if args.json:
            print("[]")
        return exits.OK
    async with inspect.reader(settings) as client:
        if args.action == "runs":
            rows = await inspect.list_runs(client, args.limit, out=sys.stderr if args.json else sys.stdout)
            if args.json:
                print(inspect.dump_json(rows))
        elif args.action == "status":
            _, state = await inspect.status(client, args.run, reports=settings.home / "reports")
            if state in inspect.FAILED_STATES:  # the run failed: a job that reports on it fails too
                return exits.FAILED
        elif args.action == "watch":
            await inspect.watch(client, args.run, reports=settings.home / "reports")
        elif args.action == "history":
            print(inspect.history_text(await inspect.view(client, args.run), full=args.full))
        elif args.action == "export" and args.torch_op:
            from frontend.torch_op import export_torch_op
            from kopt.artifacts import ArtifactStore

            folder = export_torch_op(await inspect.view(client, args.run), args.torch_op, ArtifactStore(settings.artifacts))
            print(f"torch op written to {folder}: `python {folder / 'test_op.py'}` builds, checks and times it")
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
    return exits.OK


# ------------------------------------------------------------------------------------------ worker


async def _cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from frontend.client import connect
    from frontend.server import attach_home
    from frontend.workers import WorkerPlan, make_workers, toolchains_for
    from gpu_worker.device import local_gpus

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
            gpus = {g.index: g.gpu_class for g in local_gpus()}
            if args.gpu_index not in gpus:
                raise UsageError(f"no local GPU with index {args.gpu_index} (found {sorted(gpus) or 'none'})")
            plan.gpu_index, plan.gpu_class = args.gpu_index, args.gpu_class or gpus[args.gpu_index]
            if plan.gpu_class != gpus[args.gpu_index]:
                raise UsageError(f"GPU {args.gpu_index} is a {gpus[args.gpu_index]}, not a {plan.gpu_class}")
    async with AsyncExitStack() as stack:
        if settings.temporal_address:
            address = settings.temporal_address
        else:  # the embedded server of this home (started if none runs)
            server = attach_home(settings, say=lambda text: print(f"kopt: {text}", file=sys.stderr))
            stack.callback(server.release)
            address = server.address
        client = await connect(address, settings)
        workers = make_workers(client, settings, plan)
        log.info("worker_started", role=args.role, address=address, queues=[w.task_queue for w in workers])
        for w in workers:
            await stack.enter_async_context(w)
        await _wait_for_signal()
    return exits.OK


# ------------------------------------------------------------------------------------------ server


async def _cmd_server(args: argparse.Namespace, settings: Settings) -> int:
    from frontend.server import attach_home, read_record, stop_home_server

    if settings.temporal_address:
        raise UsageError(f"KOPT_TEMPORAL_ADDRESS is set ({settings.temporal_address}): kopt uses that cluster, "
                         "not an embedded server")  # fmt: skip
    if args.action == "stop":
        print(stop_home_server(settings.home, force=args.force))
        return exits.OK
    if args.action == "status":
        rec = read_record(settings.home)
        if rec is None or not rec.alive():
            print(f"no kopt server is running for {settings.home}")
            return exits.FAILED
        print(f"Temporal dev server at {rec.address} (pid {rec.pid}); Web UI {rec.ui_url}; database {rec.db}")
        return exits.OK
    server = attach_home(settings, say=lambda text: print(f"kopt: {text}", file=sys.stderr))
    try:
        print(f"Temporal dev server at {server.address}{'' if server.started else ' (already running)'}; "
              f"Web UI {server.ui_url}; database {settings.server_db}", flush=True)  # fmt: skip
        if await _wait_for_signal(until=lambda: not server.alive()):
            print("kopt: the server stopped (`kopt server stop`, or it exited: see its temporal.log)", file=sys.stderr)
    finally:
        if not server.release():
            print("kopt: the server keeps running for the other kopt commands of this home", file=sys.stderr)
    return exits.OK


async def _wait_for_signal(until=None) -> bool:
    """Until SIGINT, SIGTERM or SIGHUP (False) or `until()` turns true, checked every second (True)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            if until is not None and until():
                return True
    return False


if __name__ == "__main__":
    entry()
