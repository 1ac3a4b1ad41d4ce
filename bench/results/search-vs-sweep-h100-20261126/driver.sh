#!/usr/bin/env bash
# The GPU machine's whole sequence, run once under setsid: survives the calls that poll it.
R=/tmp/campaigns; mkdir -p $R
log() { echo "$(date +%T) $*" >> $R/driver.log; }
nvidia-smi > $R/nvidia-smi.txt 2>&1
log "screen smoke"
python3 bench/sweep.py kernels/silu_and_mul --target cuda --product --limit 4 --screen 1 --json $R/smoke.json > $R/smoke.log 2>&1
log "smoke rc=$?"
log "budget run"
s=$(date +%s.%N)
KOPT_HOME=/tmp/kopt-home-budget timeout 400 python3 -m kopt optimize kernels/fused_add_rmsnorm --target cuda --rounds 8 \
  --max-wall-time 140 --report-dir $R/budget > $R/budget.log 2>&1
rc=$?
log "budget rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $s, 1))")"
for k in silu_and_mul merge_attn_states_lse fused_add_rmsnorm; do
  log "start $k"
  OUT=$R/$k SCREEN=8 bash bench/gpu_search_vs_sweep.sh kernels/$k > $R/$k.out 2>&1
  log "done $k rc=$?"
done
log "all done"
