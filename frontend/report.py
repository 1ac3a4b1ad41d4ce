"""report.json and report.md for a finished run, written atomically (never half a report)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from kopt.candidates import unified_diff
from kopt.models import RoundRecord, ShapeSpeedup
from kopt.run_models import OptimizeRequest, OptimizeResult


def build_report(run_id: str, temporal_run_id: str, req: OptimizeRequest, res: OptimizeResult,
                 ui_url: str | None) -> dict:
    baseline = res.baseline
    return {
        "run_id": run_id,
        "temporal_run_id": temporal_run_id,
        "web_ui": ui_url,
        "kernel": res.kernel,
        "target": res.target,
        "gpu_class": res.gpu_class,
        "toolchain": req.toolchain,
        "provider": req.provider,
        "rounds_requested": req.rounds,
        "status": res.status,
        "device": baseline.profile.device if baseline.profile else None,
        "baseline": {
            "candidate_id": baseline.candidate_id,
            "flags": baseline.flags,
            "tunables": baseline.tunables,
            "compile_seconds": baseline.compile.seconds if baseline.compile else None,
            "per_shape": [t.model_dump() for t in baseline.profile.timings] if baseline.profile else [],
            "copy_bandwidth_gbs": baseline.profile.copy_bandwidth_gbs if baseline.profile else None,
        },
        "segments": res.segments,
        "stop_reason": res.stop_reason,
        "extra_test_shapes": [s.dims for s in res.extra_test_shapes],
        "usage": res.usage.model_dump(),
        "candidates_per_round": req.candidates_per_round,
        "single_agent": req.single_agent,
        "model": req.llm.model if req.llm else None,
        "rounds": [r.model_dump() for r in res.rounds],
        "best": res.best.model_dump(exclude={"source"}) if res.best else None,
        "allow_regressions": req.allow_regressions,
        # Every (shape, dtype) where the best is statistically slower than the baseline, and every round
        # candidate that was, with the shapes (docs: README, the per-shape guard).
        "best_regressions": [f"{s.shape} {s.dtype}" for s in res.best.per_shape if s.regression()] if res.best
        else [],
        "round_regressions": {r.candidate_id: r.regressions for r in res.rounds if r.regressions},
        "holdout": res.holdout.model_dump() if res.holdout else None,
        "specialized": res.specialized.model_dump() if res.specialized else None,
        # The search's objective: the geomean over the bench shapes, or the workload-weighted time.
        "objective": "workload" if req.workload else "geomean",
        "workload": [{"shape": s.label, "weight": s.weight} for s in req.workload],
    }


def report_charts(report: dict) -> dict[str, bytes]:
    """The charts of a report (frontend/charts.py), by file name."""
    from frontend.charts import run_charts

    best = report.get("best") or {}
    sol = {f"{t['shape']} {t['dtype']}": t["pct_sol"] for t in report["baseline"]["per_shape"]
           if t.get("pct_sol") is not None}  # fmt: skip
    return run_charts(report["kernel"], report["target"], sol,
                      [ShapeSpeedup.model_validate(s) for s in best.get("per_shape", [])],
                      [RoundRecord.model_validate(r) for r in report["rounds"]])  # fmt: skip


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def render_markdown(report: dict, source_name: str, charts: list[str] | tuple[str, ...] = ()) -> str:
    lines = [f"# kopt report: {report['kernel']} ({report['target']})", ""]
    lines += [f"- run: `{report['run_id']}` (Temporal run `{report['temporal_run_id']}`)"]
    if report.get("web_ui"):
        lines += [f"- Web UI: {report['web_ui']}"]
    u = report["usage"]
    lines += [f"- device: {report['device']}", f"- toolchain: {report['toolchain']}, provider: {report['provider']}"
              + (f", model {report['model']}" if report.get("model") else ""),
              f"- usage: {u['llm_calls']} LLM calls, {u['prompt_tokens']} + {u['completion_tokens']} tokens, "
              f"${u['cost_usd']:.4f}, {u['device_seconds']:.1f} s of device time"]
    if report.get("stop_reason"):
        lines.append(f"- stopped early: {report['stop_reason']}")
    lines.append("")
    best = report["best"]
    if best:
        what = "workload-weighted speedup" if report.get("objective") == "workload" else "geomean speedup"
        made = ("shape-specialized" if (report.get("specialized") or {}).get("accepted")
                else f"round {best['round']}")  # fmt: skip
        lines += [f"## Best: `{best['candidate_id']}` ({made}), "
                  f"{what} {best['speedup_geomean']:.3f}x"
                  + (f" (95% CI {best['speedup_ci'][0]:.3f}-{best['speedup_ci'][1]:.3f})" if best.get("speedup_ci")
                     else ""), "",
                  f"flags: `{' '.join(best['flags'])}`, tunables: `{best['tunables']}`", "",
                  "| shape | dtype | baseline us | best us | speedup | %SOL |", "| --- | --- | --- | --- | --- | --- |"]
        for s in best["per_shape"]:
            sol = f"{s['pct_sol']:.1f}" if s.get("pct_sol") is not None else "-"
            lines.append(f"| {s['shape']} | {s['dtype']} | {s['baseline_us']:.2f} | {s['candidate_us']:.2f} | "
                         f"{s['speedup']:.3f} | {sol} |")
    if report.get("best_regressions"):
        lines += ["", f"**The best is slower than the baseline at {', '.join(report['best_regressions'])}** "
                      "(accepted because the run allowed regressions)."]  # fmt: skip
    if report.get("round_regressions"):
        lines += ["", "Candidates slower than the baseline at some shapes"
                  + (" (allowed):" if report.get("allow_regressions") else " (not eligible as the best):"), ""]
        lines += [f"- `{cid}`: {', '.join(shapes)}" for cid, shapes in report["round_regressions"].items()]
    if report.get("workload"):
        lines += ["", "Workload (timed shapes by weight): "
                  + ", ".join(f"{w['shape']} {w['weight']:.3f}" for w in report["workload"])]
    lines += specialized_lines(report.get("specialized"))
    lines += holdout_lines(report.get("holdout"))
    captions = {"speedup.png": "per-shape speedup of the best", "sol.png": "% of speed of light",
                "progress.png": "progress by round"}  # fmt: skip
    if charts:
        lines += [""] + [f"![{captions.get(c, c)}]({c})" for c in charts]
    elif report.get("best") and charts is not None and not _have_matplotlib():
        lines += ["", "(no charts: matplotlib is not installed here)"]
    lines += ["", "## Rounds", "", "| round | change | compiled | correct | geomean speedup |",
              "| --- | --- | --- | --- | --- |"]
    for r in report["rounds"]:
        sp = f"{r['speedup_geomean']:.3f}" if r["speedup_geomean"] is not None else "-"
        lines.append(f"| {r['round']} | {r['description']} | {r['compiled']} | {r['correct']} | {sp} |")
    lines += ["", f"The best source is in `best_{source_name}`; `best.patch` is its diff from the baseline.", ""]
    return "\n".join(lines)


def specialized_lines(sp: dict | None) -> list[str]:
    """The report's shape-specialized section: the values chosen per bucket and what came of them."""
    if not sp:
        return []
    lines = ["", "## Shape-specialized build", ""]
    if sp.get("settings"):
        lines += ["| bucket | tunables | from candidate |", "| --- | --- | --- |"]
        lines += [f"| {b} | `{t}` | `{c}` |" for b, t, c in zip(sp["buckets"], sp["settings"], sp["picked_from"])]
        lines.append("")
    if sp.get("speedup_geomean") is not None:
        lines.append(f"`{sp['candidate_id']}`: {sp['speedup_geomean']:.3f}x over the baseline, "
                     + ("**kept as the best** (one library that dispatches on the call's shape)" if sp["accepted"]
                        else f"not kept: {sp.get('reason')}"))
    else:
        lines.append(f"not built or not measured: {sp.get('reason')}")
    return lines


