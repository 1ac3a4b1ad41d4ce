"""`kopt verify`: the regression gate a kernel pipeline runs on every change to a kernel.

    kopt verify KERNEL_DIR --candidate FILE [--target cpu|cuda] [--flags=-O3,...] [--baseline FILE]
                [--junit PATH] [--json PATH] [--max-slowdown F] [--no-holdout]

The candidate is judged exactly as `kopt evaluate` judges it (frontend/evaluate.judge: the harness
of docs/measurement.md, no Temporal server): static checks, the test against the package reference
with the baseline loaded for calibration, and the profile interleaved A/B against the baseline (the
package's own source, or `--baseline`, e.g. the kernel on the main branch). The package's declared
held-out shapes (kernel.toml `holdout`) are tested and timed beside the test and bench shapes
(unless --no-holdout): a candidate that wins on the bench shapes and is slower at a held-out one is
an OVERFIT, exit 3. Exit codes:

    0  pass: correct, and no shape statistically slower than the baseline beyond --max-slowdown
    1  wrong: does not compile, fails a static check, a correctness check or a timing re-check
    2  bad input: paths, package, target, flags (one line, before anything is built)
    3  slower: correct, but at some (shape, dtype) the whole 95 % interval of baseline/candidate lies
       below 1 / (1 + max_slowdown), and below 1 - the target's noise floor (CPU 4 %, CUDA 0.5 %:
       unchanged code timed against itself is off by up to that much; docs/decisions/0027)
    4  infrastructure: the baseline itself does not build or pass, or the harness failed
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TextIO

from frontend import exits
from frontend.evaluate import Judgement, check_inputs, judge, render
from kopt.errors import UsageError
from kopt.models import SHAPE_SLOWDOWN_LIMIT

DEFAULT_MAX_SLOWDOWN = SHAPE_SLOWDOWN_LIMIT  # the optimizer's per-shape guard uses the same limit


def decide(judged: Judgement, max_slowdown: float) -> tuple[int, str]:
    v = judged.verdict
    if judged.baseline_broken:
        return exits.INFRA, f"the baseline itself fails: {(v.reason or '').removeprefix('baseline failed: ')}"
    if not v.correct:
        return exits.FAILED, f"rejected: {v.reason}"
    slow = v.regressions(max_slowdown)
    if slow:
        worst = min(slow, key=lambda s: s.speedup)
        overfit = all(s.held_out for s in slow)  # the bench shapes pass; only shapes it never saw fail
        return exits.SLOWER, (("OVERFIT: passes on the bench shapes but is " if overfit else "")
                             + f"slower than the baseline (interval below {v.limit(max_slowdown):.3f}x) at "
                             + f"{len(slow)} "
                             + ("held-out " if overfit else "") + f"shape(s); worst "
                             f"{worst.shape} {worst.dtype}: {worst.speedup:.3f}x "
                             f"[{worst.speedup_ci[0]:.3f}, {worst.speedup_ci[1]:.3f}]")  # fmt: skip
    gm = v.speedup_geomean
    return exits.OK, "pass" + (f": geomean {gm:.3f}x [{v.speedup_ci[0]:.3f}, {v.speedup_ci[1]:.3f}]"
                                if gm is not None else "")  # fmt: skip


def junit(judged: Judgement | None, code: int, summary: str, kernel: str, target: str, max_slowdown: float,
          seconds: float) -> ET.ElementTree:  # fmt: skip
    """One testcase per build, per correctness check and per (shape, dtype) timing, figures in the
    messages (a failure's message, else the case's system-out)."""
    suite = ET.Element("testsuite", name=f"kopt verify {kernel} ({target})")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}

    def case(group: str, name: str, ok: bool | None, text: str, kind: str = "failure") -> None:
        el = ET.SubElement(suite, "testcase", classname=f"kopt.{kernel}.{target}.{group}", name=name)
        counts["tests"] += 1
        if ok is None:
            ET.SubElement(el, "skipped", message=text)
            counts["skipped"] += 1
        elif not ok:
            ET.SubElement(el, kind, message=text).text = text
            counts["failures" if kind == "failure" else "errors"] += 1
        else:
            ET.SubElement(el, "system-out").text = text

    if judged is None:
        case("harness", "verify", False, summary, kind="error")
    else:
        v = judged.verdict
        reason = v.reason or ""
        base_fails = judged.steps is None
        cand_fails = judged.status == "compile error"
        case("build", "baseline", not base_fails, reason if base_fails else "builds", kind="error")
        case("build", "candidate", None if base_fails else not cand_fails,
             reason if cand_fails else f"builds with {' '.join(v.compiler_flags) or 'no flags'}")  # fmt: skip
        if judged.tested is not None:
            case("static", "static checks", not v.static_violations,
                 "; ".join(v.static_violations) or "no violation")  # fmt: skip
            checks = [*judged.tested.checks, *judged.tested.variant_checks]
            for c in checks:
                figures = (f"max |err| {c.max_abs_err:.3g}" + (f" (bound {c.error_bound:.3g})" if c.error_bound
                                                               else "") if c.max_abs_err is not None else "")  # fmt: skip
                case("correctness", f"{c.shape} {c.dtype} {c.variant or 'declared'}",
                     None if c.skipped else c.ok, c.message or figures or "ok")  # fmt: skip
            if not judged.tested.correct and not v.static_violations and all(c.ok for c in checks):
                case("correctness", "test", False, reason)  # failed outside any check (a crash, a timeout)
        if judged.profiled is not None and not judged.profiled.ok:
            case("timing", "profile", False, reason, kind="error" if judged.baseline_broken else "failure")
        slow = {(s.shape, s.dtype) for s in v.regressions(max_slowdown)}
        for s in v.per_shape:
            if s.speedup is None:
                continue
            text = (f"baseline {s.baseline_us:.2f} us, candidate {s.candidate_us:.2f} us, speedup "
                    f"{s.speedup:.3f}x, 95% CI [{s.speedup_ci[0]:.3f}, {s.speedup_ci[1]:.3f}] "
                    f"({s.mode}; limit {v.limit(max_slowdown):.3f})")  # fmt: skip
            case("timing", f"{s.shape} {s.dtype}" + (" (held-out)" if s.held_out else ""),
                 (s.shape, s.dtype) not in slow, text)
    for k, n in counts.items():
        suite.set(k, str(n))
    suite.set("time", f"{seconds:.3f}")
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="exit_code", value=str(code))
    root = ET.Element("testsuites", name="kopt verify")
    root.append(suite)
    for k in ("tests", "failures", "errors", "skipped"):
        root.set(k, suite.get(k))
    ET.indent(root)
    return ET.ElementTree(root)


async def verify(kernel_dir: Path, candidate: Path, target: str | None = None, flags: list[str] | None = None,
                 baseline: Path | None = None, junit_path: Path | None = None, json_path: Path | None = None,
                 max_slowdown: float = DEFAULT_MAX_SLOWDOWN, *, time_cap_s: float | None = None, seed: int = 0,
                 holdout: bool = True, out: TextIO | None = None, err: TextIO | None = None) -> int:  # fmt: skip
    out, err = out or sys.stdout, err or sys.stderr
    kernel_dir, candidate = Path(kernel_dir), Path(candidate)
    try:
        if not max_slowdown >= 0:
            raise UsageError(f"--max-slowdown must be >= 0, got {max_slowdown}")
        spec, target, tc = check_inputs(kernel_dir, candidate, target, flags, baseline)
        for path in (junit_path, json_path):
            if path is not None and not path.parent.is_dir():
                raise UsageError(f"{path}: its directory does not exist")
    except UsageError as exc:
        err.write(f"kopt: error: {exc}\n")
        return exits.USAGE
    start = time.monotonic()
    judged: Judgement | None = None
    try:
        judged = await judge(kernel_dir, spec, target, tc, candidate, flags, baseline, time_cap_s=time_cap_s,
                             seed=seed, progress=lambda text: err.write(f"kopt verify: {text} ...\n"),
                             holdout=spec.shapes[target].holdout if holdout else None)  # fmt: skip
        code, summary = decide(judged, max_slowdown)
    except Exception as exc:  # noqa: BLE001 - the harness itself failed: the pipeline must see "infrastructure"
        code, summary = exits.INFRA, f"infrastructure failure: {type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    if judged is not None:
        judged.verdict.seconds["total"] = round(seconds, 3)
        out.write(render(judged.verdict, "verify"))
    out.write(f"kopt verify: {summary} (exit {code})\n")
    out.flush()
    if junit_path is not None:
        junit(judged, code, summary, spec.name, target, max_slowdown, seconds).write(
            junit_path, encoding="utf-8", xml_declaration=True)  # fmt: skip
    if json_path is not None:
        record = dict(judged.verdict.model_dump(mode="json") if judged else {}, exit_code=code, summary=summary,
                      max_slowdown=max_slowdown,
                      regressions=[s.model_dump(mode="json") for s in judged.verdict.regressions(max_slowdown)]
                      if judged else [])  # fmt: skip
        json_path.write_text(json.dumps(record, indent=1) + "\n")
    return code
