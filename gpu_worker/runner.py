"""Parent side of the isolated harness: run one test or profile job in a fresh subprocess.

Used by the Temporal test/profile activities and by `kopt evaluate`. Before anything runs, the
candidate's source (when given) and its library's imports pass the static checks. The kernel then
runs only in the child (`python -m gpu_worker.harness`), so a segfault, a hang, a fork or an
exit() in it is a failed result here, never a dead worker; on CUDA the test also runs once more
under compute-sanitizer where it exists. This module never imports torch: the worker process must
not hold a CUDA context of its own. Candidate failures are data; only bugs in this module raise.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from containment import jail
from gpu_worker import nsight, sanitizer, spawn, static_checks
from gpu_worker.device import cpu_name
from gpu_worker.protocol import PROGRESS_PREFIX, HarnessJob, host_death, new_key
from gpu_worker.sandbox import FSIZE_LIMIT, SIGSYS_REASON
from gpu_worker.spawn import HEARTBEAT_S, Heartbeat, Outcome  # noqa: F401 - HEARTBEAT_S: tests tune it
from kopt.models import DEFAULT_TOLERANCES, ExecRequest, KernelSpec, Partial, ProfileResult, TestResult, Tolerance
from kopt.redact import redact, redact_lines

__all__ = ["DEFAULT_TOLERANCES", "HarnessJob", "PROGRESS_PREFIX", "run_harness", "run_profile", "run_test",
           "static_check"]

TAIL_BYTES = spawn.TAIL_BYTES
LOCATE_TIMEOUT_S = 120.0  # each job of locate_fault
OnPartial = Callable[[Partial], None]
_COPY_BANDWIDTH: dict[str, float] = {}  # target -> GB/s, from this worker's first profile


def tolerances_for(spec: KernelSpec) -> dict[str, Tolerance]:
    """The package's per-dtype tolerances, docs/measurement.md defaults where it is silent."""
    return {**DEFAULT_TOLERANCES, **spec.tolerances}


def static_check(source: str | None, library: Path, target: str) -> tuple[list[str], list[str]]:
    """(violations, notes) of the static checks: the source when given, the library's imports."""
    violations = static_checks.check_source(source, target) if source is not None else []
    notes = [] if source is not None else ["no candidate source given: source checks skipped"]
    lib_violations, lib_notes = static_checks.check_library(Path(library), target)
    return violations + lib_violations, notes + lib_notes


async def run_test(
    req: ExecRequest, library: Path, package_dir: Path, spec: KernelSpec, heartbeat: Heartbeat | None = None,
    baseline: Path | None = None, resume: list[Partial] | None = None, on_partial: OnPartial | None = None,
) -> TestResult:  # fmt: skip
    """Check a compiled candidate against the package reference over req.shapes x req.dtypes (plus
    edge shapes and input variants); `baseline`: the baseline library, for calibrated tolerances.
    `on_partial` gets each check group that passed as it passes; `resume`: groups an earlier
    attempt passed, not run again."""
    start = time.monotonic()
    violations, notes = static_check(req.source, library, req.target)
    if violations:
        return TestResult(
            candidate_id=req.candidate_id, correct=False, reason=f"static check: {violations[0]}",
            static_violations=violations, notes=notes, device=_device(req.target), seconds=time.monotonic() - start,
            failed_party="candidate",
        )  # fmt: skip
    job = _job("test", req, library, package_dir, spec, baseline, resume)
    result: TestResult = await _run(job, req.timeout_s, heartbeat, on_partial=on_partial)  # type: ignore[assignment]
    result.notes = notes + result.notes
    if result.fault_group is not None and result.reason:
        first, _, rest = result.reason.partition("\n")
        named = await locate_fault(job, result.fault_group, req.timeout_s, heartbeat)
        result.reason = f"{first}; {named}" + (f"\n{rest}" if rest else "")
    if result.correct and req.target == "cuda" and req.sanitize:
        ok, summary = await sanitizer.run(_job("test", req, library, package_dir, spec, None), req, heartbeat)
        result.sanitizer = summary
        if ok is False:
            result.correct, result.reason, result.failed_party = False, summary, "candidate"
    result.seconds = time.monotonic() - start
    return result