def holdout_lines(h: dict | None) -> list[str]:
    """The report's held-out section: the best on shapes the search never saw, and an overfit flag."""
    if not h:
        return []
    lines = ["", f"## Held-out shapes ({'; '.join(h['shapes'])})", ""]
    if h.get("overfit"):
        why = (h.get("reason") if not h["correct"] else
               f"slower than the baseline at {', '.join(h['regressions'])}" if h.get("regressions")
               else "slower than the baseline over the held-out shapes")  # fmt: skip
        lines += [f"**OVERFIT: the best wins on the search shapes but is {why}.**", ""]
    elif not h["correct"] or h.get("speedup_geomean") is None:
        lines += [f"{h.get('reason')}", ""]
    if h.get("speedup_geomean") is not None:
        ci = f" (95% CI {h['speedup_ci'][0]:.3f}-{h['speedup_ci'][1]:.3f})" if h.get("speedup_ci") else ""
        search = f"{h['search_speedup']:.3f}x" if h.get("search_speedup") is not None else "-"
        lines += [f"held-out speedup {h['speedup_geomean']:.3f}x{ci}, {h.get('verdict')}; "
                  f"on the search shapes {search}", "",
                  "| shape | dtype | baseline us | best us | speedup |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s['shape']} | {s['dtype']} | {s['baseline_us']:.2f} | {s['candidate_us']:.2f} | "
                  f"{s['speedup']:.3f} |" for s in h["per_shape"]]
    return lines


def write_report(report_dir: Path, report: dict, baseline_source: str, best_source: str, source_name: str) -> Path:
    """Write all report files into a temp folder, then move it into place in one rename."""
    report_dir = Path(report_dir)
    report_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kopt-report-", dir=report_dir.parent))
    (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    charts = report_charts(report)
    for name, png in charts.items():
        (tmp / name).write_bytes(png)
    (tmp / "report.md").write_text(render_markdown(report, source_name, list(charts)))
    (tmp / f"best_{source_name}").write_text(best_source)
    flags = (f"# kopt best {report['best']['candidate_id']}: compiler flags "
             f"{' '.join(report['baseline']['flags']) or '(none)'} -> {' '.join(report['best']['flags']) or '(none)'}\n"
             if report.get("best") else "")  # patch(1) and git apply skip text before the first diff header
    (tmp / "best.patch").write_text(flags + unified_diff(baseline_source, best_source, source_name))
    if report_dir.exists():
        stale = report_dir.parent / f".kopt-stale-{tmp.name}"
        os.replace(report_dir, stale)
        os.replace(tmp, report_dir)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, report_dir)
    return report_dir
