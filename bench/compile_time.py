"""Compile time per candidate: build a kernel package's baseline N times per target.

Each build goes into a fresh temporary directory through containment.build.build, exactly as a build
worker compiles a candidate (same compiler command and flags from kernel.toml), so the numbers
are what one round pays per candidate on this machine. One untimed warm-up build per target
first, so the timed runs see a warm file cache as a long-running build worker does.

    python bench/compile_time.py                      # silu_and_mul, cpu and cuda, 5 runs each
    python bench/compile_time.py --runs 10 --toolchain-only cuda

Prints median/min/max seconds per target and writes
bench/results/compile_time-<hostname>-<YYYYMMDD-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kopt
from containment.build import Toolchain, build, detect_toolchain
from kopt.package import load_spec, source_path
from result_file import write_record  # bench/, the script's folder

BENCHMARK = "compile_time"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default=str(REPO / "kernels" / "silu_and_mul"), help="kernel package folder")
    p.add_argument("--runs", type=int, default=5, help="timed builds per target (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed builds per target first (default 1)")
    p.add_argument("--toolchain-only", choices=["cuda", "cpu"], help="time one target only")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the JSON goes")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


async def time_target(tc: Toolchain, source: str, flags: list[str], runs: int, warmup: int) -> dict:
    seconds, warmup_seconds, command = [], [], []
    for i in range(warmup + runs):
        with tempfile.TemporaryDirectory(prefix=f"kopt-bench-{tc.name}-") as tmp:
            out = await build(tc, source, Path(tmp), flags)
        if not out.ok:
            sys.exit(f"{tc.name}: build failed:\n{out.log}")
        (warmup_seconds if i < warmup else seconds).append(out.seconds)
        command = out.command
    return {
        "seconds": [round(s, 4) for s in seconds],
        "median_s": round(statistics.median(seconds), 4),
        "min_s": round(min(seconds), 4),
        "max_s": round(max(seconds), 4),
        "mean_s": round(statistics.fmean(seconds), 4),
        "stdev_s": round(statistics.stdev(seconds), 4) if len(seconds) > 1 else 0.0,
        "warmup_seconds": [round(s, 4) for s in warmup_seconds],
        "compiler_command": command,  # last run's; paths are that run's temp dir
    }


def host_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "platform": platform.platform(),
    }


def git_info() -> dict:
    def git(*cmd: str) -> str | None:
        try:
            res = subprocess.run(["git", *cmd], check=False, cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = load_spec(args.kernel)
    targets = [t for t in spec.targets if args.toolchain_only in (None, t)]
    if not targets:
        sys.exit(f"{args.kernel}: no target {args.toolchain_only!r} (targets: {spec.targets})")

    now = dt.datetime.now()
    host = host_info()
    # Other work on the machine inflates compile times; the load averages say whether it was quiet.
    load_start = os.getloadavg()
    results = []
    for target in targets:
        tc = detect_toolchain(target)
        if tc is None:
            print(f"{target}: no toolchain on this machine, skipped", file=sys.stderr)
            continue
        source = source_path(args.kernel, spec, target).read_text()
        flags = spec.build[target].flags if target in spec.build else []
        print(
            f"{target}: {tc.name} ({tc.version}), flags {flags}, {args.warmup} warm-up + {args.runs} runs ...",
            flush=True,
        )
        timing = await time_target(tc, source, flags, args.runs, args.warmup)
        results.append(
            {
                "benchmark": BENCHMARK,
                "kernel": spec.name,
                "target": target,
                "toolchain": {"name": tc.name, "compiler": tc.compiler, "version": tc.version},
                "flags": flags,
                "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
                "runs": args.runs,
                "warmup": args.warmup,
                **timing,
            }
        )
    if not results:
        sys.exit("no target could be built on this machine")

    print(
        f"\ncompile time per candidate, {spec.name}, host {host['hostname']} "
        f"({host['nproc']} cpus, {host['cpu_model']})"
    )
    print(f"{'target':<8} {'toolchain':<14} {'runs':>4} {'median s':>9} {'min s':>7} {'max s':>7}")
    for r in results:
        print(
            f"{r['target']:<8} {r['toolchain']['name']:<14} {r['runs']:>4} "
            f"{r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f}"
        )

    record = {
        "benchmark": BENCHMARK,
        "timestamp": now.astimezone().isoformat(timespec="seconds"),
        "host": {
            **host,
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "python": platform.python_version(),
        "kopt_version": kopt.__version__,
        "git": git_info(),
        "command_line": [sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
        "results": results,
    }
    write_record(args.out_dir, f"{BENCHMARK}-{host['hostname']}-{now:%Y%m%d-%H%M%S}", record)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
