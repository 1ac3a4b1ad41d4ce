"""workflows/judging.py, the judging sequence OptimizeKernel, ReverifyBest and kopt evaluate/verify share,
without a server or a kernel: which steps run after which outcome, the status word and reason of each
outcome, and whose code failed."""

from __future__ import annotations

import asyncio

import pytest

from kopt.models import ArtifactRef, CompileResult, ProfileResult, TestResult
from workflows import judging

LIB = ArtifactRef(sha256="1" * 64, size=1, uri="file:///lib.so")


def compiled(ok: bool = True, log: str = "") -> CompileResult:
    return CompileResult(candidate_id="c", ok=ok, library=LIB if ok else None, seconds=1.0, log_tail=log)


def run(comp: CompileResult, tested: TestResult, profiled: ProfileResult) -> tuple[judging.Judged, list[str]]:
    calls: list[str] = []

    async def test() -> TestResult:
        calls.append("test")
        return tested

    async def profile() -> ProfileResult:
        calls.append("profile")
        return profiled

    return asyncio.run(judging.judge(comp, test, profile)), calls


GOOD_TEST = TestResult(candidate_id="c", correct=True)
GOOD_PROFILE = ProfileResult(candidate_id="c", ok=True)


@pytest.mark.parametrize("log, line", [
    ("In file included from x.h\nk.cpp:3:1: error: expected ';'\nk.cpp:9:1: error: again\n",
     "k.cpp:3:1: error: expected ';'"),
    ("ld: something odd\nmore\n", "ld: something odd"),
    ("   \n", "no compiler output"),
])  # fmt: skip
def test_the_compile_error_line_is_the_first_that_mentions_an_error(log, line):
    assert judging.compile_error(log) == line


def test_a_library_that_did_not_compile_is_neither_tested_nor_profiled():
    judged, calls = run(compiled(False, "k.cpp:1: error: nope"), GOOD_TEST, GOOD_PROFILE)
    assert calls == []
    assert (judged.status(), judged.failure(), judged.failed_party) == (
        "compile error", "compile error: k.cpp:1: error: nope", "candidate")


def test_a_wrong_library_is_not_profiled_and_its_failure_names_whose_code_failed():
    wrong = TestResult(candidate_id="c", correct=False, reason="baseline: crashed: SIGSEGV", failed_party="baseline")
    judged, calls = run(compiled(), wrong, GOOD_PROFILE)
    assert calls == ["test"]
    assert (judged.status(), judged.failure()) == ("wrong result", "wrong result: baseline: crashed: SIGSEGV")
    assert judged.failed_party == "baseline"


def test_a_fault_of_the_packages_reference_reads_package_error_not_wrong_result():
    """#29 item 9: make_inputs() raising read "wrong result: package error: <a worker's path>/reference.py:
    ..."; the candidate was not wrong. The reason now starts with what failed."""
    fault = TestResult(candidate_id="c", correct=False, failed_party="package",
                       reason="package error: reference.py: make_inputs() failed at N=17 float32: ValueError: x")
    judged, calls = run(compiled(), fault, GOOD_PROFILE)
    assert calls == ["test"] and judged.failed_party == "package"
    assert (judged.status(), judged.failure()) == ("wrong result", fault.reason)


def test_a_correct_library_is_profiled_and_a_failed_profile_is_its_outcome():
    failed = ProfileResult(candidate_id="c", ok=False, reason="T=1 float32: measurement fault",
                           failed_party="candidate")  # fmt: skip
    judged, calls = run(compiled(), GOOD_TEST, failed)
    assert calls == ["test", "profile"]
    assert (judged.status(), judged.failure(), judged.failed_party) == (
        "profile failed", "profile failed: T=1 float32: measurement fault", "candidate")


def test_a_measured_library_has_no_failure_unless_its_caller_lacks_the_speedup():
    judged, calls = run(compiled(), GOOD_TEST, GOOD_PROFILE)
    assert calls == ["test", "profile"]
    assert (judged.status(), judged.failure(), judged.failed_party) == ("measured", None, None)
    assert judged.status(measured=False) == "profile failed"
