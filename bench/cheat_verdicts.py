"""The verdict each named cheat of tests/cheats/ gets, in the tree this runs from (a before/after
check that a new cheat is accepted without the check that motivated it, and rejected with it).

    python bench/cheat_verdicts.py --target cuda graph_replay_cache read_past_end
    (cd /tmp/trees/rev-X && PYTHONPATH=$PWD python /path/to/bench/cheat_verdicts.py --cheats /path/to/tests/cheats ...)

Runs the full runner (runner.run_test for test-layer cheats, with the static checks; runner.run_profile
against the package baseline for "ab" and "profile" cheats) and prints one JSON line per cheat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_worker import runner
from containment.build import compile_command, detect_toolchain
from kopt.models import ArtifactRef, ExecRequest, PackageRef
from kopt.package import load_spec

HERE = Path.cwd()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--cheats", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "cheats")
    args = ap.parse_args()
    tc = detect_toolchain(args.target)
    out = Path(tempfile.mkdtemp(prefix="kopt-cheat-verdicts-"))
    for name in args.names:
        src = next((args.cheats / args.target).glob(f"{name}.c*"))
        text = src.read_text()
        package = (re.search(r"^// package: (\S+)", text, re.M) or [None, "silu_and_mul"])[1]
        layer = re.search(r"^// layer: (\S+)", text, re.M)[1]
        timing = (re.search(r"^// timing: (\S+)", text, re.M) or [None, "auto"])[1]
        pkg = HERE / "kernels" / package
        spec = load_spec(pkg)
        libs = {}
        for key, path in (("cheat", src), ("base", pkg / ("kernel.cu" if args.target == "cuda" else "kernel.cpp"))):
            libs[key] = out / f"{name}-{key}.so"
            subprocess.run(compile_command(tc, path, libs[key], ["-O2"]), check=True, capture_output=True)
        kind = "bench" if layer in ("ab", "profile") else "test"
        none = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
        req = ExecRequest(package=PackageRef(spec=spec, files=none, baseline_sources={}), target=args.target,
                          candidate_id=name, library=none, shapes=getattr(spec.shapes[args.target], kind),
                          dtypes=spec.dtypes, seed=7, timeout_s=300, time_cap_s=0.3, source=text,
                          timing_mode=timing)  # fmt: skip
        if kind == "bench":
            r = asyncio.run(runner.run_profile(req, libs["cheat"], pkg, spec, baseline=libs["base"]))
            line = {"cheat": name, "ok": r.ok, "reason": (r.reason or "").splitlines()[:1],
                    "speedup": r.ab.speedup_geomean if r.ab else None, "verdict": r.ab.verdict if r.ab else None,
                    "modes": sorted({t.mode for t in r.timings})}
        else:
            r = asyncio.run(runner.run_test(req, libs["cheat"], pkg, spec, baseline=libs["base"]))
            line = {"cheat": name, "correct": r.correct, "reason": (r.reason or "").splitlines()[:1]}
        print(json.dumps({"tree": str(HERE), **line}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
