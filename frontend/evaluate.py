"""`kopt evaluate KERNEL_DIR --candidate FILE [--target cpu|cuda] [--flags ...] [--json] [--no-holdout]`:
judge one candidate (and `judge`, which `kopt verify` shares), the package's held-out shapes included.

No Temporal: builds the package baseline and the candidate locally (temp dirs, the build workers'
exact compiler command), runs the static checks, the full test against the reference with the
baseline loaded for calibrated tolerances, and the profile with the baseline interleaved (A/B),
then prints a verdict. Exit code 0: correct; 1: rejected (or the baseline itself broken);
2: usage error (bad paths, unknown target, invalid package, no compiler).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from containment.build import Toolchain, build
from frontend import exits
from frontend.inputs import package_and_toolchain
from gpu_worker import runner
from kopt.errors import UsageError
from kopt.flags import check_flags
from kopt.models import (
    ArtifactRef,
    CompileResult,
    ExecRequest,
    KernelSpec,
    PackageRef,
    ProfileResult,
    RoundStatus,
    Shape,
    TestResult,
)
from kopt.package import source_path
from kopt.verdict import CheckCounts, ShapeVerdict, Verdict
from workflows import judging

_NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")  # libraries are local paths here


@dataclass
class Judgement:
    """What judging one candidate found: the verdict (as `kopt evaluate --json` prints it), the steps
    of the judging sequence (workflows/judging.py; None where the baseline did not compile), and
    whether the baseline itself was broken."""

    verdict: Verdict
    steps: judging.Judged | None = None
    baseline_broken: bool = False

    @property
    def tested(self) -> TestResult | None:
        return self.steps.tested if self.steps else None

    @property
    def profiled(self) -> ProfileResult | None:
        return self.steps.profiled if self.steps else None

    @property
    def status(self) -> RoundStatus | None:
        """The candidate's status word (compile error, wrong result, ...); None where the baseline did
        not compile."""
        return self.steps.status() if self.steps else None


def check_inputs(kernel_dir: Path, candidate: Path, target: str | None, flags: list[str] | None,
                 baseline: Path | None = None) -> tuple[KernelSpec, str, Toolchain]:  # fmt: skip
    """The package, target and toolchain of a judging command; UsageError names what is wrong."""
    if target is None:
        target = "cuda" if candidate.suffix == ".cu" else "cpu"
    for path, what in ((candidate, "candidate"), (baseline, "baseline")):
        if path is not None and not path.is_file():
            raise UsageError(f"{path}: {what} source not found")
    problems = check_flags(flags or [], target) if target in ("cpu", "cuda") else []
    if problems:
        raise UsageError(f"--flags: {problems[0]}")
    spec, tc = package_and_toolchain(kernel_dir, target)
    return spec, target, tc


async def judge(kernel_dir: Path, spec: KernelSpec, target: str, tc: Toolchain, candidate: Path,
                flags: list[str] | None = None, baseline: Path | None = None, *, time_cap_s: float | None = None,
                timeout_s: float = 900.0, seed: int = 0, progress=lambda text: None,
                holdout: list[Shape] | None = None) -> Judgement:  # fmt: skip
    """Build the baseline (the package's source, or `baseline`, with the package's flags) and the
    candidate (the package's flags, or `flags`), statically check, test against the reference (the
    baseline loaded for calibrated tolerances) and profile A/B against the baseline. `holdout`: shapes
    tested and timed beside the test and bench shapes, marked held-out in the verdict. No Temporal."""
    source = candidate.read_text()
    package_flags = spec.build[target].flags if target in spec.build else []
    cand_flags = package_flags if flags is None else flags
    base_source = (baseline or source_path(kernel_dir, spec, target)).read_text()
    verdict = Verdict(kernel=spec.name, target=target, candidate=str(candidate), compiler_flags=cand_flags,
                      baseline=str(baseline) if baseline else "package source",
                      holdout_shapes=[h.label for h in holdout or []])  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kopt-evaluate-") as tmp:
        progress(f"building baseline and candidate with {tc.name}")
        base_build, cand_build = await asyncio.gather(
            build(tc, base_source, Path(tmp) / "baseline", package_flags,
                  shown_as=str(baseline or source_path(kernel_dir, spec, target))),
            build(tc, source, Path(tmp) / "candidate", cand_flags, shown_as=str(candidate)),
        )
        verdict.seconds["build"] = round(max(base_build.seconds, cand_build.seconds), 3)
        if not base_build.ok:
            verdict.reason = f"baseline failed: compile error: {judging.compile_error(base_build.log)}"
            return Judgement(verdict, baseline_broken=True)
        compiled = CompileResult(candidate_id=candidate.stem, ok=cand_build.ok, seconds=cand_build.seconds,
                                 log_tail=cand_build.log, library=_NO_ARTIFACT if cand_build.ok else None)  # fmt: skip
        base_lib, cand_lib = Path(tmp) / "baseline" / "kernel.so", Path(tmp) / "candidate" / "kernel.so"
        shapes = spec.shapes[target]

        def request(kind: str) -> ExecRequest:
            return ExecRequest(
                package=PackageRef(spec=spec, files=_NO_ARTIFACT, baseline_sources={}), target=target,
                candidate_id=candidate.stem, library=_NO_ARTIFACT, shapes=[*getattr(shapes, kind), *(holdout or [])],
                dtypes=spec.dtypes,
                seed=seed, timeout_s=timeout_s, source=source, baseline_id="baseline", time_cap_s=time_cap_s,
                large_shapes=kind == "test",
            )  # fmt: skip

        async def step(name: str, shapes_kind: str, what: str, run, take):
            progress(what)
            result = await run(request(shapes_kind), cand_lib, kernel_dir, spec, baseline=base_lib)
            verdict.seconds[name] = round(result.seconds, 3)
            take(verdict, result)
            if isinstance(result, TestResult) and result.baseline_reason:  # as a run fails at round 0
                result = result.model_copy(update={"correct": False, "reason": result.baseline_reason,
                                                   "failed_party": "baseline"})  # fmt: skip
            return result

        steps = await judging.judge(
            compiled,
            lambda: step("test", "test", "testing against the reference (baseline loaded for calibration)",
                         runner.run_test, _take_test),
            lambda: step("profile", "bench", "profiling, interleaved with the baseline (A/B)", runner.run_profile,
                         _take_profile),
        )  # fmt: skip
    verdict.reason = steps.failure()
    if steps.tested is not None and steps.tested.baseline_reason:
        # The baseline, loaded beside the candidate, took a check and failed it: the words `kopt optimize`
        # ends a run with at round 0, where the same baseline is tested alone.
        verdict.reason = f"baseline failed: {verdict.reason}"
    verdict.correct = verdict.reason is None
    return Judgement(verdict, steps, baseline_broken=steps.failed_party in ("baseline", "package"))


async def evaluate(
    kernel_dir: Path, candidate: Path, target: str | None, as_json: bool, settings: object = None, *,
    flags: list[str] | None = None, time_cap_s: float | None = None, timeout_s: float = 900.0, seed: int = 0,
    holdout: bool = True, out: TextIO | None = None, err: TextIO | None = None,
) -> int:  # fmt: skip
    out, err = out or sys.stdout, err or sys.stderr
    kernel_dir, candidate = Path(kernel_dir), Path(candidate)
    try:
        spec, target, tc = check_inputs(kernel_dir, candidate, target, flags)
    except UsageError as exc:
        return _usage(err, str(exc))
    start = time.monotonic()
    judged = await judge(kernel_dir, spec, target, tc, candidate, flags, time_cap_s=time_cap_s, timeout_s=timeout_s,
                         seed=seed, progress=lambda text: _progress(err, as_json, text),
                         holdout=spec.shapes[target].holdout if holdout else None)  # fmt: skip
    return _finish(judged.verdict, as_json, out, start)


def _take_test(verdict: Verdict, tested: TestResult) -> None:
    verdict.device = tested.device or None
    verdict.static_violations = tested.static_violations
    verdict.notes += tested.notes + ([tested.sanitizer] if tested.sanitizer else [])
    checks = tested.checks + tested.variant_checks
    verdict.checks = CheckCounts(total=len(checks), skipped=sum(c.skipped for c in checks),
                                 failed=[c.key for c in checks if not c.ok],
                                 not_applicable=[f"{c.key}: {c.message}" for c in checks if c.skipped])  # fmt: skip


def _take_profile(verdict: Verdict, profiled: ProfileResult) -> None:
    verdict.device = profiled.device or verdict.device
    verdict.copy_bandwidth_gbs = profiled.copy_bandwidth_gbs
    verdict.device_facts = profiled.device_facts
    verdict.notes += profiled.notes
    verdict.flags = profiled.flags
    if not profiled.ok:
        return
    ab = {(s.shape, s.dtype): s for s in (profiled.ab.per_shape if profiled.ab else [])}
    for t in profiled.timings:
        s = ab.get((t.shape, t.dtype))
        verdict.per_shape.append(ShapeVerdict(
            shape=t.shape, dtype=t.dtype, mode=t.mode, candidate_us=t.median_us,
            baseline_us=s.baseline_us if s else None, speedup=s.speedup if s else None,
            speedup_ci=[s.ci_low, s.ci_high] if s else None, gbytes_per_s=t.gbytes_per_s, pct_sol=t.pct_sol,
            samples=t.samples, sampling_s=t.sampling_s, flags=t.flags, held_out=t.shape in verdict.holdout_shapes,
        ))  # fmt: skip
    if profiled.ab is not None:
        verdict.speedup_geomean = profiled.ab.speedup_geomean
        verdict.speedup_ci = [profiled.ab.ci_low, profiled.ab.ci_high]
        verdict.verdict = profiled.ab.verdict
        verdict.noise_floor = profiled.ab.noise_floor


def _finish(verdict: Verdict, as_json: bool, out: TextIO, start: float) -> int:
    verdict.seconds["total"] = round(time.monotonic() - start, 3)
    out.write(verdict.model_dump_json() + "\n" if as_json else render(verdict))
    out.flush()
    return exits.OK if verdict.correct else exits.FAILED


def render(v: Verdict, command: str = "evaluate") -> str:
    lines = [f"kopt {command}: {v.kernel} ({v.target}), candidate {v.candidate}"]
    if v.device:
        bw = f", copy bandwidth {v.copy_bandwidth_gbs:.0f} GB/s" if v.copy_bandwidth_gbs else ""
        lines.append(f"device: {v.device}{bw}")
    for s in v.static_violations:
        lines.append(f"  static: {s}")
    if not v.correct:
        lines.append(f"REJECTED: {v.reason}")
    else:
        checks = v.checks or CheckCounts()
        lines.append(f"correct: {checks.total} checks passed ({checks.skipped} not applicable)")
    if v.per_shape:
        lines.append(f"{'shape':<22} {'dtype':<9} {'mode':<8} {'base us':>9} {'cand us':>9} {'speedup':>8} "
                     f"{'95% CI':>15} {'%SOL':>6}")  # fmt: skip
        for s in v.per_shape:
            ci = f"[{s.speedup_ci[0]:.3f}, {s.speedup_ci[1]:.3f}]" if s.speedup_ci else "-"
            base = f"{s.baseline_us:9.2f}" if s.baseline_us is not None else f"{'-':>9}"
            sp = f"{s.speedup:8.3f}" if s.speedup is not None else f"{'-':>8}"
            sol = f"{s.pct_sol:6.1f}" if s.pct_sol is not None else f"{'-':>6}"
            lines.append(f"{s.shape:<22} {s.dtype:<9} {s.mode:<8} {base} {s.candidate_us:9.2f} {sp} {ci:>15} {sol}")
    if v.speedup_geomean is not None:
        lo, hi = v.speedup_ci
        lines.append(f"geomean speedup {v.speedup_geomean:.3f}x, 95% CI [{lo:.3f}, {hi:.3f}]: {v.verdict}")
    for n in v.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines) + "\n"


def _usage(err: TextIO, message: str) -> int:
    err.write(f"kopt: error: {message}\n")
    return exits.USAGE


def _progress(err: TextIO, as_json: bool, message: str) -> None:
    if not as_json:
        err.write(f"kopt evaluate: {message} ...\n")
        err.flush()
