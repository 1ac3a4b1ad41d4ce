"""Where one test job's time goes: wall seconds per class of check (declared shapes, scales, edge shapes,
fuzzed shapes, declared sizes, planted inputs, output fills, the update/repeat/burst sequences, ...).

Runs the test step (no sanitizer) of the package's own source against itself (baseline loaded, as the
optimizer and `kopt evaluate` do), reading the progress steps the judge reports, `--runs` times, and
prints the median seconds per class and their share of the job. Writes
bench/results/test_classes-<target>-<device>-<YYYYMMDD-HHMMSS>.json (device, versions, command).

    python bench/test_classes.py --target cpu --kernel kernels/fused_add_rmsnorm --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpu_worker import runner, spawn  # noqa: E402
from gpu_worker.device import cpu_name  # noqa: E402
from containment.build import build, detect_toolchain  # noqa: E402
from kopt.models import ArtifactRef, ExecRequest, PackageRef  # noqa: E402
from kopt.package import load_spec, source_path  # noqa: E402

NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
NEW = ("fuzz", "size", "planted", "fill", "update", "repeat", "burst")  # the classes of issue #25


def klass(step: str) -> str:
    """The class of a progress step: "test T=7,D=1000 float16 planted:zeros trial 0" -> "planted"."""
    if not step.startswith("test "):
        return step.split(" ")[0] or "start"
    words = step.removesuffix(" ").split(" trial ")[0].split()
    return words[3].split(":")[0] if len(words) > 3 else "declared"


async def one(req: ExecRequest, lib: Path, pkg: Path, spec) -> tuple[dict[str, float], float]:
    marks: list[tuple[float, str]] = []

    def beat(text: str) -> None:
        step = text.split(", ", 1)[1] if ", " in text else ""
        if not marks or marks[-1][1] != step:
            marks.append((time.monotonic(), step))

    start = time.monotonic()
    result = await runner.run_test(req, lib, pkg, spec, heartbeat=beat, baseline=lib)
    end = time.monotonic()
    if not result.correct:
        raise SystemExit(f"the package's own source failed its test: {result.reason}")
    per: dict[str, float] = {}
    for (t0, step), (t1, _) in zip(marks, [*marks[1:], (end, "")]):
        per[klass(step)] = per.get(klass(step), 0.0) + t1 - t0
    return per, end - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="kernels/silu_and_mul")
    ap.add_argument("--target", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    spawn.HEARTBEAT_S = 0.005  # the heartbeat carries the judge's last step: sample it often
    pkg = (REPO / args.kernel).resolve()
    spec = load_spec(pkg)
    tc = detect_toolchain(args.target)
    if tc is None:
        raise SystemExit(f"no compiler for {args.target}")
    with tempfile.TemporaryDirectory() as tmp:
        built = asyncio.run(build(tc, source_path(pkg, spec, args.target).read_text(), Path(tmp), 
                                  spec.build[args.target].flags if args.target in spec.build else []))  # fmt: skip
        if not built.ok:
            raise SystemExit(f"the package source does not build: {built.log[-400:]}")
        req = ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=args.target,
                          candidate_id="classes", library=NO_ARTIFACT, shapes=spec.shapes[args.target].test,
                          dtypes=spec.dtypes, sanitize=False, timeout_s=900)  # fmt: skip
        runs = [asyncio.run(one(req, Path(tmp) / "kernel.so", pkg, spec)) for _ in range(args.runs)]
    classes = sorted({k for per, _ in runs for k in per}, key=lambda k: -statistics.median(p.get(k, 0) for p, _ in runs))
    total = statistics.median(t for _, t in runs)
    med = {k: statistics.median(p.get(k, 0.0) for p, _ in runs) for k in classes}
    print(f"{args.kernel} ({args.target}): test job {total:.2f} s (median of {args.runs})")
    for k in classes:
        print(f"  {k:<16} {med[k]:7.3f} s  {100 * med[k] / total:5.1f} %{'  (new)' if k in NEW else ''}")
    new = sum(med[k] for k in classes if k in NEW)
    drawn = med.get("fuzz", 0.0) + med.get("size", 0.0)
    print(f"  new classes {new:.2f} s; fuzzed shapes and sizes {drawn:.2f} s = {100 * drawn / (total - new):.1f} % "
          "of the test job without the new classes")  # fmt: skip
    device = cpu_name() if args.target == "cpu" else _gpu_name()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")[:40]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"test_classes-{args.target}-{slug}-{stamp}.json"
    out.write_text(json.dumps({
        "kernel": args.kernel, "target": args.target, "device": device, "runs": args.runs, "seconds_total": total,
        "seconds_per_class": med, "new_classes": list(NEW), "python": platform.python_version(),
        "torch": _torch_version(), "command": " ".join(sys.argv),
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
