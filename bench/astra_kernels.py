"""Benchmark: `kopt optimize` (offline provider) on the three Astra kernels, on a GPU machine.

For each package it runs a full optimization, then writes per-shape results (baseline time, best
time, speedup, %SOL) against MEASUREMENT.md's reference numbers (FlashInfer and torch.compile,
H100) into bench/results/astra-kernels-<gpu>-<timestamp>.json, and prints a table.

    python bench/astra_kernels.py [--rounds 12] [--kernels silu_and_mul,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KERNELS = ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"]
# MEASUREMENT.md, H100 cold-L2 medians in microseconds: (FlashInfer, torch.compile or None).
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


def run_kernel(kernel: str, rounds: int, gpu_class: str, out: Path, max_wall_time: float | None) -> dict:
    report_dir = out / kernel
    cmd = [sys.executable, "-m", "kopt.cli", "optimize", f"kernels/{kernel}", "--target", "cuda", "--gpu-class",
           gpu_class, "--rounds", str(rounds), "--report-dir", str(report_dir)]
    if max_wall_time:
        cmd += ["--max-wall-time", str(max_wall_time)]
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
    return {"kernel": kernel, "run_id": report["run_id"], "device": report["device"], "rounds": len(report["rounds"]),
            "stop_reason": report.get("stop_reason"),
            "best_candidate": best["candidate_id"], "best_round": best["round"], "tunables": best["tunables"],
            "flags": best["flags"], "speedup_geomean": best["speedup_geomean"], "astra_speedup": ASTRA[kernel],
            "per_shape": rows, "seconds": round(time.monotonic() - start, 1), "command": " ".join(cmd)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--max-wall-time", type=float, default=None, help="kopt's wall-time budget per kernel (s)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "bench" / "results")))
    args = parser.parse_args()
    from gpu_worker.device import local_gpus

    gpus = local_gpus()
    if not gpus:
        sys.exit("bench/astra_kernels.py needs a GPU (nvidia-smi lists none)")
    gpu_class = gpus[0][2]
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_kernel(k, args.rounds, gpu_class, args.out, args.max_wall_time) for k in args.kernels.split(",")]
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
        for s in r["per_shape"]:
            fi, tc = s["flashinfer_h100_us"], s["torch_compile_h100_us"]
            print(f"  {s['shape']:22} {s['dtype']:8} base {s['baseline_us']:8.2f} best {s['best_us']:8.2f} us "
                  f"x{s['speedup']:.3f} {s['pct_sol'] or 0:5.1f}%SOL  FI {fi or '-'} TC {tc or '-'} "
                  f"{'' if s['beats_targets'] is None else ('BEATS' if s['beats_targets'] else 'misses')}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
