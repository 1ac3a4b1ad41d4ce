"""Resuming test and profile jobs from heartbeated progress (issue: durable runs).

The harness reports each finished piece of a job (a check group that passed, a timed shape and
dtype) as an authenticated partial frame; the exec activity heartbeats them, and the next attempt
after a lost worker passes them back as `resume`, so those pieces are not paid for twice. These
tests run the real harness on the CPU target and the real activity in temporalio's activity
environment with the heartbeat details an earlier attempt would have left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.execution import ExecActivities
from containment.build import compile_command, detect_toolchain
from gpu_worker import runner
from kopt.artifacts import ArtifactStore
from kopt.models import ExecProgress, ExecRequest, PackageRef, Partial, Shape
from kopt.package import load_spec

ROOT = Path(__file__).resolve().parent.parent
SILU = ROOT / "kernels" / "silu_and_mul"
SHAPES = [Shape(label="T=8 D=256", dims={"T": 8, "D": 256}), Shape(label="T=64 D=512", dims={"T": 64, "D": 512}),
          Shape(label="T=32 D=1024", dims={"T": 32, "D": 1024})]  # fmt: skip


@pytest.fixture(scope="module")
def silu_lib(tmp_path_factory) -> Path:
    tc = detect_toolchain("cpu")
    if tc is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    out = tmp_path_factory.mktemp("resume") / "silu.so"
    proc = subprocess.run(compile_command(tc, SILU / "kernel.cpp", out, ["-O2"]), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


def _request(store: ArtifactStore | None = None, lib: Path | None = None) -> ExecRequest:
    spec = load_spec(SILU)
    if store is None:
        files = library = baseline = None
    else:
        files = store.put_tree(SILU)
        library = baseline = store.put_file(lib)
    none = {"sha256": "0" * 64, "size": 0, "uri": "file:///dev/null"}
    return ExecRequest.model_validate({
        "package": PackageRef(spec=spec, files=files or none, baseline_sources={}).model_dump(),
        "target": "cpu", "candidate_id": "silu-resume", "library": (library or none), "shapes": SHAPES,
        "dtypes": ["float32"], "seed": 7, "timeout_s": 120, "time_cap_s": 0.2, "edge_shapes": False,
        "baseline_library": baseline, "baseline_id": "baseline" if baseline else None,
    })  # fmt: skip


def test_profile_resumes_after_the_shapes_an_earlier_attempt_timed(silu_lib):
    req = _request()
    pieces: list[Partial] = []
    first = asyncio.run(runner.run_profile(req, silu_lib, SILU, req.package.spec, baseline=silu_lib,
                                           on_partial=pieces.append))  # fmt: skip
    assert first.ok, first.reason
    assert [p.key for p in pieces] == [f"profile {s.label} float32" for s in SHAPES]
    assert all(p.timing is not None and p.ab is not None for p in pieces)

    # The "earlier attempt" died after two shapes: the retry times only the third.
    steps: list[str] = []
    again: list[Partial] = []
    second = asyncio.run(runner.run_profile(req, silu_lib, SILU, req.package.spec, baseline=silu_lib,
                                            resume=pieces[:2], on_partial=again.append, heartbeat=steps.append))  # fmt: skip
    assert second.ok, second.reason
    assert [p.key for p in again] == [f"profile {SHAPES[2].label} float32"]
    # Resumed shapes are reported exactly as the earlier attempt measured them ...
    assert second.timings[:2] == [p.timing for p in pieces[:2]]
    assert second.ab.per_shape[:2] == [p.ab for p in pieces[:2]]
    # ... the third one is a new measurement, and the geomean interval covers all three shapes.
    assert second.timings[2].samples > 0 and second.timings[2] != pieces[2].timing
    assert len(second.ab.per_shape) == 3 and second.ab.ci_low <= second.ab.speedup_geomean <= second.ab.ci_high
    assert any("resumed: 2 shape(s)" in n for n in second.notes), second.notes


def test_test_mode_skips_groups_that_passed_but_never_trusts_a_failed_one(silu_lib):
    req = _request()
    pieces: list[Partial] = []
    first = asyncio.run(runner.run_test(req, silu_lib, SILU, req.package.spec, on_partial=pieces.append))
    assert first.correct, first.reason
    assert len(pieces) == len(first.checks) + len(first.variant_checks) > 3
    assert all(p.key.startswith("test ") and p.check.ok for p in pieces)

    forged = pieces[0].model_copy(update={"check": pieces[0].check.model_copy(update={"ok": False})})
    again: list[Partial] = []
    second = asyncio.run(runner.run_test(req, silu_lib, SILU, req.package.spec,
                                         resume=[forged, *pieces[1:3]], on_partial=again.append))  # fmt: skip
    assert second.correct, second.reason
    # Two groups resumed; the group whose record says it failed is run again, like every other one. (The
    # shapes drawn from the package's ranges are each attempt's own: its salt draws them anew, and with them
    # the layout each drawn shape meets.)
    declared = {s.label for s in req.shapes}

    def drawn(key: str) -> bool:
        _, label, _, *variant = key.split(" ")
        layout = bool(variant) and (variant[0] == "strided" or variant[0].startswith("layout:"))
        return key.endswith((" fuzz", " size", " residue")) or (layout and label not in declared)

    assert [p.key for p in again if not drawn(p.key)] == [pieces[0].key] + [p.key for p in pieces[3:]
                                                                            if not drawn(p.key)]  # fmt: skip
    assert any("resumed: 2 check group(s)" in n for n in second.notes), second.notes


def test_profile_job_ignores_pieces_of_the_other_mode(silu_lib):
    req = _request()
    stray = Partial(key="test T=8 D=256 float32", check=None)
    again: list[Partial] = []
    result = asyncio.run(runner.run_profile(req, silu_lib, SILU, req.package.spec, resume=[stray],
                                            on_partial=again.append))  # fmt: skip
    assert result.ok and len(again) == len(SHAPES)
    assert not any("resumed" in n for n in result.notes)


def test_the_activity_heartbeats_pieces_and_a_retry_resumes_from_its_details(silu_lib, tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    req = _request(store, silu_lib)
    work = tmp_path / "work"

    beats: list = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.append(details)
    first = asyncio.run(env.run(ExecActivities(store, work, "cpu").profile, req))
    assert first.ok, first.reason
    last = ExecProgress.model_validate(beats[-1][0])
    assert [p.key for p in last.partials] == [f"profile {s.label} float32" for s in SHAPES]

    # Attempt 2 of the same activity, on a fresh worker (no eval cache), with attempt 1's details
    # cut after the first shape: it executes, resumes one shape, and heartbeats all three again.
    cut = ExecProgress(step="profile", partials=last.partials[:1])
    env2 = ActivityEnvironment()
    env2.info = dataclasses.replace(env2.info, attempt=2, heartbeat_details=[cut.model_dump(mode="json")])
    beats2: list = []
    env2.on_heartbeat = lambda *details: beats2.append(details)
    work2 = tmp_path / "work2"
    second = asyncio.run(env2.run(ExecActivities(store, work2, "cpu").profile, req))
    assert second.ok, second.reason
    assert second.timings[0] == last.partials[0].timing
    assert (work2 / "executions.log").read_text().split()[3:] == ["attempt=2", "resumed=1"]
    assert [p.key for p in ExecProgress.model_validate(beats2[-1][0]).partials] == [p.key for p in last.partials]
