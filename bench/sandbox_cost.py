"""What the sandbox costs per candidate: compile, test and profile with the jail and without it.

For each target available here, the package baseline is compiled, tested (baseline loaded for
calibration, as `kopt evaluate` does) and profiled A/B against itself, `--runs` times with the jail
(containment/jail.py) and `--runs` times without it (KOPT_SANDBOX=off, KOPT_ALLOW_UNSANDBOXED=1),
alternating, in one process (one warm zygote, one copy-bandwidth calibration). The compute-sanitizer
pass is left out on CUDA: it costs the same either way and would dominate.

    python bench/sandbox_cost.py                 # silu_and_mul, every target found, 3 runs each way
    python bench/sandbox_cost.py --target cpu --runs 5

Prints median seconds per step and the overhead, and writes
bench/results/sandbox_cost-<device>-<YYYYMMDD-HHMMSS>.json (device, versions, command).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpu_worker import runner  # noqa: E402
from gpu_worker.device import cpu_name  # noqa: E402
from containment.build import build, detect_toolchain  # noqa: E402
from kopt.models import ArtifactRef, ExecRequest, PackageRef  # noqa: E402
from kopt.package import load_spec, source_path  # noqa: E402

NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
MODES = {"jail": {}, "none": {"KOPT_SANDBOX": "off", "KOPT_ALLOW_UNSANDBOXED": "1"}}


def request(spec, target: str, kind: str) -> ExecRequest:
    return ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=target,
                       candidate_id="baseline", library=NO_ARTIFACT, shapes=getattr(spec.shapes[target], kind),
                       dtypes=spec.dtypes, seed=1, timeout_s=900, baseline_id="baseline", sanitize=False)  # fmt: skip


def set_mode(mode: str) -> None:
    for k in ("KOPT_SANDBOX", "KOPT_ALLOW_UNSANDBOXED"):
        os.environ.pop(k, None)
    os.environ.update(MODES[mode])


async def one(target: str, pkg: Path, mode: str, tmp: Path) -> dict:
    spec = load_spec(pkg)
    tc = detect_toolchain(target)
    set_mode(mode)
    flags = spec.build[target].flags if target in spec.build else []
    t0 = time.monotonic()
    out = await build(tc, source_path(pkg, spec, target).read_text(), tmp, flags)
    compile_s = time.monotonic() - t0
    assert out.ok, out.log[-2000:]
    lib = tmp / "kernel.so"
    t0 = time.monotonic()
    tested = await runner.run_test(request(spec, target, "test"), lib, pkg, spec, baseline=lib)
    test_s = time.monotonic() - t0
    assert tested.correct, tested.reason
    t0 = time.monotonic()
    profiled = await runner.run_profile(request(spec, target, "bench"), lib, pkg, spec, baseline=lib)
    profile_s = time.monotonic() - t0
    assert profiled.ok, profiled.reason
    return {"compile_s": compile_s, "test_s": test_s, "profile_s": profile_s, "device": profiled.device,
            "total_s": compile_s + test_s + profile_s, "speedup": profiled.ab.speedup_geomean}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default=str(REPO / "kernels" / "silu_and_mul"))
    p.add_argument("--target", choices=["cpu", "cuda"], action="append", help="default: every target found")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    args = p.parse_args()
    targets = args.target or [t for t in ("cpu", "cuda") if detect_toolchain(t)]
    if "cuda" in targets:
        import torch

        if not torch.cuda.is_available():
            targets.remove("cuda")
    results: dict = {}
    for target in targets:
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for i in range(args.runs):
            for mode in (MODES if i % 2 == 0 else reversed(list(MODES))):
                with tempfile.TemporaryDirectory(prefix="kopt-sandbox-cost-") as tmp:
                    runs[mode].append(asyncio.run(one(target, Path(args.kernel), mode, Path(tmp))))
        set_mode("jail")
        summary = {m: {k: statistics.median(r[k] for r in rs) for k in ("compile_s", "test_s", "profile_s", "total_s")}
                   for m, rs in runs.items()}  # fmt: skip
        overhead = {k: summary["jail"][k] / summary["none"][k] - 1 for k in summary["jail"]}
        results[target] = {"device": runs["jail"][0]["device"], "median": summary, "overhead": overhead, "runs": runs}
        print(f"{target} ({results[target]['device']}), median of {args.runs}:")
        for k in ("compile_s", "test_s", "profile_s", "total_s"):
            print(f"  {k:<10} jail {summary['jail'][k]:7.2f} s   none {summary['none'][k]:7.2f} s   "
                  f"overhead {100 * overhead[k]:+6.1f}%")  # fmt: skip
    device = next((r["device"] for r in results.values() if "cuda" in results and r is results["cuda"]), cpu_name())
    tag = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")[:40]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out_dir) / f"sandbox_cost-{tag}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    out.write_text(json.dumps({"benchmark": "sandbox_cost", "command": " ".join(sys.argv), "host": platform.node(),
                               "python": platform.python_version(), "torch": torch.__version__, "results": results,
                               "date": stamp}, indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
