#!/usr/bin/env bash
# One device call (repo root, GPU machine; carry .whl, and .peers for the FlashInfer column): an
# offline run of KERNEL on CUDA, by default on its serving workload (kernels/KERNEL/serving.toml: decode
# and prefill shapes), whose shape-specialized step may keep per-bucket tunables in one library
# (kernel.toml [dispatch.cuda]); then that run's best beside FlashInfer and torch.compile
# (bench/peers.py). Logs, the report and JSON in $OUT.
#   bash bench/gpu_specialize.sh KERNEL [ROUNDS [REPS]]
set -uo pipefail
out=${OUT:-/tmp/kopt-out}; mkdir -p "$out"
k=$1; rounds=${2:-6}; reps=${3:-50}
source bench/gpu_env.sh || exit 1
class=$(python3 -c "from gpu_worker.device import local_gpus; print(local_gpus()[0][2])")
start=$(date +%s)
timeout $((120 + rounds * 60)) python3 -m frontend.cli optimize kernels/$k --target cuda --gpu-class "$class" --rounds "$rounds" \
  --rerun --report-dir "$out/report-$k" > "$out/optimize-$k.log" 2>&1
echo "$k: rc $? in $(( $(date +%s) - start )) s"
grep -E "round|shape-specialized|held-out|best:" "$out/optimize-$k.log" | tail -40
if [ -f "$out/report-$k/report.json" ]; then
  include=(); [ -d .peers ] && include=(--include .peers)
  timeout 120 python3 bench/peers.py run "${include[@]}" --kernels "$k" --best "$k=$out/report-$k/report.json" \
    --reps "$reps" --out "$out" 2>&1 | tail -30
fi
