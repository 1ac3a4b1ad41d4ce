"""report.json, report.md and report.html for a finished run, written atomically (never half a report)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from frontend.report_html import render_html
from kopt.candidates import unified_diff
from kopt.models import ShapeSpeedup, ShapeTiming
from kopt.report_models import ReportBaseline, RunReport, WorkloadWeight
from kopt.run_models import HoldoutResult, OptimizeRequest, OptimizeResult, SpecializedResult


def build_report(run_id: str, temporal_run_id: str, req: OptimizeRequest, res: OptimizeResult,
                 ui_url: str | None) -> RunReport:
    baseline = res.baseline
    return RunReport(
        run_id=run_id, temporal_run_id=temporal_run_id, web_ui=ui_url, kernel=res.kernel, target=res.target,
        gpu_class=res.gpu_class, toolchain=req.toolchain, provider=req.provider, rounds_requested=req.rounds,
        status=res.status, device=baseline.profile.device if baseline.profile else None,
        device_facts=baseline.profile.device_facts if baseline.profile else [],
        toolchain_facts=baseline.compile.toolchain_facts if baseline.compile else [],
        baseline=ReportBaseline(
            candidate_id=baseline.candidate_id, flags=baseline.flags, tunables=baseline.tunables,
            compile_seconds=baseline.compile.seconds if baseline.compile else None,
            per_shape=baseline.profile.timings if baseline.profile else [],
            copy_bandwidth_gbs=baseline.profile.copy_bandwidth_gbs if baseline.profile else None,
            nsight=baseline.profile.nsight if baseline.profile else None),
        segments=res.segments, stop_reason=res.stop_reason, extra_test_shapes=[s.dims for s in res.extra_test_shapes],
        usage=res.usage, candidates_per_round=req.candidates_per_round, single_agent=req.single_agent,
        model=req.llm.model if req.llm else None, rounds=res.rounds, best=res.best,
        allow_regressions=req.allow_regressions,
        best_regressions=[f"{s.shape} {s.dtype}" for s in res.best.per_shape if s.regression()] if res.best else [],
        round_regressions={r.candidate_id: r.regressions for r in res.rounds if r.regressions},
        holdout=res.holdout, specialized=res.specialized, objective="workload" if req.workload else "geomean",
        workload=[WorkloadWeight(shape=s.label, weight=s.weight) for s in req.workload],
    )  # fmt: skip


def baseline_sol(best: list[ShapeSpeedup], round_zero: list[ShapeTiming]) -> dict[str, float]:
    """The baseline's %SOL per "shape dtype" for the charts, from the same interleaved A/B as the best's
    where there is one (its median against the best's: same bytes moved), so the %SOL chart and the
    per-shape table agree; else round 0's own profile."""
    sol = {f"{t.shape} {t.dtype}": t.pct_sol for t in round_zero if t.pct_sol is not None}
    sol.update({f"{s.shape} {s.dtype}": s.pct_sol * s.candidate_us / s.baseline_us for s in best
                if s.pct_sol is not None and s.baseline_us > 0})
    return sol


def report_charts(report: RunReport) -> dict[str, bytes]:
    """The charts of a report (frontend/charts.py), by file name."""
    from frontend.charts import run_charts

    best = report.best.per_shape if report.best else []
    return run_charts(report.kernel, report.target, baseline_sol(best, report.baseline.per_shape), best,
                      report.rounds)


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def render_markdown(report: RunReport, source_name: str, charts: list[str] | tuple[str, ...] = ()) -> str:
    r = report
    lines = [f"# kopt report: {r.kernel} ({r.target})", ""]
    lines += [f"- run: `{r.run_id}` (Temporal run `{r.temporal_run_id}`)"]
    if r.web_ui:
        lines += [f"- Web UI: {r.web_ui}"]
    u = r.usage
    lines += [f"- device: {r.device}", f"- toolchain: {r.toolchain}, provider: {r.provider}"
              + (f", model {r.model}" if r.model else ""),
              f"- usage: {u.llm_calls} LLM calls, {u.prompt_tokens} + {u.completion_tokens} tokens, "
              f"${u.cost_usd:.4f}, {u.device_seconds:.1f} s of device time"]
    if r.stop_reason:
        lines.append(f"- stopped early: {r.stop_reason}")
    lines.append("")
    best = r.best
    if best:
        what = "workload-weighted speedup" if r.objective == "workload" else "geomean speedup"
        made = "shape-specialized" if r.specialized and r.specialized.accepted else f"round {best.round}"
        lines += [f"## Best: `{best.candidate_id}` ({made}), "
                  f"{what} {best.speedup_geomean:.3f}x"
                  + (f" (95% CI {best.speedup_ci[0]:.3f}-{best.speedup_ci[1]:.3f})" if best.speedup_ci else ""), "",
                  f"flags: `{' '.join(best.flags)}`, tunables: `{best.tunables}`", "",
                  "| shape | dtype | baseline us | best us | speedup | 95% CI | %SOL |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for s in best.per_shape:
            sol = f"{s.pct_sol:.1f}" if s.pct_sol is not None else "-"
            ci = f"{s.ci_low:.3f}-{s.ci_high:.3f}" if s.ci_low is not None and s.ci_high is not None else "-"
            lines.append(f"| {s.shape} | {s.dtype} | {s.baseline_us:.2f} | {s.candidate_us:.2f} | "
                         f"{s.speedup:.3f} | {ci} | {sol} |")
        if any(s.ci_low is not None for s in best.per_shape):
            lines += ["", "All figures of a row come from one interleaved A/B of the best against the baseline: "
                      "baseline us and best us are each side's median over its samples; the speedup is the "
                      "paired estimate (the trimmed mean of the ratios of blocks taken side by side, which cancels "
                      "the machine's drift between blocks), so on a noisy machine it can differ from the ratio of "
                      "the two medians."]
    if r.best_regressions:
        lines += ["", f"**The best is slower than the baseline at {', '.join(r.best_regressions)}** "
                      "(accepted because the run allowed regressions)."]  # fmt: skip
    if r.round_regressions:
        lines += ["", "Candidates slower than the baseline at some shapes"
                  + (" (allowed):" if r.allow_regressions else " (not eligible as the best):"), ""]
        lines += [f"- `{cid}`: {', '.join(shapes)}" for cid, shapes in r.round_regressions.items()]
    if r.workload:
        weights = ", ".join(f"{w.shape} {w.weight:.3f}" for w in r.workload)
        lines += ["", f"Workload (timed shapes by weight): {weights}"]
    lines += specialized_lines(r.specialized)
    lines += holdout_lines(r.holdout)
    captions = {"speedup.png": "per-shape speedup of the best", "sol.png": "% of speed of light",
                "progress.png": "progress by round"}  # fmt: skip
    if charts:
        lines += [""] + [f"![{captions.get(c, c)}]({c})" for c in charts]
    elif r.best and charts is not None and not _have_matplotlib():
        lines += ["", "(no charts: matplotlib is not installed here)"]
    gpus = any(rec.gpu_index is not None for rec in r.rounds)  # several GPUs judged the candidates: which one
    lines += ["", "## Rounds", "",
              "| round | change | compiled | correct | geomean speedup | verdict |" + (" GPU |" if gpus else ""),
              "| --- | --- | --- | --- | --- | --- |" + (" --- |" if gpus else "")]
    for rec in r.rounds:
        sp = f"{rec.speedup_geomean:.3f}" if rec.speedup_geomean is not None else "-"
        gpu = (f" {rec.gpu_index if rec.gpu_index is not None else '-'} |") if gpus else ""
        lines.append(f"| {rec.round} | {rec.description} | {rec.compiled} | {rec.correct} | {sp} | "
                     f"{_round_verdict(rec).replace('|', '/')} |{gpu}")
    lines += ["", f"The best source is in `best_{source_name}`; `best.patch` is its diff from the baseline.", ""]
    facts = r.device_facts + [f for f in r.toolchain_facts if f.startswith(("compiler:", "every build:"))]
    if facts:  # what the workers reported, as the agents' prompts showed it (with the allowed headers there)
        lines += ["## Machine and toolchain", "", *(f"- {f}" for f in facts), ""]
    lines += nsight_lines(r)
    return "\n".join(lines)


def nsight_lines(r: RunReport) -> list[str]:
    """The baseline's and the best's Nsight Compute summaries (CUDA), and what they cost the run."""
    shown = [("Baseline", r.baseline.nsight)]
    if r.best is not None and r.best.candidate_id != r.baseline.candidate_id:
        shown.append((f"Best ({r.best.candidate_id})", r.best.nsight))
    shown = [(who, n) for who, n in shown if n is not None]
    if not shown:
        return []
    lines = ["## Profiler (Nsight Compute)", "",
             f"What the profile analyst was shown; advisory (never part of a verdict). The summaries cost "
             f"{r.usage.nsight_seconds:.1f} s of the run's {r.usage.device_seconds:.1f} device seconds.", ""]
    for who, n in shown:
        first, *rest = n.lines()
        lines += [f"{who}: {first}", "", *rest, ""]
    return lines


def specialized_lines(sp: SpecializedResult | None) -> list[str]:
    """The report's shape-specialized section: the values chosen per bucket and what came of them."""
    if not sp:
        return []
    lines = ["", "## Shape-specialized build", ""]
    if sp.settings:
        lines += ["| bucket | tunables | from candidate |", "| --- | --- | --- |"]
        lines += [f"| {b} | `{t}` | `{c}` |" for b, t, c in zip(sp.buckets, sp.settings, sp.picked_from)]
        lines.append("")
    if sp.speedup_geomean is not None:
        lines.append(f"`{sp.candidate_id}`: {sp.speedup_geomean:.3f}x over the baseline, "
                     + ("**kept as the best** (one library that dispatches on the call's shape)" if sp.accepted
                        else f"not kept: {sp.reason}"))
    else:
        lines.append(f"not built or not measured: {sp.reason}")
    return lines


def holdout_lines(h: HoldoutResult | None) -> list[str]:
    """The report's held-out section: the best on shapes the search never saw, and an overfit flag."""
    if not h:
        return []
    lines = ["", f"## Held-out shapes ({'; '.join(h.shapes)})", ""]
    new = [r for r in h.regressions if r not in h.foretold]
    if h.overfit:
        why = (h.reason if not h.correct else
               f"slower than the baseline at {', '.join(new)}" if new
               else "slower than the baseline over the held-out shapes")  # fmt: skip
        lines += [f"**OVERFIT: the best wins on the search shapes but is {why}.**", ""]
    elif not h.correct or h.speedup_geomean is None:
        lines += [f"{h.reason}", ""]
    if h.foretold:
        lines += [f"Slower than the baseline at {', '.join(h.foretold)}, in a dtype where the search shapes already "
                  "showed the best slower (not an overfit: see the per-shape table above).", ""]
    if h.speedup_geomean is not None:
        ci = f" (95% CI {h.speedup_ci[0]:.3f}-{h.speedup_ci[1]:.3f})" if h.speedup_ci else ""
        search = f"{h.search_speedup:.3f}x" if h.search_speedup is not None else "-"
        lines += [f"held-out speedup {h.speedup_geomean:.3f}x{ci}, {h.verdict}; on the search shapes {search}", "",
                  "| shape | dtype | baseline us | best us | speedup |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s.shape} | {s.dtype} | {s.baseline_us:.2f} | {s.candidate_us:.2f} | {s.speedup:.3f} |"
                  for s in h.per_shape]
    return lines


def _round_verdict(rec) -> str:
    """What became of a round's candidate, in the words of the run: the new best, its failure, the rule
    that kept the best, or its shapes slower than the baseline."""
    if rec.accepted:
        return "new best"
    if rec.failure:
        return rec.failure
    if rec.regressions:
        return f"slower than the baseline at {', '.join(rec.regressions)}"
    return rec.refusal.removeprefix("not the new best: ") if rec.refusal else "not the round's best"


def best_patch(report: RunReport, baseline_source: str, best_source: str, source_name: str) -> str:
    """best.patch: the best's source as a diff from the baseline's, headed by the compiler flags."""
    flags = (f"# kopt best {report.best.candidate_id}: compiler flags "
             f"{' '.join(report.baseline.flags) or '(none)'} -> {' '.join(report.best.flags) or '(none)'}\n"
             if report.best else "")  # patch(1) and git apply skip text before the first diff header
    return flags + unified_diff(baseline_source, best_source, source_name)


def report_page(report: RunReport, charts: dict[str, bytes], baseline_source: str, best_source: str,
                source_name: str, history: str = "") -> str:  # fmt: skip
    """The one HTML page of a report (report.html, `kopt export --format html`): report.md with its
    charts, the best's diff and, where given, the run's history folded away."""
    return render_html(render_markdown(report, source_name, list(charts)), charts,
                       best_patch(report, baseline_source, best_source, source_name), history,
                       title=f"kopt report: {report.kernel} ({report.target})")


def write_report(report_dir: Path, report: RunReport, baseline_source: str, best_source: str,
                 source_name: str) -> Path:  # fmt: skip
    """Write all report files into a temp folder, then move it into place in one rename."""
    report_dir = Path(report_dir)
    report_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kopt-report-", dir=report_dir.parent))
    (tmp / "report.json").write_text(report.to_json())
    charts = report_charts(report)
    for name, png in charts.items():
        (tmp / name).write_bytes(png)
    (tmp / "report.md").write_text(render_markdown(report, source_name, list(charts)))
    (tmp / f"best_{source_name}").write_text(best_source)
    (tmp / "best.patch").write_text(best_patch(report, baseline_source, best_source, source_name))
    (tmp / "report.html").write_text(report_page(report, charts, baseline_source, best_source, source_name))
    if report_dir.exists():
        stale = report_dir.parent / f".kopt-stale-{tmp.name}"
        os.replace(report_dir, stale)
        os.replace(tmp, report_dir)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, report_dir)
    return report_dir
