"""What one `kopt evaluate` costs, before and after a change: wall time per candidate across source trees.

Each tree is a kopt checkout (a directory, or a git revision of this repository exported to a temp
dir). The same `kopt evaluate KERNEL --candidate FILE --target T --json` runs in every tree, `--runs`
times, the trees interleaved (a, b, a, b, ...) so drift on the machine falls on both alike; each tree
gets its own KOPT_HOME. The figure is the verdict's own `seconds` (build, test, profile, total) and
the process wall time.

    python bench/eval_cost.py --rev a626787 --tree after=. --target cpu --runs 5
    python bench/eval_cost.py --tree before=/tmp/old --tree after=. --target cuda --runs 3 --no-sanitizer

Prints the median seconds per step and tree and the ratio of each tree to the first, and writes
bench/results/eval_cost-<target>-<device>-<YYYYMMDD-HHMMSS>.json (device, versions, command).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = ("build", "test", "profile", "total", "wall")
# kopt's CLI moved to frontend/cli.py; older trees have it at kopt/cli.py.
CLI = ("import sys\ntry:\n    from frontend.cli import main\nexcept ImportError:\n    from kopt.cli import main\n"
       "sys.exit(main())")
# The same in every tree, with the compute-sanitizer pass reported as unavailable: its ~25 s on CUDA
# would hide what the harness itself costs.
NO_SANITIZER = "import gpu_worker.sanitizer as s\ns.find_sanitizer = lambda: None\n" + CLI


def export_rev(rev: str, into: Path) -> Path:
    """The tree of `rev` of this repository, written under `into` (no .git needed afterwards)."""
    dest = into / f"rev-{rev}"
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def one(tree: Path, home: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, KOPT_HOME=str(home), PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-c", NO_SANITIZER if args.no_sanitizer else CLI, "evaluate", str(tree / args.kernel), "--candidate",
           str(tree / (args.candidate or f"{args.kernel}/kernel.{'cu' if args.target == 'cuda' else 'cpp'}")),
           "--target", args.target, "--json"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"{tree}: kopt evaluate gave no verdict (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    verdict = json.loads(lines[-1])
    secs = dict(verdict.get("seconds", {}), wall=round(wall, 3))
    return {"seconds": secs, "correct": verdict.get("correct"), "reason": verdict.get("reason"),
            "speedup": verdict.get("speedup_geomean"), "device": verdict.get("device")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR", help="a kopt source tree")
    ap.add_argument("--rev", action="append", default=[], metavar="REV", help="a git revision of this repo")
    ap.add_argument("--kernel", default="kernels/silu_and_mul", help="package dir, relative to each tree")
    ap.add_argument("--candidate", default=None, help="candidate file relative to each tree (default: the baseline)")
    ap.add_argument("--target", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-sanitizer", action="store_true", help="skip compute-sanitizer (CUDA) in every tree")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="kopt-eval-cost-"))
    trees: dict[str, Path] = {}
    for rev in args.rev:
        trees[rev] = export_rev(rev, scratch)
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    if len(trees) < 1:
        ap.error("give at least one --tree or --rev")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, tree in trees.items():
            r = one(tree, scratch / f"home-{name}", args)
            runs[name].append(r)
            print(f"run {i + 1}/{args.runs} {name}: " + " ".join(f"{k} {v:.2f}s" for k, v in r["seconds"].items())
                  + ("" if r["correct"] else f"  REJECTED: {r['reason']}"), flush=True)  # fmt: skip
    median = {name: {s: statistics.median(r["seconds"][s] for r in rs if s in r["seconds"])
                     for s in STEPS if any(s in r["seconds"] for r in rs)} for name, rs in runs.items()}  # fmt: skip
    first = next(iter(trees))
    ratio = {name: {s: round(m[s] / median[first][s], 3) for s in m if median[first].get(s)} for name, m in median.items()}
    for name in trees:
        print(f"{name:>12}: " + " ".join(f"{s} {median[name][s]:.2f}s (x{ratio[name].get(s, float('nan')):.2f})"
                                         for s in median[name]))  # fmt: skip
    device = next((r["device"] for rs in runs.values() for r in rs if r["device"]), None) or platform.processor()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() else "-" for c in str(device).lower()).strip("-")[:32] or "unknown"
    out = args.out_dir / f"eval_cost-{args.target}-{slug}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "eval_cost", "command": " ".join(["bench/eval_cost.py", *sys.argv[1:]]), "device": device,
        "python": platform.python_version(), "host": platform.node(), "target": args.target, "kernel": args.kernel,
        "trees": {k: str(v) for k, v in trees.items()}, "median_s": median, "ratio_to_first": ratio, "runs": runs,
    }, indent=1))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
