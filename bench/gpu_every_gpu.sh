#!/usr/bin/env bash
# Every local GPU serves the embedded campaign (#28 item 1), measured: on a host with several GPUs of one
# class, `kopt optimize KERNEL --target cuda --rounds R` (default --gpus all, --candidates = GPUs) while
# nvidia-smi samples each GPU's utilization every 0.5 s; prints and writes $OUT/every-gpu.json: the run's
# wall time, busy samples per GPU, and the GPU of each round's candidates (from report.json).
#   OUT=DIR bash bench/gpu_every_gpu.sh [KERNEL] [ROUNDS]   (after: source bench/gpu_env.sh, wheels and temporal carried)
set -uo pipefail
kernel=${1:-kernels/silu_and_mul}; rounds=${2:-3}
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$out/gpus.txt"
nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -lms 500 > "$out/util.csv" &
sampler=$!
start=$(date +%s.%N)
python3 -m kopt optimize "$kernel" --target cuda --rounds "$rounds" --report-dir "$out/report" > "$out/run.log" 2>&1
rc=$?
end=$(date +%s.%N)
kill $sampler
python3 - "$out" "$rc" "$start" "$end" "$kernel" "$rounds" <<'PY'
import collections, json, subprocess, sys
out, rc, start, end, kernel, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
busy, total = collections.Counter(), collections.Counter()
for line in open(f"{out}/util.csv"):
    idx, _, util = line.partition(",")
    if util.strip().isdigit():
        total[idx.strip()] += 1
        busy[idx.strip()] += int(util) > 0
try:
    report = json.load(open(f"{out}/report/report.json"))
    rounds_gpu = [(r["round"], r["slot"], r.get("gpu_index"), r.get("speedup_geomean")) for r in report["rounds"]]
    best = report["best"]["speedup_geomean"]
except (OSError, KeyError, ValueError):
    rounds_gpu, best = [], None
gpus = open(f"{out}/gpus.txt").read().strip().splitlines()
result = {"command": f"kopt optimize {kernel} --target cuda --rounds {rounds}", "rc": rc, "wall_s": round(end - start, 1),
          "gpus": gpus, "busy_samples": dict(busy), "samples": dict(total), "rounds": rounds_gpu, "best_speedup": best}
json.dump(result, open(f"{out}/every-gpu.json", "w"), indent=1)
print(json.dumps(result))
PY
