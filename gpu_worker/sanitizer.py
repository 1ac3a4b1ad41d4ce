"""compute-sanitizer memcheck (and racecheck for kernels with shared memory) on a CUDA candidate.

Runs the harness test mode once more with the candidate's kernel host under `compute-sanitizer
--tool memcheck` (the judge's own work, references and checks, is not instrumented), in a separate
child, once per shape class (docs/measurement.md, correctness 5; racecheck over the declared test shapes
only, see sanitizer_job): every declared test shape (each stands
for a class: tiny, odd-sized, mid, serving-size) with its variants (edge shapes, scales, the
padded-row layout), plus the smallest bench shape larger than all of them, since kernels may
dispatch on size (cache hints above the L2 size, say); one trial each, no baseline. Findings fail
the candidate with the sanitizer's first error lines; a missing binary is a note, never a pass in
disguise.
"""

from __future__ import annotations

import re
from pathlib import Path

from containment.build import find_cuda_tool
from gpu_worker import plan, spawn
from gpu_worker.protocol import HarnessJob, new_key
from kopt.models import ExecRequest, Shape

ERROR_EXIT = 86
PRINT_LIMIT = 10


def find_sanitizer() -> str | None:
    return find_cuda_tool("compute-sanitizer")


SANITIZE_MAX_ELEMENTS = 1 << 28  # the above-the-test-sizes class only up to this size (memcheck is slow)
SANITIZE_FUZZ_BUDGET = 1 << 20  # memcheck sees the job's fuzzed shapes drawn under this element budget


def class_shapes(job: HarnessJob) -> list[Shape]:
    """One shape per class: the declared test shapes, and the smallest bench shape above them all."""
    size = lambda s: plan.elements(job.spec, s.dims)  # noqa: E731
    largest = max((size(s) for s in job.shapes), default=0)
    bench = job.spec.shapes[job.target].bench if job.target in job.spec.shapes else []
    above = sorted((s for s in bench if largest < size(s) <= SANITIZE_MAX_ELEMENTS), key=size)
    return [*job.shapes, *above[:1]]


def sanitizer_job(job: HarnessJob, tool: str = "memcheck") -> HarnessJob:
    """The sanitizer's job: one shape per class (with variants), one trial, no baseline, no seccomp
    inside (the tool forks and execs; the jail and its tool profile hold it: containment/jail.py).
    racecheck tracks every shared-memory access (minutes on a serving-size shape) and shared-memory
    races do not depend on the size class: it gets the declared test shapes only. Neither runs the update
    and burst sequences (a hundred calls of one shape, minutes under the tool, nothing new to see)."""
    shapes = class_shapes(job) if tool == "memcheck" else list(job.shapes)
    fuzz = SANITIZE_FUZZ_BUDGET if tool == "memcheck" else 0
    return job.model_copy(update={
        "shapes": shapes, "trials": 1, "edge_shapes": True, "baseline_library": None, "sandbox": False, "resume": [],
        "fuzz_budget": fuzz, "sequences": False, "large_shapes": False,
    })  # fmt: skip


def findings(log: str) -> tuple[int | None, list[str]]:
    """(error count from the summary line or None where there is none, first error lines). memcheck
    ends with "ERROR SUMMARY: N errors"; racecheck with "RACECHECK SUMMARY: H hazards displayed (E
    errors, W warnings)", whose errors count (its warnings are hazards it cannot confirm)."""
    m = re.search(r"ERROR SUMMARY:\s*(\d+) error", log) or \
        re.search(r"RACECHECK SUMMARY:\s*\d+ hazards? displayed \((\d+) errors?", log)
    count = int(m.group(1)) if m else None
    # Findings only: racecheck's "Error: Race reported ..." is one, the tool's own "Error: ..." lines
    # (a target that failed, say) are not.
    lines = [ln.strip("= ").strip() for ln in log.splitlines()
             if re.match(r"=+\s+(Invalid|Race|Uninitialized|Out-of-range|Misaligned|(Warning|Error): Race)", ln)]
    return count, lines[:3]  # fmt: skip


def outcome(name: str, log: str, timed_out: bool, shape_classes: int) -> tuple[bool | None, str]:
    """One tool's verdict from its log alone (the tool wraps the kernel host, whose exit status the
    judge does not report): (False, why) on any finding, an error count above 0 or, where the log has
    no summary, a finding line; (True, "NAME: clean ...") on a summary of 0 errors; (None, "NAME: did
    not complete ...") otherwise."""
    count, lines = findings(log)
    if count or (count is None and lines):
        # A finding of a kind findings() does not list (a hardware exception, say): the tool's own lines.
        tool_lines = [ln.strip("= ").strip() for ln in log.splitlines() if ln.startswith("=")]
        other = [ln for ln in tool_lines if ln and "COMPUTE-SANITIZER" not in ln and "SUMMARY" not in ln]
        what = "; ".join(lines or other[:3])
        return False, f"compute-sanitizer {name}: {count if count is not None else 'some'} error(s): {what}"
    if timed_out or count is None:
        last = next((ln.strip("= ").strip() for ln in reversed(log.splitlines()) if ln.strip("= ").strip()), "")
        why = "timed out" if timed_out else f"no summary; its log ends: {last[:160]!r}"
        return None, f"{name}: did not complete ({why})"
    return True, f"{name}: clean ({shape_classes} shape classes)"


async def run(job: HarnessJob, req: ExecRequest, heartbeat) -> tuple[bool | None, str]:
    """(False: findings; True: clean; None: could not run) and a one-line summary."""
    tool = find_sanitizer()
    if tool is None:
        return None, "compute-sanitizer not found: memory safety not checked"
    tools = ["memcheck"]
    if req.source is not None and "__shared__" in req.source:
        tools.append("racecheck")
    verdicts: list[bool | None] = []
    summaries: list[str] = []
    for name in tools:
        checked = sanitizer_job(job, name)

        def tool_job(log_file: Path, name: str = name, checked: HarnessJob = checked) -> HarnessJob:
            # API errors are not counted: torch's own feature probes return some on purpose.
            prefix = [tool, "--tool", name, "--report-api-errors", "no", "--error-exitcode", str(ERROR_EXIT),
                      "--print-limit", str(PRINT_LIMIT), "--log-file", str(log_file)]  # fmt: skip
            return checked.model_copy(update={"host_prefix": prefix})

        out, log = await spawn.spawn_under_tool(tool_job, new_key(), req.timeout_s, heartbeat)
        ok, summary = outcome(name, log, out.timed_out, len(checked.shapes))
        if ok is False:
            return False, summary
        verdicts.append(ok)
        summaries.append(summary)
    return True if all(verdicts) else None, "compute-sanitizer " + ", ".join(summaries)