async def locate_fault(job: HarnessJob, group: str, timeout_s: float, heartbeat: Heartbeat | None) -> str:
    """Which argument a candidate's memory fault at check group `group` went through: the group again
    (same seed and salt, so the same shapes and inputs), first with every argument given poisoned room
    around it (a fault then is no overrun of one buffer), then once per argument with only that one
    placed against unmapped memory (docs/decisions/0029-buffers-against-unmapped-memory.md). A
    sentence for the verdict."""

    async def faults(fence_only: str, writable_inputs: bool = False) -> bool:
        probe = job.model_copy(update={"only_group": group, "fence_only": fence_only, "baseline_library": None,
                                       "resume": [], "writable_inputs": writable_inputs})  # fmt: skip
        found = await _run(probe, min(timeout_s, LOCATE_TIMEOUT_S), heartbeat)
        return isinstance(found, TestResult) and found.fault_group is not None

    if await faults(""):
        if job.target == "cpu" and not await faults("", writable_inputs=True):
            return ("it writes an input: the call does not fault with its inputs writable (a kernel sees its inputs "
                    "as read-only memory; one that writes an input, even to put it back before returning, is wrong "
                    "where the caller's input is read-only or read by another thread meanwhile)")  # fmt: skip
        if "layout:paged" in group:  # the layout's read-only pages are there with room or without
            return ("it faults where every row ends at a page end and the page after it is read-only: most likely "
                    "a write past a row's end (even one that puts back what was there: another thread writing that "
                    "memory, the caller's, loses its writes)")  # fmt: skip
        return ("it faults with every argument given room around it too: an access far outside its buffers "
                "(a stray pointer), not an overrun of one")  # fmt: skip
    hits = [arg.name for arg in job.spec.arguments if await faults(arg.name)]
    if len(hits) == 1:
        return (f"the access outside its buffers goes through `{hits[0]}`: the call faults with only `{hits[0]}` "
                "against unmapped memory (the other arguments with room around them)")  # fmt: skip
    if hits:
        return (f"the accesses outside their buffers go through {', '.join(f'`{h}`' for h in hits)}: the call "
                "faults with any one of them alone against unmapped memory")  # fmt: skip
    return ("it does not fault again with any one argument alone against unmapped memory (the others given room): "
            "the access depends on where the buffers lie")


async def run_profile(
    req: ExecRequest, library: Path, package_dir: Path, spec: KernelSpec, heartbeat: Heartbeat | None = None,
    baseline: Path | None = None, resume: list[Partial] | None = None, on_partial: OnPartial | None = None,
) -> ProfileResult:  # fmt: skip
    """Time a compiled candidate over req.shapes x req.dtypes (cold L2 or graph mode on CUDA);
    with `baseline`, interleaved A/B against it in the same process (result.ab). `on_partial`
    gets each timed shape and dtype as it is done; `resume`: those an earlier attempt timed."""
    start = time.monotonic()
    job = _job("profile", req, library, package_dir, spec, baseline, resume)
    job.copy_bandwidth_gbs = _COPY_BANDWIDTH.get(req.target)
    result: ProfileResult = await _run(job, req.timeout_s, heartbeat, on_partial=on_partial)  # type: ignore[assignment]
    if result.ok and result.copy_bandwidth_gbs and job.copy_bandwidth_gbs is None:
        _COPY_BANDWIDTH[req.target] = result.copy_bandwidth_gbs  # calibrated once per worker process
    ab = result.ab
    contender = baseline is None or (ab is not None and ab.verdict == "faster" and ab.speedup_geomean is not None
                                     and ab.speedup_geomean > (req.nsight_above or 0.0))  # fmt: skip
    if result.ok and req.target == "cuda" and req.nsight and contender:
        result.nsight = await nsight.run(job, req.shapes, heartbeat)
    result.seconds = time.monotonic() - start
    return result


async def run_harness(
    mode: Literal["test", "profile"], req: ExecRequest, library: Path, package_dir: Path, spec: KernelSpec,
    heartbeat: Heartbeat | None = None, baseline: Path | None = None,
) -> TestResult | ProfileResult:  # fmt: skip
    """The isolated run alone, without the static checks or the sanitizer: for tests that must show
    the runtime layer catches a cheat on its own, and for benchmarks."""
    start = time.monotonic()
    result = await _run(_job(mode, req, library, package_dir, spec, baseline), req.timeout_s, heartbeat)
    result.seconds = time.monotonic() - start
    return result


