#!/usr/bin/env python3
"""Sweep a kernel package's tunables with kopt's own harness: each variant is built with the kopt
compile command, tested (the full correctness protocol, against the baseline) and timed against the
baseline in interleaved A/B (gpu_worker.runner: the same judge, kernel hosts, clocks and verdicts as
`kopt evaluate` and the optimizer). Prints a table and writes JSON (device, versions, command).

  python3 bench/sweep.py kernels/silu_and_mul --target cuda                        # each tunable alone
  python3 bench/sweep.py kernels/silu_and_mul --target cuda --set VEC=8,16 --set THREADS=256,512 --product
  python3 bench/sweep.py kernels/silu_and_mul --target cuda --shapes holdout       # at the held-out shapes
  python3 bench/sweep.py kernels/silu_and_mul --target cuda --shapes 'T=1,D=11008;T=777,D=3420'
  python3 bench/sweep.py kernels/fused_add_rmsnorm --target cuda --product --screen 8   # 540 variants

--screen K (CUDA): time every variant first in this process, cheaply (CUDA events around one call, inout
arguments restored and the L2 flushed before each, baseline and variant interleaved in alternating order,
median ratio per shape and dtype; the baseline against itself too, "screen_aa" in the JSON), then judge
only the K best by that screen (and the source's defaults) in full. Exhaustive spaces of hundreds of
variants take minutes that way instead of hours; the JSON keeps every variant's screen figure.

Variants: without --product, every listed value of each tunable with the others at the source's
defaults; with --product, every combination of the --set values (or of all listed values).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import itertools
import json
import math
import os
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


def screen(kernel_dir: Path, spec, baseline: Path, libs: list, shapes: list[Shape], dtypes: list[str],
           reps: int = 15, only: set[int] | None = None) -> tuple[dict[int, float], float]:
    """Each built variant's speedup over the baseline by a cheap in-process timing: the geomean over
    shapes and dtypes of the median of `reps` baseline/variant ratios. Each call is taken as the judge
    takes one: inout arguments restored from their pristine copies, the L2 flushed, the stream drained,
    then CUDA events around the call; which of the two goes first alternates. Also returns the
    baseline timed against itself the same way (an A/A figure: 1.0 when the screen has no bias). Our own
    package's variants only (trusted code in this process): a ranking to choose which variants the full
    judge sees, not a verdict. `only`: screen these variants (indices into `libs`) and no others."""
    import statistics

    import torch

    from gpu_worker.abi import Kernel, Packed
    from gpu_worker.cases import dtype_of, generate, shapes_of
    from gpu_worker.context import load_reference
    from gpu_worker.plan import CaseSpec
    from gpu_worker.timing import ColdL2

    ref = load_reference(kernel_dir)
    torch_stream = torch.cuda.current_stream()
    stream = torch_stream.cuda_stream
    cold = ColdL2(torch.device("cuda"))  # the judge's L2 flush
    packs = []  # (packed, [(buffer, its pristine copy)] for the inout arguments)
    for shape in shapes:
        for dt in dtypes:
            cs = CaseSpec(dims=tuple(shape.dims.items()), dtype=dt)
            made = generate(ref, spec.arguments, cs, seed=1, device="cuda")
            dims = shapes_of(spec.arguments, cs.dim_map)
            tensors = [made[a.name] if a.name in made else
                       torch.empty(dims[a.name], dtype=dtype_of(a, dt), device="cuda") for a in spec.arguments]
            restore = [(t, t.clone()) for a, t in zip(spec.arguments, tensors) if a.role == "inout"]
            packs.append((Packed(tensors), restore))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(kernel: Kernel, packed: Packed, restore: list) -> float:
        for buf, pristine in restore:
            buf.copy_(pristine)
        cold.flush()
        torch_stream.synchronize()
        start.record()
        rc = kernel(packed, stream)
        end.record()
        end.synchronize()
        if rc != 0:
            raise RuntimeError(f"entry returned {rc}")
        return start.elapsed_time(end)

    def speedup(base: Kernel, kernel: Kernel) -> float:
        logs = []
        for packed, restore in packs:
            for _ in range(3):
                timed(base, packed, restore), timed(kernel, packed, restore)
            ratios = []
            for rep in range(reps):
                if rep % 2:
                    k, b = timed(kernel, packed, restore), timed(base, packed, restore)
                else:
                    b, k = timed(base, packed, restore), timed(kernel, packed, restore)
                ratios.append(b / k)
            logs.append(math.log(statistics.median(ratios)))
        return math.exp(sum(logs) / len(logs))

    base = Kernel(str(baseline), spec.entry, stream, role="baseline")
    aa = speedup(base, Kernel(str(baseline), spec.entry, stream))
    out = {}
    for i, lib in enumerate(libs):
        if not isinstance(lib, Path) or (only is not None and i not in only):
            continue
        try:
            out[i] = speedup(base, Kernel(str(lib), spec.entry, stream))
        except Exception as exc:  # noqa: BLE001 - reported; the variant is left out of the ranking
            print(f"screen: variant {i + 1} failed: {exc}", flush=True)
    return out, aa


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
    ap.add_argument("--screen", type=int, default=None, metavar="K",
                    help="CUDA: time all variants cheaply in-process, judge only the K best in full")
    ap.add_argument("--rescreen", type=int, default=None, metavar="N",
                    help="with --screen: time the N best of the first screen again, with 5x its samples, and "
                         "rank by that second figure (a screen's noise is about 1%%; this narrows it)")
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
    with cf.ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool:
        built = list(pool.map(lambda iv: build(*iv), [(0, None), *((i + 1, v) for i, v in enumerate(todo))]))
    baseline = built[0]
    if not isinstance(baseline, Path):
        raise SystemExit(f"the baseline does not compile:\n{baseline}")
    print(f"{len(todo)} variants built in {time.time() - started:.0f} s; shapes {[s.label for s in shapes]} {dtypes}")

    def request(cid: str, source_text: str) -> ExecRequest:
        return ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=args.target,
                           candidate_id=cid, library=NO_ARTIFACT, shapes=shapes, dtypes=dtypes, seed=1,
                           source=source_text, time_cap_s=args.time_cap, baseline_id="baseline")  # fmt: skip

    screened, screen_aa, rescreened, rescreen_aa = {}, None, {}, None
    if args.screen is not None:
        if args.target != "cuda":
            raise SystemExit("--screen times CUDA kernels")
        screened, screen_aa = screen(args.kernel_dir, spec, baseline, built[1:], shapes, dtypes)
        ranked = sorted(screened, key=lambda i: -screened[i])
        if args.rescreen:
            print(f"screened {len(screened)} variants in {time.time() - started:.0f} s; the {args.rescreen} best "
                  "again with 5x the samples", flush=True)
            again, rescreen_aa = screen(args.kernel_dir, spec, baseline, built[1:], shapes, dtypes, reps=75,
                                        only=set(ranked[: args.rescreen]))
            rescreened = {i: round(v, 4) for i, v in again.items()}
            ranked = sorted(again, key=lambda i: -again[i]) + [i for i in ranked if i not in again]
        keep = set(ranked[: args.screen]) | {i for i, v in enumerate(todo) if v == defaults}
        print(f"screened {len(screened)} variants in {time.time() - started:.0f} s (the baseline against itself: "
              f"{screen_aa:.3f}); judging {len(keep)} in full", flush=True)

    rows = []
    device = None
    for i, (tunables, lib) in enumerate(zip(todo, built[1:])):
        label = " ".join(f"{k}={v}" for k, v in tunables.items())
        row = {"tunables": tunables, "flags": flags}
        if i in screened:
            row["screen"] = round(screened[i], 4)
        if i in rescreened:
            row["rescreen"] = rescreened[i]
        if args.screen is not None and i not in keep and isinstance(lib, Path):
            row.update(ok=False, judged=False, reason="not judged: below the screen's top" if i in screened
                       else "not judged: failed in the screen")
            rows.append(row)
            continue
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
              "screen": args.screen, "screen_aa": screen_aa, "rescreen": args.rescreen, "rescreen_aa": rescreen_aa,
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
