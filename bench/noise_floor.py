"""Noise floor of the A/B timing, %SOL validation with a pure copy, and the harness's overhead.

1. The package baseline timed against itself in one interleaved A/B run over its bench shapes:
   the 95% interval of the self-ratio per shape is the noise floor a speedup must clear
   (docs/measurement.md, timing 6-7; ExecRequest.noise_floor).
2. A pure copy kernel (tests/fixtures/copy) over its bench shapes: its %SOL against the measured
   copy bandwidth should approach 100% for large shapes on a GPU (docs/measurement.md, timing 10).
3. Harness overhead: wall seconds of a full test + profile of one candidate (the baseline, with the
   baseline loaded beside it, as `kopt evaluate` does) over the package's test and bench shapes.

    python bench/noise_floor.py                         # silu_and_mul on cuda if there is a GPU
    python bench/noise_floor.py --target cpu --quick    # a smoke check anywhere (~30 s)

Prints a table and writes bench/results/noise_floor-<target>-<host>-<YYYYMMDD-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kopt  # noqa: E402
from gpu_worker import runner  # noqa: E402
from gpu_worker.protocol import HARNESS_VERSION  # noqa: E402
from containment.build import build, detect_toolchain  # noqa: E402
from kopt.models import ArtifactRef, ExecRequest, PackageRef, Shape  # noqa: E402
from kopt.package import load_spec, source_path  # noqa: E402
from result_file import write_record  # noqa: E402 (bench/, the script's folder)

BENCHMARK = "noise_floor"
COPY = REPO / "tests" / "fixtures" / "copy"
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default=str(REPO / "kernels" / "silu_and_mul"), help="kernel package folder")
    p.add_argument("--target", choices=["cpu", "cuda"], default=None, help="default: cuda when nvidia-smi sees a GPU")
    p.add_argument("--quick", action="store_true", help="short sampling, first bench shape and dtype only (smoke)")
    p.add_argument("--time-cap", type=float, default=None, help="sampling cap per shape and dtype (s)")
    p.add_argument("--also", default="", help="comma-separated kernel package folders: a self A/B of each too")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def request(spec, target: str, shapes: list[Shape], dtypes: list[str], time_cap: float | None, **extra) -> ExecRequest:
    return ExecRequest(
        package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=target,
        candidate_id=f"{spec.name}-baseline", library=NO_ARTIFACT, shapes=shapes, dtypes=dtypes, seed=0,
        timeout_s=1800, time_cap_s=time_cap, baseline_id="baseline", **extra,
    )  # fmt: skip


async def build_lib(tc, pkg: Path, target: str, workdir: Path) -> Path:
    spec = load_spec(pkg)
    flags = spec.build[target].flags if target in spec.build else []
    out = await build(tc, source_path(pkg, spec, target).read_text(), workdir, flags)
    if not out.ok:
        sys.exit(f"{pkg.name}: build failed:\n{out.log}")
    return workdir / "kernel.so"


def versions(target: str) -> dict:
    info = {"python": platform.python_version(), "kopt": kopt.__version__, "harness": HARNESS_VERSION}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    tc = detect_toolchain(target)
    info["toolchain"] = tc.version if tc else None
    return info


def print_self_ab(result) -> None:
    """One line per shape and dtype of a self A/B profile: time, self-ratio, its interval, %SOL."""
    sol = {(t.shape, t.dtype): t.pct_sol for t in result.timings}
    for s in result.ab.per_shape:
        print(f"{s.shape:<24} {s.dtype:<9} {s.mode:<8} {s.candidate_us:9.2f} {s.speedup:10.4f} "
              f"[{s.ci_low:.4f}, {s.ci_high:.4f}] {sol[(s.shape, s.dtype)]:6.1f}")  # fmt: skip


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.target is None:
        from gpu_worker.device import local_gpus

        args.target = "cuda" if local_gpus() else "cpu"
    target = args.target
    tc = detect_toolchain(target)
    if tc is None:
        sys.exit(f"no toolchain for {target} on this machine")
    pkg, now = Path(args.kernel), dt.datetime.now()
    spec, copy_spec = load_spec(pkg), load_spec(COPY)
    time_cap = args.time_cap if args.time_cap is not None else (0.2 if args.quick else None)
    bench = spec.shapes[target].bench[:1] if args.quick else spec.shapes[target].bench
    dtypes = spec.dtypes[:1] if args.quick else spec.dtypes
    copy_bench = copy_spec.shapes[target].bench[:1] if args.quick else copy_spec.shapes[target].bench
    copy_dtypes = copy_spec.dtypes[:1]
    with tempfile.TemporaryDirectory(prefix="kopt-noise-") as tmp:
        base, copy_lib = await asyncio.gather(build_lib(tc, pkg, target, Path(tmp) / "base"),
                                              build_lib(tc, COPY, target, Path(tmp) / "copy"))  # fmt: skip
        print(f"{target}: A/B of the {spec.name} baseline against itself over {len(bench)} shape(s) ...", flush=True)
        self_ab = await runner.run_profile(request(spec, target, bench, dtypes, time_cap), base, pkg, spec,
                                           baseline=base)  # fmt: skip
        if not self_ab.ok:
            sys.exit(f"self A/B failed: {self_ab.reason}")
        also = {}
        for other in filter(None, args.also.split(",")):
            opkg = Path(other)
            ospec = load_spec(opkg)
            olib = await build_lib(tc, opkg, target, Path(tmp) / f"also-{ospec.name}")
            print(f"{target}: A/B of the {ospec.name} baseline against itself ...", flush=True)
            oab = await runner.run_profile(request(ospec, target, ospec.shapes[target].bench, ospec.dtypes, time_cap),
                                           olib, opkg, ospec, baseline=olib)  # fmt: skip
            if not oab.ok:
                sys.exit(f"{ospec.name} self A/B failed: {oab.reason}")
            also[ospec.name] = oab
        print("copy kernel %SOL ...", flush=True)
        copy = await runner.run_profile(request(copy_spec, target, copy_bench, copy_dtypes, time_cap), copy_lib, COPY,
                                        copy_spec)  # fmt: skip
        if not copy.ok:
            sys.exit(f"copy profile failed: {copy.reason}")
        print("harness overhead: test + profile of one candidate ...", flush=True)
        test_shapes = spec.shapes[target].test
        source = source_path(pkg, spec, target).read_text()
        t0 = time.monotonic()
        tested = await runner.run_test(request(spec, target, test_shapes, dtypes, time_cap, source=source), base, pkg,
                                       spec, baseline=base)  # fmt: skip
        t1 = time.monotonic()
        profiled = await runner.run_profile(request(spec, target, bench, dtypes, time_cap), base, pkg, spec,
                                            baseline=base)  # fmt: skip
        t2 = time.monotonic()

    ab = self_ab.ab
    print(f"\n{self_ab.device}: copy bandwidth {self_ab.copy_bandwidth_gbs:.0f} GB/s, "
          f"bound {self_ab.peak_bandwidth_gbs:.0f} GB/s")
    print(f"{'shape':<24} {'dtype':<9} {'mode':<8} {'us':>9} {'self-ratio':>10} {'95% CI':>17} {'%SOL':>6}")
    print_self_ab(self_ab)
    floor = max(max(1 - s.ci_low, s.ci_high - 1) for s in ab.per_shape)
    print(f"geomean self-ratio {ab.speedup_geomean:.4f} [{ab.ci_low:.4f}, {ab.ci_high:.4f}]; noise floor ~{floor:.4f}")
    for name, oab in also.items():
        print(f"\n{name} self A/B:")
        print_self_ab(oab)
    print("\ncopy kernel:")
    for t in copy.timings:
        print(f"{t.shape:<24} {t.dtype:<9} {t.mode:<8} {t.median_us:9.2f} us {t.gbytes_per_s:8.1f} GB/s "
              f"{t.pct_sol:6.1f}% SOL")
    print(f"\nharness overhead: test {t1 - t0:.1f} s ({'correct' if tested.correct else tested.reason}), "
          f"profile {t2 - t1:.1f} s ({'ok' if profiled.ok else profiled.reason}), total {t2 - t0:.1f} s")

    record = {
        "benchmark": BENCHMARK,
        "timestamp": now.astimezone().isoformat(timespec="seconds"),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform()},
        "device": self_ab.device,
        "target": target,
        "versions": versions(target),
        "command_line": [sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
        "kernel": spec.name,
        "quick": args.quick,
        "time_cap_s": time_cap,
        "copy_bandwidth_gbs": self_ab.copy_bandwidth_gbs,
        "peak_bandwidth_gbs": self_ab.peak_bandwidth_gbs,
        "self_ab": ab.model_dump(),
        "self_ab_timings": [t.model_dump() for t in self_ab.timings],
        "noise_floor": floor,
        "also_self_ab": {name: {"ab": oab.ab.model_dump(), "timings": [t.model_dump() for t in oab.timings]}
                         for name, oab in also.items()},  # fmt: skip
        "copy": [t.model_dump() for t in copy.timings],
        "overhead_s": {"test": round(t1 - t0, 3), "profile": round(t2 - t1, 3), "total": round(t2 - t0, 3)},
        "test_correct": tested.correct,
        "test_reason": tested.reason,
        "sanitizer": tested.sanitizer,
        "notes": sorted(set(self_ab.notes + copy.notes + tested.notes)),
    }
    write_record(args.out_dir, f"{BENCHMARK}-{target}-{socket.gethostname()}-{now:%Y%m%d-%H%M%S}", record)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
