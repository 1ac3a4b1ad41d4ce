#!/usr/bin/env python3
"""Sweep a kernel package's tunables with kopt's own harness: each variant is built with the kopt
compile command, tested (the full correctness protocol, against the baseline) and timed against the
baseline in interleaved A/B (gpu_worker.runner: the same judge, kernel hosts, clocks and verdicts as
`kopt evaluate` and the optimizer). Prints a table and writes JSON (device, versions, command).

  python3 bench/sweep.py kernels/silu_and_mul --target cuda                        # each tunable alone
  python3 bench/sweep.py kernels/silu_and_mul --target cuda --set VEC=8,16 --set THREADS=256,512 --product
  python3 bench/sweep.py kernels/silu_and_mul --target cuda --shapes holdout       # at the held-out shapes
  python3 bench/sweep.py kernels/silu_and_mul --target cuda --shapes 'T=1,D=11008;T=777,D=3420'

Variants: without --product, every listed value of each tunable with the others at the source's
defaults; with --product, every combination of the --set values (or of all listed values).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_worker import runner  # noqa: E402
from containment.build import compile_command, detect_toolchain  # noqa: E402
from kopt.models import ArtifactRef, ExecRequest, PackageRef, Shape  # noqa: E402
from kopt.package import apply_tunables, load_spec, read_tunables  # noqa: E402

NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")


def parse_shapes(text: str, sets) -> list[Shape]:
    if text in ("bench", "test", "holdout"):
        shapes = getattr(sets, text)
        if not shapes:
            raise SystemExit(f"the package declares no {text} shapes for this target")
        return list(shapes)
    out = []
    for part in text.split(";"):
        dims = dict(item.split("=") for item in part.split(","))
        out.append(Shape(dims={k.strip(): int(v) for k, v in dims.items()}))
    return out


def variants(spec, target, defaults: dict[str, int], chosen: dict[str, list[int]], product: bool) -> list[dict]:
    values = {t.name: chosen.get(t.name, t.values) for t in spec.tunables_for(target)}
    unknown = set(chosen) - set(values)
    if unknown:
        raise SystemExit(f"unknown tunables {sorted(unknown)}; this target has {sorted(values)}")
    if product:
        names = sorted(values)
        return [dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))]
    out, seen = [], set()
    for name, vals in values.items():
        for v in vals:
            var = {**defaults, name: v}
            key = tuple(sorted(var.items()))
            if key not in seen:
                seen.add(key)
                out.append(var)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel_dir", type=Path)
    ap.add_argument("--target", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2", help="values of one tunable")
    ap.add_argument("--product", action="store_true", help="every combination instead of one tunable at a time")
    ap.add_argument("--flags", default=None, help="compiler flags instead of the package's")
    ap.add_argument("--shapes", default="bench", help="bench | holdout | test | 'T=1,D=8;T=2,D=16'")
    ap.add_argument("--dtypes", default=None, help="comma-separated; default the package's")
    ap.add_argument("--limit", type=int, default=None, help="time at most this many variants")
    ap.add_argument("--time-cap", type=float, default=None, help="sampling cap per shape and dtype (s)")
    ap.add_argument("--json", type=Path, default=None, help="default bench/results/sweep-<kernel>-<time>.json")
    args = ap.parse_args()

    spec = load_spec(args.kernel_dir)
    tc = detect_toolchain(args.target)
    if tc is None:
        raise SystemExit(f"no compiler for target {args.target}")
    source = (args.kernel_dir / spec.sources[args.target]).read_text()
    names = [t.name for t in spec.tunables_for(args.target)]
    defaults = read_tunables(source, names)
    chosen = {k: [int(v) for v in vs.split(",")] for k, vs in (s.split("=", 1) for s in args.set)}
    todo = variants(spec, args.target, defaults, chosen, args.product)[: args.limit]
    flags = args.flags.split() if args.flags is not None else list(spec.build[args.target].flags)
    shapes = parse_shapes(args.shapes, spec.shapes[args.target])
    dtypes = args.dtypes.split(",") if args.dtypes else list(spec.dtypes)
    suffix = Path(spec.sources[args.target]).suffix
    work = Path(tempfile.mkdtemp(prefix="kopt-sweep-"))

    def build(i: int, tunables: dict | None):
        src = work / f"v{i}{suffix}"
        src.write_text(apply_tunables(source, tunables) if tunables else source)
        lib = work / f"v{i}.so"
        proc = subprocess.run(compile_command(tc, src, lib, flags if tunables else list(spec.build[args.target].flags)),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        return lib if proc.returncode == 0 else proc.stderr[-2000:]

    started = time.time()
    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        built = list(pool.map(lambda iv: build(*iv), [(0, None), *((i + 1, v) for i, v in enumerate(todo))]))
    baseline = built[0]
    if not isinstance(baseline, Path):
        raise SystemExit(f"the baseline does not compile:\n{baseline}")
    print(f"{len(todo)} variants built in {time.time() - started:.0f} s; shapes {[s.label for s in shapes]} {dtypes}")

    def request(cid: str, source_text: str) -> ExecRequest:
        return ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=args.target,
                           candidate_id=cid, library=NO_ARTIFACT, shapes=shapes, dtypes=dtypes, seed=1,
                           source=source_text, time_cap_s=args.time_cap, baseline_id="baseline")  # fmt: skip

    rows = []
    device = None
    for i, (tunables, lib) in enumerate(zip(todo, built[1:])):
        label = " ".join(f"{k}={v}" for k, v in tunables.items())
        row = {"tunables": tunables, "flags": flags}
        if not isinstance(lib, Path):
            row.update(ok=False, reason=f"compile failed: {lib.splitlines()[-1] if lib else ''}")
        else:
            req = request(f"v{i + 1}", apply_tunables(source, tunables))
            tested = asyncio.run(runner.run_test(req, lib, args.kernel_dir, spec, baseline=baseline))
            if not tested.correct:
                row.update(ok=False, reason=f"wrong: {tested.reason}")
            else:
                prof = asyncio.run(runner.run_profile(req, lib, args.kernel_dir, spec, baseline=baseline))
                device = device or prof.device
                if not prof.ok or prof.ab is None:
                    row.update(ok=False, reason=f"not timed: {prof.reason}")
                else:
                    row.update(ok=True, geomean=prof.ab.speedup_geomean, ci=[prof.ab.ci_low, prof.ab.ci_high],
                               verdict=prof.ab.verdict,
                               per_shape=[{"shape": a.shape, "dtype": a.dtype, "baseline_us": a.baseline_us,
                                           "candidate_us": a.candidate_us, "speedup": a.speedup,
                                           "ci": [a.ci_low, a.ci_high]} for a in prof.ab.per_shape])  # fmt: skip
        rows.append(row)
        if row["ok"]:
            shapes_txt = "  ".join(f"{p['shape']} {p['dtype'][:4]} {p['speedup']:.3f}" for p in row["per_shape"])
            print(f"{label:40s} {row['geomean']:.3f}x [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}] {row['verdict']:7s} "
                  f"{shapes_txt}", flush=True)
        else:
            print(f"{label:40s} {row['reason'][:150]}", flush=True)

    result = {"kernel": spec.name, "target": args.target, "device": device, "python": platform.python_version(),
              "command": "python3 bench/sweep.py " + " ".join(sys.argv[1:]), "defaults": defaults,
              "shapes": [s.label for s in shapes], "dtypes": dtypes, "seconds": time.time() - started,
              "variants": rows}  # fmt: skip
    try:
        import torch

        result["torch"] = torch.__version__
        result["cuda"] = torch.version.cuda
    except ImportError:
        pass
    out = args.json or ROOT / "bench" / "results" / f"sweep-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
