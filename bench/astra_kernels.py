"""Benchmark: `kopt optimize` (offline provider) on the three Astra kernels, on a GPU machine.

For each package it runs a full optimization, then writes per-shape results (baseline time, best
time, speedup, %SOL) against docs/measurement.md's reference numbers (FlashInfer and torch.compile,
H100) into bench/results/astra-kernels-<gpu>-<timestamp>.json, and prints a table.

    python bench/astra_kernels.py [--rounds 12] [--kernels silu_and_mul,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KERNELS = ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"]
# docs/measurement.md (reference numbers), H100 cold-L2 medians in microseconds: (FlashInfer, torch.compile or None).
REFERENCE_H100 = {
    ("silu_and_mul", "T=512,D=14336", "bfloat16"): (23.1, 19.8),
    ("silu_and_mul", "T=4096,D=14336", "bfloat16"): (127.5, 120.5),
    ("silu_and_mul", "T=16384,D=14336", "bfloat16"): (476.6, 459.4),
    ("fused_add_rmsnorm", "T=512,H=8192", "bfloat16"): (17.5, 16.6),
    ("fused_add_rmsnorm", "T=4096,H=8192", "bfloat16"): (96.1, 93.7),
    ("fused_add_rmsnorm", "T=16384,H=8192", "bfloat16"): (363.8, 356.5),
    ("merge_attn_states_lse", "T=512,NH=40,D=128", "float16"): (12.1, None),
    ("merge_attn_states_lse", "T=768,NH=32,D=256", "float16"): (19.6, 21.5),
    ("merge_attn_states_lse", "T=16384,NH=32,D=128", "float16"): (140.3, 142.1),
}
ASTRA = {"silu_and_mul": 1.26, "fused_add_rmsnorm": 1.25, "merge_attn_states_lse": 1.46}


def run_kernel(kernel: str, rounds: int, gpu_class: str, out: Path, max_wall_time: float | None,
               min_gain: float | None) -> dict:  # fmt: skip
    report_dir = out / kernel
    cmd = [sys.executable, "-m", "frontend.cli", "optimize", f"kernels/{kernel}", "--target", "cuda", "--gpu-class",
           gpu_class, "--rounds", str(rounds), "--workload", "bench",  # the paper's figures: bench shapes
           "--report-dir", str(report_dir)]
    if max_wall_time:
        cmd += ["--max-wall-time", str(max_wall_time)]
    if min_gain is not None:
        cmd += ["--min-gain", str(min_gain)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    (out / f"{kernel}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"kernel": kernel, "error": (proc.stderr.strip().splitlines() or ["?"])[-1], "command": cmd}
    report = json.loads((report_dir / "report.json").read_text())
    best = report["best"]
    baseline = {(t["shape"], t["dtype"]): t for t in report["baseline"]["per_shape"]}
    rows = []
    for s in best["per_shape"]:
        ref = REFERENCE_H100.get((kernel, s["shape"], s["dtype"]))
        rows.append({
            "shape": s["shape"], "dtype": s["dtype"], "baseline_us": s["baseline_us"], "best_us": s["candidate_us"],
            "speedup": s["speedup"], "pct_sol": s["pct_sol"],
            "baseline_pct_sol": baseline[(s["shape"], s["dtype"])]["pct_sol"],
            "flashinfer_h100_us": ref[0] if ref else None, "torch_compile_h100_us": ref[1] if ref else None,
            "beats_targets": (None if not ref else s["candidate_us"] <= min(r for r in ref if r is not None)),
        })
    cold = asyncio.run(cold_ab(kernel, report_dir / "best_kernel.cu", best["flags"]))
    cold_rows = {(c["shape"], c["dtype"]): c for c in cold["per_shape"]}
    for row in rows:
        c = cold_rows.get((row["shape"], row["dtype"]))
        if c is None:
            continue
        ref = REFERENCE_H100.get((kernel, row["shape"], row["dtype"]))
        row.update({f"cold_{k}": c[k] for k in ("baseline_us", "best_us", "speedup", "ci_low", "ci_high", "pct_sol")})
        row["cold_beats_targets"] = None if not ref else c["best_us"] <= min(r for r in ref if r is not None)
    return {"kernel": kernel, "run_id": report["run_id"], "device": report["device"], "rounds": len(report["rounds"]),
            "cold_ab": {k: cold[k] for k in ("speedup_geomean", "ci_low", "ci_high", "copy_bandwidth_gbs")},
            "stop_reason": report.get("stop_reason"),
            "best_candidate": best["candidate_id"], "best_round": best["round"], "tunables": best["tunables"],
            "flags": best["flags"], "speedup_geomean": best["speedup_geomean"], "astra_speedup": ASTRA[kernel],
            "per_shape": rows, "seconds": round(time.monotonic() - start, 1), "command": " ".join(cmd)}


async def cold_ab(kernel: str, best_source: Path, best_flags: list[str]) -> dict:
    """The best kernel against the package baseline once more, in cold-L2 mode at every bench shape
    (the search may time small shapes in CUDA-graph mode; docs/measurement.md's references are cold)."""
    from gpu_worker import runner
    from containment.build import build, detect_toolchain
    from bench.noise_floor import request
    from kopt.package import load_spec, source_path

    pkg = REPO / "kernels" / kernel
    spec = load_spec(pkg)
    tc = detect_toolchain("cuda")
    flags = spec.build["cuda"].flags if "cuda" in spec.build else []
    with tempfile.TemporaryDirectory(prefix="kopt-cold-") as tmp:
        libs = []
        for name, text, lib_flags in (("base", source_path(pkg, spec, "cuda").read_text(), flags),
                                      ("best", best_source.read_text(), best_flags)):  # fmt: skip
            built = await build(tc, text, Path(tmp) / name, lib_flags)  # best_flags: its full flag list
            if not built.ok:
                sys.exit(f"{kernel} {name}: build failed:\n{built.log}")
            libs.append(Path(tmp) / name / "kernel.so")
        req = request(spec, "cuda", spec.shapes["cuda"].bench, spec.dtypes, None, timing_mode="cold")
        result = await runner.run_profile(req, libs[1], pkg, spec, baseline=libs[0])
    if not result.ok:
        sys.exit(f"{kernel}: cold A/B failed: {result.reason}")
    sol = {(t.shape, t.dtype): t.pct_sol for t in result.timings}
    return {"speedup_geomean": result.ab.speedup_geomean, "ci_low": result.ab.ci_low, "ci_high": result.ab.ci_high,
            "copy_bandwidth_gbs": result.copy_bandwidth_gbs,
            "per_shape": [{"shape": s.shape, "dtype": s.dtype, "baseline_us": s.baseline_us, "best_us": s.candidate_us,
                           "speedup": s.speedup, "ci_low": s.ci_low, "ci_high": s.ci_high,
                           "pct_sol": sol[(s.shape, s.dtype)]} for s in result.ab.per_shape]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--max-wall-time", type=float, default=None, help="kopt's wall-time budget per kernel (s)")
    parser.add_argument("--min-gain", type=float, default=None, help="kopt optimize --min-gain")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench" / "results")))
    args = parser.parse_args()
    from gpu_worker.device import local_gpus

    gpus = local_gpus()
    if not gpus:
        sys.exit("bench/astra_kernels.py needs a GPU (nvidia-smi lists none)")
    gpu_class = gpus[0][2]
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_kernel(k, args.rounds, gpu_class, args.out, args.max_wall_time, args.min_gain)
               for k in args.kernels.split(",")]
    import torch

    doc = {"benchmark": "astra_kernels", "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(),
           "gpu": gpus[0][1], "gpu_class": gpu_class, "torch": torch.__version__, "python": platform.python_version(),
           "command": " ".join([sys.executable, *sys.argv]), "results": results}
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"astra-kernels-{gpu_class}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=2))
    for r in results:
        if "error" in r:
            print(f"{r['kernel']}: FAILED: {r['error']}")
            continue
        print(f"{r['kernel']}: geomean {r['speedup_geomean']:.3f}x over kopt's baseline (Astra: {r['astra_speedup']}x)"
              f", best {r['tunables']} {' '.join(r['flags'])}")
        c = r["cold_ab"]
        print(f"  cold-L2 A/B at every shape: {c['speedup_geomean']:.3f}x [{c['ci_low']:.3f}, {c['ci_high']:.3f}]")
        for s in r["per_shape"]:
            fi, tc = s["flashinfer_h100_us"], s["torch_compile_h100_us"]
            verdict = s.get("cold_beats_targets")
            print(f"  {s['shape']:22} {s['dtype']:8} search: base {s['baseline_us']:8.2f} best {s['best_us']:8.2f} us"
                  f" | cold: base {s.get('cold_baseline_us', 0):8.2f} best {s.get('cold_best_us', 0):8.2f} us "
                  f"x{s.get('cold_speedup', 0):.3f} {s.get('cold_pct_sol') or 0:5.1f}%SOL  FI {fi or '-'} TC {tc or '-'} "
                  f"{'' if verdict is None else ('BEATS' if verdict else 'misses')}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