def _job(
    mode: Literal["test", "profile"], req: ExecRequest, library: Path, package_dir: Path, spec: KernelSpec,
    baseline: Path | None, resume: list[Partial] | None = None,
) -> HarnessJob:  # fmt: skip
    return HarnessJob(
        mode=mode, target=req.target, candidate_id=req.candidate_id, library=str(Path(library).resolve()),
        package_dir=str(Path(package_dir).resolve()), spec=spec, shapes=req.shapes, dtypes=req.dtypes,
        seed=req.seed, salt=secrets.token_hex(8), tolerances=tolerances_for(spec), trials=req.trials,
        time_cap_s=req.time_cap_s, baseline_library=str(Path(baseline).resolve()) if baseline else None,
        baseline_id=req.baseline_id, baseline_errors=req.baseline_errors, edge_shapes=req.edge_shapes,
        timing_mode=req.timing_mode, memory_limit_mb=req.memory_limit_mb, noise_floor=req.noise_floor,
        resume=[p for p in resume or [] if p.key.startswith(mode + " ")], large_shapes=req.large_shapes,
    )  # fmt: skip


async def _run(job: HarnessJob, timeout_s: float, heartbeat: Heartbeat | None,
               on_partial: OnPartial | None = None) -> TestResult | ProfileResult:
    workdir = Path(tempfile.mkdtemp(prefix=spawn.WORKDIR_PREFIX))
    try:
        outcome = await spawn.spawn(job, new_key(), workdir, timeout_s, heartbeat,
                                    _partial_parser(on_partial) if on_partial else None)  # fmt: skip
        return interpret(job, outcome)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _partial_parser(on_partial: OnPartial) -> Callable[[str], None]:
    def parse(body: str) -> None:
        try:
            on_partial(Partial.model_validate_json(body))
        except ValidationError:
            pass  # not a piece worth resuming from; the final result still reports everything

    return parse


def interpret(job: HarnessJob, out: Outcome) -> TestResult | ProfileResult:
    """Turn the child's exit status and authenticated frames into a result model, with every text
    the candidate could have written into it (reasons, notes, log tails) redacted (kopt.redact)."""
    result = _interpret(job, out)
    result.reason = redact(result.reason) if result.reason else result.reason
    result.notes = redact_lines(result.notes)
    return result


def _interpret(job: HarnessJob, out: Outcome) -> TestResult | ProfileResult:
    during = out.frames.last_step
    where = f" (during {during})" if during else ""
    tail = _stderr_tail(out.log)
    if out.frames.tampered:
        return failed(job, f"result channel tampered with: {out.frames.tampered}{where}")
    if out.timed_out:
        return failed(job, f"timed out after {out.timeout_s:g} s{where}")
    rc = out.returncode
    if rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGSYS:
            return failed(job, f"killed by the sandbox: {SIGSYS_REASON}{where}")
        if sig == signal.SIGXFSZ:
            return failed(job, f"killed: wrote more than {FSIZE_LIMIT >> 20} MiB to stdout/stderr{where}")
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return failed(job, f"crashed: {name}{where}\n{tail}")
    if rc == jail.SETUP_FAILED and not during:
        return failed(job, f"sandbox unavailable, candidate not run: {_jail_reason(out.log)} (the host must allow "
                      f"namespaces; {jail.ESCAPE_HATCH}=1 with KOPT_SANDBOX=off runs without, at your own risk)")
    if rc:
        return failed(job, f"exited with code {rc}{where}: {tail}")
    if out.frames.result is None:
        return failed(
            job, f"harness produced no valid result: the process exited with code 0 without an authenticated "
            f"result{where} (does the kernel call exit()?)\n{tail}",
        )  # fmt: skip
    if out.leftover:
        return failed(job, f"a process started by the kernel outlived the harness (fork){where}")
    model = TestResult if job.mode == "test" else ProfileResult
    try:
        result = model.model_validate_json(out.frames.result)
    except ValidationError as exc:
        return failed(job, f"harness produced no valid result: {exc.errors()[0]['msg']}{where}")
    result.candidate_id = job.candidate_id
    if host_death(result.reason) and tail.strip():
        result.reason = f"{result.reason}\n{tail}"
    return result


def failed(job: HarnessJob, reason: str) -> TestResult | ProfileResult:
    device = _device(job.target)
    if job.mode == "test":
        return TestResult(candidate_id=job.candidate_id, correct=False, reason=reason.strip(), device=device)
    return ProfileResult(candidate_id=job.candidate_id, ok=False, reason=reason.strip(), device=device)


def _device(target: str) -> str:
    return cpu_name() if target == "cpu" else ""


def _jail_reason(log: str) -> str:
    lines = [ln.removeprefix("kopt-jail: ") for ln in log.splitlines() if ln.startswith("kopt-jail: ")]
    return lines[-1] if lines else "the jail could not be built"


def _stderr_tail(log: str) -> str:
    """The last TAIL_BYTES of the child's output without the harness's own progress lines."""
    text = "\n".join(ln for ln in log.splitlines() if not ln.startswith(PROGRESS_PREFIX))
    return text[-TAIL_BYTES:]
