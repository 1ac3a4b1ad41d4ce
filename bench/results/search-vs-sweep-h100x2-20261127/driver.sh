#!/usr/bin/env bash
# The GPU machine's whole sequence (nvidia-h100-x2), run once under setsid: survives the calls that poll it.
R=/tmp/campaigns; mkdir -p $R
log() { echo "$(date +%T) $*" >> $R/driver.log; }
nvidia-smi > $R/nvidia-smi.txt 2>&1
git log -1 --format=%H > $R/revision.txt 2>/dev/null
log "start"
(
  export CUDA_VISIBLE_DEVICES=0 KOPT_SERVER_PORT=7233
  log "gpu0 merge start"
  OUT=$R/merge SCREEN=8 bash bench/gpu_search_vs_sweep.sh kernels/merge_attn_states_lse > $R/merge.out 2>&1
  log "gpu0 merge done rc=$?"
  s=$(date +%s.%N)
  KOPT_HOME=/tmp/kopt-home-budget timeout 400 python3 -m kopt optimize kernels/fused_add_rmsnorm --target cuda --rounds 8 \
    --max-wall-time 140 --report-dir $R/budget > $R/budget.log 2>&1
  rc=$?
  log "gpu0 budget rc=$rc wall=$(python3 -c "import time; print(round(time.time() - $s, 1))")"
) &
sleep 20
(
  export CUDA_VISIBLE_DEVICES=1 KOPT_SERVER_PORT=7300
  log "gpu1 rmsnorm start"
  OUT=$R/rmsnorm SCREEN=8 bash bench/gpu_search_vs_sweep.sh kernels/fused_add_rmsnorm > $R/rmsnorm.out 2>&1
  log "gpu1 rmsnorm done rc=$?"
) &
wait
log "all done"
