#!/usr/bin/env bash
# Device calls for issue #25 (repo root, GPU machine; wheels carried in $KOPT_WHEELS, see gpu_env.sh).
#   bash bench/gpu_coverage.sh checks        the three Astra CUDA baselines through `kopt evaluate` (their
#                                            own kernel.cu: every new check must pass them), then the
#                                            gpu-marked cheat and coverage tests
#   bash bench/gpu_coverage.sh aa N CAP      each Astra package's kernel.cu against itself, N times each at
#                                            --time-cap CAP: how often the clock checks refuse honest code
#                                            (a verdict, and each shape timing they dropped)
#   bash bench/gpu_coverage.sh cost REV...   test-step cost before/after: bench/eval_cost.py, each REV's tree
#                                            carried as .carry/rev-REV.tar (git archive --prefix=rev-REV/ REV)
# Logs and JSON land in $OUT.
set -uo pipefail
what=${1:?usage: gpu_coverage.sh checks | cost REV}
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
if [ "$what" = checks ]; then
  for k in silu_and_mul fused_add_rmsnorm merge_attn_states_lse; do
    timeout 150 python3 -m kopt evaluate "kernels/$k" --candidate "kernels/$k/kernel.cu" --time-cap 0.3 --json \
      > "/tmp/eval-$k.json" 2>/dev/null
    echo "$k: exit $?"
    python3 -c "import json,sys; v=json.load(open(sys.argv[1])); print(json.dumps({k: v.get(k) for k in
      ('correct', 'reason', 'seconds', 'checks', 'speedup_geomean', 'device')}))" "/tmp/eval-$k.json"
  done 2>&1 | tee "$out/baselines.log"
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rA tests/test_cheats.py \
    tests/test_coverage.py 2>&1 | tee "$out/pytest-gpu.log" | grep -v "^PASSED" | tail -40
elif [ "$what" = aa ]; then
  n=${2:-3}; cap=${3:-0.3}
  no_sanitizer="import sys, gpu_worker.sanitizer as s; s.find_sanitizer = lambda: None
from frontend.cli import main; sys.exit(main())"
  for i in $(seq "$n"); do
    for k in silu_and_mul fused_add_rmsnorm merge_attn_states_lse; do
      # compute-sanitizer reported as missing (as bench/eval_cost.py --no-sanitizer): the test step is not studied
      timeout 150 python3 -c "$no_sanitizer" evaluate "kernels/$k" --candidate "kernels/$k/kernel.cu" \
        --time-cap "$cap" --json 2>/dev/null | python3 -c "import json,sys; v=json.load(sys.stdin)
print(json.dumps({'kernel': sys.argv[1], 'run': int(sys.argv[2]), 'correct': v['correct'], 'reason': v['reason'],
                  'speedup': v['speedup_geomean'], 'device': v['device'], 'seconds': v['seconds'],
                  'clock': [n for n in v['notes'] if 'dropped' in n or 'taken again' in n or 'clock less' in n]}))" \
        "$k" "$i"
    done
  done 2>&1 | tee "$out/aa-clock.log"
elif [ "$what" = verdicts ]; then  # verdicts REV CHEAT...: the named cheats' verdicts in REV's tree and in this one
  rev=${2:?usage: gpu_coverage.sh verdicts REV CHEAT...}; shift 2
  mkdir -p /tmp/trees && tar -xf ".carry/rev-$rev.tar" -C /tmp/trees || exit 1
  for tree in "/tmp/trees/rev-$rev" "$PWD"; do
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 280 python3 "$OLDPWD/bench/cheat_verdicts.py" --cheats \
      "$OLDPWD/tests/cheats" "$@")
  done 2>&1 | tee "$out/verdicts.log" | grep '^{'
else
  shift
  [ $# -gt 0 ] || { echo "usage: gpu_coverage.sh cost REV..."; exit 2; }
  trees=(); dirs=()
  for rev in "$@"; do
    mkdir -p /tmp/trees && tar -xf ".carry/rev-$rev.tar" -C /tmp/trees || exit 1
    trees+=(--tree "$rev=/tmp/trees/rev-$rev"); dirs+=("/tmp/trees/rev-$rev")
  done
  for k in silu_and_mul fused_add_rmsnorm; do
    timeout 200 python3 bench/eval_cost.py "${trees[@]}" --tree after=. --target cuda --runs 2 \
      --kernel "kernels/$k" --no-sanitizer --out-dir "$out" 2>&1 | tail -8
  done
  timeout 200 python3 bench/eval_cost.py "${trees[@]}" --tree after=. --target cuda --runs 2 \
    --out-dir "$out" 2>&1 | tail -8
  # The clock check's A/A on this GPU, each REV's tree and this one alike (a "forged clock" on honest code).
  for tree in "${dirs[@]}" .; do
    for k in merge_attn_states_lse silu_and_mul; do
      (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m kopt evaluate "kernels/$k" --candidate \
        "kernels/$k/kernel.cu" --time-cap 0.3 --json 2>/dev/null | python3 -c "import json,sys; v=json.load(sys.stdin);
print(sys.argv[1], sys.argv[2], v['correct'], v['reason'], v['speedup_geomean'])" "$tree" "$k")
    done
  done 2>&1 | tee "$out/aa.log"
fi
