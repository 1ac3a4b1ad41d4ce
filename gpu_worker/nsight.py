"""A short Nsight Compute summary of a CUDA library at one timed shape, for the profile analyst.

Runs the harness test mode once more, at one shape and dtype, with the candidate's kernel host under
`ncu` (as compute-sanitizer runs: the same jail, the tool writing its CSV into the jail's scratch),
and reads back per kernel: duration, launch configuration, registers, achieved and theoretical
occupancy, DRAM, L2 and SM throughput, and the warp-stall reasons that cost most. Advisory only:
it never decides a verdict (the candidate runs in the same jail and could write into the scratch
where the tool's report lands), and a missing tool, a refused counter or a timeout is a note.
Bounded: the first NSIGHT_LAUNCHES kernel launches of the host are profiled, within NSIGHT_TIMEOUT_S.
"""

from __future__ import annotations

import csv
import io
import re
import time
from pathlib import Path

from containment.build import find_cuda_tool
from gpu_worker import plan, spawn
from gpu_worker.protocol import HarnessJob, new_key
from kopt.models import NsightKernel, NsightSummary, Shape

NSIGHT_LAUNCHES = 4
NSIGHT_TIMEOUT_S = 90.0
MAX_KERNELS = 3
# Warp-stall reasons, by the name Nsight Compute's WarpStateStats section gives them.
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle", "lg_throttle",
          "math_pipe_throttle", "wait", "not_selected", "dispatch_stall", "no_instruction", "drain",
          "branch_resolving", "imc_miss", "tex_throttle", "sleeping")  # fmt: skip
COLUMNS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
           "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value")  # fmt: skip
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
METRICS = {
    "gpu__time_duration.sum": "time_ns",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "launch__registers_per_thread": "registers",
    **{STALL_METRIC.format(s): f"stall:{s}" for s in STALLS},
}


def find_ncu() -> str | None:
    return find_cuda_tool("ncu")


def install_dirs(ncu: str) -> list[str]:
    """Where Nsight Compute really lives: `ncu` in the toolkit is a script that looks for an
    nsight-compute* folder beside the toolkit or under /opt/nvidia (often a link out of /usr, which
    the jail shows; the link's target it does not, unless named)."""
    roots = [Path(ncu).resolve().parent.parent, Path("/opt/nvidia")]
    found = {str(d.resolve()) for root in roots if root.is_dir() for d in root.glob("nsight-compute*")}
    return sorted(found)


def chosen_shape(shapes: list[Shape], elements) -> Shape:
    """The timed shape that counts most: the heaviest workload shape, else the largest bench shape."""
    return max(shapes, key=lambda s: (s.weight or 0.0, elements(s)))


def nsight_job(job: HarnessJob, shape: Shape, dtype: str, prefix: list[str],
               tool_paths: list[str] = ()) -> HarnessJob:  # fmt: skip
    """The profiler's job: one shape and dtype, one trial, no fuzzing, sequences or baseline; no
    seccomp inside (the tool forks and execs; the jail and its tool profile hold it, as for the
    sanitizer)."""
    return job.model_copy(update={
        "mode": "test", "shapes": [shape], "dtypes": [dtype], "trials": 1, "edge_shapes": False,
        "baseline_library": None, "baseline_id": None, "sandbox": False, "resume": [], "fuzz_budget": 0,
        "sequences": False, "large_shapes": False, "host_prefix": prefix, "tool_paths": list(tool_paths),
    })  # fmt: skip


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse(report: str) -> list[NsightKernel]:
    """Kernels from ncu's --csv report (one row per kernel launch and metric), first launch of each
    name, in launch order, at most MAX_KERNELS."""
    rows = [ln for ln in report.splitlines() if ln.startswith('"')]
    header = None if rows and rows[0].startswith('"ID"') else COLUMNS  # ncu writes the header row itself
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows)), fieldnames=header):
        launch, name, metric = row.get("ID"), row.get("Kernel Name") or "", row.get("Metric Name")
        field = METRICS.get(metric or "")
        value = _number(row.get("Metric Value") or "")
        if launch is None or field is None or value is None:
            continue
        k = launches.setdefault(launch, {"name": _clean(name), "grid": row.get("Grid Size", ""),
                                         "block": row.get("Block Size", ""), "stalls": {}})  # fmt: skip
        if field.startswith("stall:"):
            k["stalls"][field[6:]] = value
        else:
            k[field] = value
    kernels: list[NsightKernel] = []
    for k in launches.values():
        if any(seen.name == k["name"] for seen in kernels) or "time_ns" not in k:
            continue
        top = sorted(((v, s) for s, v in k.pop("stalls").items() if v > 0), reverse=True)[:3]
        kernels.append(NsightKernel(time_us=k.pop("time_ns") / 1e3, stalls={s: round(v, 2) for v, s in top}, **k))
    return kernels[:MAX_KERNELS]


def _clean(name: str) -> str:
    """A kernel name as the prompt may show it: printable, short (templates folded)."""
    name = re.sub(r"[^\x20-\x7e]", "?", name)
    return name if len(name) <= 120 else name[:117] + "..."


async def run(job: HarnessJob, shapes: list[Shape], heartbeat) -> NsightSummary:
    """Profile the job's library at its most important timed shape; a summary or a note, never raises
    for the tool's sake."""
    start = time.monotonic()
    shape = chosen_shape(shapes, lambda s: plan.elements(job.spec, s.dims))
    dtype = job.dtypes[0]
    summary = NsightSummary(shape=shape.label, dtype=dtype)
    tool = find_ncu()
    if tool is None:
        summary.note = "Nsight Compute (ncu) not found on the worker"
        return summary

    def tool_job(report: Path) -> HarnessJob:
        # --clock-control none: the tool must not lock the GPU's clocks (its default): a run killed before
        # it restores them would leave every later timing on that GPU, and other slots' timings, changed.
        prefix = [tool, "--csv", "--log-file", str(report), "--launch-count", str(NSIGHT_LAUNCHES),
                  "--clock-control", "none", "--metrics", ",".join(METRICS)]  # fmt: skip
        return nsight_job(job, shape, dtype, prefix, install_dirs(tool))

    out, text = await spawn.spawn_under_tool(tool_job, new_key(), NSIGHT_TIMEOUT_S, heartbeat)
    summary.kernels = parse(text)
    if not summary.kernels:
        said = [ln.strip() for ln in (text + "\n" + out.log).splitlines() if ln.strip().startswith("==")]
        why = "timed out" if out.timed_out else ("; ".join(said[-3:])[:400] or "no kernel launch was profiled")
        summary.note = f"no profile: {why}"
    summary.seconds = round(time.monotonic() - start, 2)
    return summary

