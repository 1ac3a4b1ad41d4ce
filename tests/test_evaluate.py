"""`kopt evaluate` (frontend/evaluate.py) on the CPU target: verdicts, JSON shape, exit codes."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from containment.build import detect_toolchain
from frontend import exits
from frontend.evaluate import evaluate

TESTS = Path(__file__).resolve().parent
SCALE2 = TESTS / "fixtures" / "scale2"

pytestmark = pytest.mark.skipif(detect_toolchain("cpu") is None, reason="no C++ compiler (g++)")


def run(candidate: Path, as_json: bool = True, kernel_dir: Path = SCALE2, target: str | None = "cpu"):
    out, err = io.StringIO(), io.StringIO()
    code = asyncio.run(evaluate(kernel_dir, candidate, target, as_json, None, time_cap_s=0.2, out=out, err=err))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.serial  # an A/A verdict: beside the parallel phase's busy workers one gave 3.17x [.., 32.7]
def test_the_baseline_as_candidate_is_correct_and_even():
    code, out, _ = run(SCALE2 / "kernel.cpp")
    assert code == exits.OK
    verdict = json.loads(out)
    assert verdict["correct"] is True and verdict["reason"] is None
    assert [(s["shape"], s["dtype"]) for s in verdict["per_shape"]] == [("N=65536", "float32"), ("N=65536", "float16")]
    for s in verdict["per_shape"]:
        assert s["candidate_us"] > 0 and s["baseline_us"] > 0 and s["pct_sol"] > 0
        lo, hi = s["speedup_ci"]
        assert lo <= s["speedup"] <= hi
    lo, hi = verdict["speedup_ci"]
    assert lo <= verdict["speedup_geomean"] <= hi and 0.5 < verdict["speedup_geomean"] < 2.0
    assert verdict["verdict"] in ("faster", "slower", "same")
    assert verdict["checks"]["total"] > 0 and verdict["checks"]["failed"] == []
    # Each check that did not apply, named with its reason: scale2 refuses the float dtype it does not declare.
    skipped = verdict["checks"]["not_applicable"]
    assert len(skipped) == verdict["checks"]["skipped"] and all(": skipped: " in k for k in skipped), skipped
    assert any(k.startswith("N=") and "dtype:bfloat16" in k and "KOPT_ERR_DTYPE" in k for k in skipped), skipped


def test_a_less_accurate_candidate_is_rejected_by_the_calibrated_bound():
    code, out, _ = run(TESTS / "cheats" / "cpu" / "scale2_low_bits.cpp")
    assert code == exits.FAILED
    verdict = json.loads(out)
    assert verdict["correct"] is False and "calibrated bound" in verdict["reason"]
    assert verdict["speedup_geomean"] is None and verdict["per_shape"] == []


def test_static_violations_and_compile_errors_are_rejections(tmp_path):
    code, out, _ = run(TESTS / "fixtures" / "wrong" / "exits.cpp")
    assert code == exits.FAILED
    verdict = json.loads(out)
    assert verdict["reason"].startswith("wrong result: static check: ") and verdict["static_violations"]
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    code, out, _ = run(broken)
    assert code == exits.FAILED and json.loads(out)["reason"].startswith("compile error")
    # The error names the user's file, not the build directory's copy (#29 item 11).
    assert json.loads(out)["reason"].startswith(f"compile error: {broken}:1:"), json.loads(out)["reason"]


def test_human_readable_verdict():
    code, out, err = run(SCALE2 / "kernel.cpp", as_json=False)
    assert code == exits.OK
    assert "correct:" in out and "geomean speedup" in out and "95% CI" in out
    assert "building baseline and candidate" in err


@pytest.mark.parametrize(
    "kernel_dir, candidate, target, message",
    [
        (TESTS / "no-such-package", SCALE2 / "kernel.cpp", "cpu", "not found"),
        (SCALE2, TESTS / "no-such-file.cpp", "cpu", "not found"),
        (SCALE2, SCALE2 / "kernel.cpp", "tpu", "unknown target"),
        (SCALE2, SCALE2 / "kernel.cpp", "cuda", "has no 'cuda' target"),
    ],
)
def test_usage_errors_exit_2(kernel_dir, candidate, target, message):
    code, out, err = run(candidate, kernel_dir=kernel_dir, target=target)
    assert code == exits.USAGE and out == "" and message in err


def test_an_entry_point_the_libraries_do_not_export_points_at_kernel_toml(tmp_path):
    """A misspelled `entry` in kernel.toml read "wrong result: candidate: entry symbol ... is not exported",
    nothing pointing at kernel.toml, while the baseline lacked it too. The reason names the setting."""
    import shutil

    pkg = shutil.copytree(SCALE2, tmp_path / "pkg")
    toml = pkg / "kernel.toml"
    toml.write_text(toml.read_text().replace('entry = "kopt_scale2"', 'entry = "kopt_scale3"'))
    code, out, _ = run(pkg / "kernel.cpp", kernel_dir=pkg)
    reason = json.loads(out)["reason"]
    assert code == exits.FAILED and "exports no 'kopt_scale3', the entry point kernel.toml's `entry` names" in reason


def test_the_verdict_names_the_facts_of_the_machine_that_timed_it():
    """The same facts the agents' prompts show (issue #27): instruction sets, cores, caches."""
    code, out, _ = run(SCALE2 / "kernel.cpp")
    facts = json.loads(out)["device_facts"]
    assert code == exits.OK and facts[0].startswith("CPU: ") and any(f.startswith("instruction sets: ") for f in facts)
