"""Library bytes are judged once per run (docs/decisions/0026-same-bytes-verdicts.md).

Two candidates of one run whose sources differ but compile to the same library get one harness
run: the second gets the first's passing verdict, marked `reused_from`, with no device time. What
must still happen, each with the candidate that would slip through without it: the second
candidate's own source is checked (a forbidden call in code the compiler drops), a failed verdict is
run again (it may be the device's fault), and nothing crosses runs or judging conditions. These run
the real exec activity and harness on the CPU target in temporalio's activity environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.execution import ExecActivities
from frontend.history import RoundView, RunView
from frontend.inspect import history_text
from kopt.artifacts import ArtifactStore
from kopt.models import ExecRequest, PackageRef, ProfileResult, TestResult
from kopt.package import load_spec
from tests.conftest import compile_all

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCALE2 = FIXTURES / "scale2"
SOURCE = (SCALE2 / "kernel.cpp").read_text()
# The same library bytes from another text: a comment, and a process start in code the
# preprocessor drops. The source check sees it; the library cannot show it.
COMMENTED = SOURCE + "\n// another round's candidate: same code, other words\n"
FORKS_IN_DEAD_CODE = SOURCE + "\n#if 0\nstatic int spawn() { return fork(); }\n#endif\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    libs = compile_all("cpu", {"scale2": SCALE2 / "kernel.cpp", "off_by_one": FIXTURES / "wrong" / "off_by_one.cpp"},
                       tmp_path_factory.mktemp("reuse-libs"))  # fmt: skip
    store = ArtifactStore(tmp_path_factory.mktemp("reuse-store"))
    return store, {name: store.put_file(path) for name, path in libs.items()}, store.put_tree(SCALE2)


def _request(setup, candidate: str, seed: int, library: str = "scale2", source: str = SOURCE, **extra) -> ExecRequest:
    store, libs, files = setup
    spec = load_spec(SCALE2)
    fields = dict(package=PackageRef(spec=spec, files=files, baseline_sources={}), target="cpu",
                  candidate_id=candidate, library=libs[library], shapes=spec.shapes["cpu"].test, dtypes=["float32"],
                  seed=seed, timeout_s=120, time_cap_s=0.1, source=source, baseline_library=libs["scale2"],
                  baseline_id="baseline")  # fmt: skip
    return ExecRequest(**{**fields, **extra})


def _judge(setup, work: Path, mode: str, req: ExecRequest, run: str = "run-a") -> TestResult | ProfileResult:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=run)
    activities = ExecActivities(setup[0], work, "cpu")
    return asyncio.run(env.run(getattr(activities, mode), req))


def _executions(work: Path) -> list[tuple[str, str]]:
    log = work / "executions.log"
    return [tuple(line.split()[1:3]) for line in log.read_text().splitlines()] if log.is_file() else []


def test_the_same_bytes_are_run_once_per_run_and_the_reuse_is_marked(setup, tmp_path):
    first = _judge(setup, tmp_path, "test", _request(setup, "round-1", seed=11))
    assert first.correct and first.reused_from is None and first.seconds > 0, first.reason
    again = _judge(setup, tmp_path, "test", _request(setup, "round-2", seed=12, source=COMMENTED))
    assert again.correct and again.candidate_id == "round-2" and again.reused_from == "round-1"
    assert again.seconds == 0.0 and again.checks == first.checks
    assert any("verdict reused" in n and "round-1" in n for n in again.notes), again.notes

    timed = _judge(setup, tmp_path, "profile", _request(setup, "round-1", seed=11))
    assert timed.ok and timed.ab is not None, timed.reason
    retimed = _judge(setup, tmp_path, "profile", _request(setup, "round-2", seed=12, source=COMMENTED))
    assert retimed.reused_from == "round-1" and retimed.ab == timed.ab and retimed.timings == timed.timings
    # Two harness runs in all: round 2's test and profile never reached the harness.
    assert _executions(tmp_path) == [("test", "round-1"), ("profile", "round-1")]
    # `kopt history` says so.
    view = RunView(workflow_id="run-a", run_ids=["r"], rounds=[RoundView(round=2, segment=1, candidate_id="round-2",
                                                                         test=again, profile=retimed)])
    text = history_text(view)
    assert text.count("(same library bytes as round-1: its verdict, not run again)") == 2, text


def test_a_source_that_fails_its_checks_gets_no_verdict_from_its_bytes(setup, tmp_path):
    assert _judge(setup, tmp_path, "test", _request(setup, "clean", seed=1)).correct
    sneaky = _judge(setup, tmp_path, "test", _request(setup, "sneaky", seed=2, source=FORKS_IN_DEAD_CODE))
    assert not sneaky.correct and sneaky.reused_from is None
    assert "starts a process" in sneaky.reason, sneaky.reason


def test_a_failed_verdict_is_judged_again(setup, tmp_path):
    for n, candidate in enumerate(["wrong-1", "wrong-2"]):
        result = _judge(setup, tmp_path, "test", _request(setup, candidate, seed=n, library="off_by_one"))
        assert not result.correct and result.reused_from is None and "mismatch" in result.reason
    assert _executions(tmp_path) == [("test", "wrong-1"), ("test", "wrong-2")]


def test_nothing_is_reused_across_runs_or_judging_conditions(setup, tmp_path):
    assert _judge(setup, tmp_path, "test", _request(setup, "a", seed=1)).correct
    other_run = _judge(setup, tmp_path, "test", _request(setup, "b", seed=2), run="run-b")
    other_dtypes = _judge(setup, tmp_path, "test", _request(setup, "c", seed=3, dtypes=["float16"]))
    no_baseline = _judge(setup, tmp_path, "test", _request(setup, "d", seed=4, baseline_library=None, baseline_id=None))
    assert [r.reused_from for r in (other_run, other_dtypes, no_baseline)] == [None, None, None]
    assert [c for _, c in _executions(tmp_path)] == ["a", "b", "c", "d"]


def test_a_new_run_measures_afresh_and_a_retry_in_the_run_does_not(setup, tmp_path):
    """#29 item 5 / #28 item 6: a fresh run in the same home (a --rerun, a nightly re-verification) with the
    same request repeated the earlier run's figures exactly, from the content cache, and said nothing; the
    same activity again in the same run (a retry, a replay) still costs no device time."""
    # Timed at the bench shape (N=65536): at N=4096 the kernel's microsecond, less a loaded host's round-trip
    # jitter, once read as "measurement fault" (faster than 20x the copy bandwidth) in CI's parallel phase.
    req = _request(setup, "same", seed=5, shapes=load_spec(SCALE2).shapes["cpu"].bench)
    first = _judge(setup, tmp_path, "profile", req)
    again_in_run = _judge(setup, tmp_path, "profile", req)
    other_run = _judge(setup, tmp_path, "profile", req, run="run-b")
    assert first.ok and other_run.ok and again_in_run == first
    assert _executions(tmp_path) == [("profile", "same"), ("profile", "same")]  # run-a once, run-b once
    assert other_run.timings != first.timings  # measured again: other samples
