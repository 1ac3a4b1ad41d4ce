"""The Nsight Compute summary (#27 item 3) without a GPU: ncu's CSV report read into kernels, the lines
the analyst's prompt and the report show, and the rule of which profiles get one. The real tool runs in
tests/test_gpu.py (marker gpu)."""

from __future__ import annotations

import asyncio

from agents import roles
from frontend.report import nsight_lines
from gpu_worker import nsight, plan, runner
from kopt.models import ArtifactRef, ExecRequest, NsightSummary, PackageRef, ProfileResult, Shape
from kopt.package import load_spec
from kopt.report_models import ReportBaseline, RunReport
from kopt.run_models import Usage
from tests.conftest import REPO

SILU = REPO / "kernels" / "silu_and_mul"
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")

ROW = '"{id}","578","python3.12","127.0.0.1","{name}","1","7","(256, 1, 1)","(1056, 1, 1)","0","9.0",' \
      '"Command line profiler metrics","{metric}","{unit}","{value}"'
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _report(header: bool = True) -> str:
    k1, k2 = "void silu_kernel<__half, 8>(const __half *, __half *, int)", "void other(float *)"
    rows = [("0", k1, "gpu__time_duration.sum", "ns", "5,088"),
            ("0", k1, "sm__warps_active.avg.pct_of_peak_sustained_active", "%", "32.93"),
            ("0", k1, "sm__maximum_warps_per_active_cycle_pct", "%", "100"),
            ("0", k1, "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "74.72"),
            ("0", k1, "lts__throughput.avg.pct_of_peak_sustained_elapsed", "%", "48.86"),
            ("0", k1, "launch__registers_per_thread", "register/thread", "32"),
            ("0", k1, nsight.STALL_METRIC.format("long_scoreboard"), "inst", "66.96"),
            ("0", k1, nsight.STALL_METRIC.format("barrier"), "inst", "1.5"),
            ("0", k1, nsight.STALL_METRIC.format("wait"), "inst", "0.00"),
            ("0", k1, "some__metric_we_did_not_ask_for", "%", "12"),
            ("1", k1, "gpu__time_duration.sum", "ns", "9,999"),  # the same kernel again: its first launch counts
            ("2", k2, "gpu__time_duration.sum", "ns", "1,000"),
            ("2", k2, "sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", "n/a")]  # fmt: skip
    lines = ["==PROF== Connected to process 578", *([HEADER] if header else [])]
    lines += [ROW.format(id=i, name=n, metric=m, unit=u, value=v) for i, n, m, u, v in rows]
    return "\n".join([*lines, "==PROF== Disconnected from process 578"])


def test_the_ncu_report_becomes_one_entry_per_kernel_with_its_costliest_stalls():
    for header in (True, False):
        first, second = nsight.parse(_report(header))
        assert first.name.startswith("void silu_kernel<__half, 8>") and first.time_us == 5.088
        assert (first.grid, first.block, first.registers) == ("(1056, 1, 1)", "(256, 1, 1)", 32)
        assert (first.occupancy_pct, first.theoretical_occupancy_pct, first.dram_pct) == (32.93, 100, 74.72)
        assert first.stalls == {"long_scoreboard": 66.96, "barrier": 1.5}  # costliest first, zeros left out
        assert second.name == "void other(float *)" and second.time_us == 1.0 and second.sm_pct is None
    assert nsight.parse("==ERROR== ERR_NVGPUCTRPERM - no permission to access NVIDIA GPU performance counters") == []
    line = first.line()
    assert "5.09 us, grid (1056, 1, 1) x block (256, 1, 1), 32 registers/thread" in line
    assert "occupancy 33% achieved of 100%, DRAM 75%, L2 49%, SM ? of peak" in line
    assert line.endswith("top stalls (cycles per instruction): long_scoreboard 67.0, barrier 1.5")


def test_the_profiled_shape_is_the_heaviest_workload_shape_else_the_largest():
    small, large = Shape(dims={"N": 10}), Shape(dims={"N": 1000})
    assert nsight.chosen_shape([large, small], lambda s: s.dims["N"]) == large
    decode, prefill = Shape(dims={"N": 10}, weight=0.9), Shape(dims={"N": 1000}, weight=0.1)
    assert nsight.chosen_shape([prefill, decode], lambda s: s.dims["N"]) == decode


def test_the_analyst_and_the_report_show_the_summaries():
    base = NsightSummary(shape="T=64,D=4096", dtype="float16", kernels=nsight.parse(_report()), seconds=8.4)
    none = NsightSummary(shape="T=64,D=4096", dtype="float16", note="no profile: ==ERROR== ERR_NVGPUCTRPERM")
    profile = ProfileResult(candidate_id="b", ok=True, device="NVIDIA H100", nsight=base)
    assert roles._profiler(profile, profile).splitlines()[:2] == [
        "this candidate: Nsight Compute at T=64,D=4096 float16 (8.4 s):",
        f"- {base.kernels[0].line()}"]  # fmt: skip
    other = ProfileResult(candidate_id="c", ok=True, nsight=none)
    shown = roles._profiler(other, profile)
    assert shown.startswith("this candidate: Nsight Compute at T=64,D=4096 float16 (0.0 s): no profile: ==ERROR==")
    assert "\nthe baseline: Nsight Compute at" in shown
    assert roles._profiler(ProfileResult(candidate_id="x", ok=True), None) == "(none)"

    report = RunReport(run_id="r", temporal_run_id="t", kernel="k", target="cuda", toolchain="cuda13",
                       provider="offline", rounds_requested=1, status="completed",
                       baseline=ReportBaseline(candidate_id="b", nsight=base),
                       usage=Usage(device_seconds=40.0, nsight_seconds=8.4))  # fmt: skip
    lines = nsight_lines(report)
    assert lines[0] == "## Profiler (Nsight Compute)" and "cost 8.4 s of the run's 40.0 device seconds" in lines[2]
    assert "Baseline: Nsight Compute at T=64,D=4096 float16 (8.4 s):" in lines
    assert nsight_lines(RunReport(**{**report.model_dump(), "baseline": ReportBaseline(candidate_id="b")})) == []


def test_the_profilers_job_is_one_shape_one_dtype_under_the_tool_without_the_baseline(monkeypatch):
    spec = load_spec(SILU)
    req = ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target="cuda",
                      candidate_id="c", library=NO_ARTIFACT, shapes=spec.shapes["cuda"].bench,
                      dtypes=["bfloat16", "float16"], nsight=True)  # fmt: skip
    job = runner._job("profile", req, SILU / "kernel.cu", SILU, spec, SILU / "kernel.cu")
    largest = nsight.chosen_shape(req.shapes, lambda s: plan.elements(spec, s.dims))
    assert largest.label == "T=16384,D=14336"
    nj = nsight.nsight_job(job, largest, "bfloat16", ["ncu", "--csv"])
    assert (nj.mode, [s.label for s in nj.shapes], nj.dtypes, nj.trials) == ("test", [largest.label], ["bfloat16"], 1)
    assert (nj.baseline_library, nj.sandbox, nj.fuzz_budget, nj.sequences, nj.host_prefix) == \
        (None, False, 0, False, ["ncu", "--csv"])
    # Without the tool the summary is a note (and costs nothing); never an error.
    monkeypatch.setattr(nsight, "find_ncu", lambda: None)
    summary = asyncio.run(nsight.run(job, req.shapes, None))
    assert summary.kernels == [] and summary.note == "Nsight Compute (ncu) not found on the worker"
    assert summary.lines() == ["Nsight Compute at T=16384,D=14336 bfloat16 (0.0 s): "
                               "Nsight Compute (ncu) not found on the worker"]  # fmt: skip
