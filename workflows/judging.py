"""One candidate judged: the sequence OptimizeKernel, ReverifyBest and `kopt evaluate` / `kopt verify`
share, and the words for what became of it.

A compiled library is tested against the package's reference (test shapes, edge shapes, input
variants); only a correct one is profiled, interleaved A/B with the baseline. The outcome is one
status word (compile error, wrong result, profile failed, measured) and, where the candidate failed,
one reason that starts with that word (or with "package error" where the package's own reference.py
failed: its status word stays "wrong result", nothing was measured). Pure: no temporalio, no I/O. The
steps are given by the caller: activities on their task queues in a workflow, the local compiler and
harness in the front end. Workflow callers keep the order of their activities (compile, test, profile): golden histories
replay through this module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kopt.models import CompileResult, FailedParty, ProfileResult, RoundStatus, TestResult


def compile_error(log: str) -> str:
    """The line of a compiler's output a person reads first: the first that mentions an error, else the
    first line, else a note that there was none."""
    lines = log.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    return ((errors or lines or ["no compiler output"])[0]).strip()


@dataclass
class Judged:
    """What the sequence found: the compile result, and the test and profile results where those steps
    ran (a failed step ends it)."""

    compiled: CompileResult | None
    tested: TestResult | None = None
    profiled: ProfileResult | None = None

    def status(self, measured: bool = True) -> RoundStatus:
        """The status word; `measured`: the caller has the speedup it needs from the profile (a workflow
        that scores against an earlier baseline profile may not)."""
        return outcome(self.compiled, self.tested, self.profiled, measured)[0]

    def failure(self) -> str | None:
        """Why the candidate failed ("<status>: <detail>"), or None."""
        return outcome(self.compiled, self.tested, self.profiled)[1]

    @property
    def failed_party(self) -> FailedParty | None:
        """Whose code failed, where a step says so: a compile error is the candidate's."""
        if self.compiled is not None and not self.compiled.ok:
            return "candidate"
        step = self.profiled if self.tested is not None and self.tested.correct else self.tested
        return step.failed_party if step is not None else None


def outcome(compiled: CompileResult | None, tested: TestResult | None, profiled: ProfileResult | None,
            measured: bool = True) -> tuple[RoundStatus, str | None]:  # fmt: skip
    """The status word of a judged candidate and, where it failed, the reason (the word, a colon, the
    detail). A step that did not run says nothing."""
    if compiled is not None and not compiled.ok:
        return "compile error", f"compile error: {compile_error(compiled.log_tail)}"
    if tested is not None and not tested.correct:
        if tested.failed_party == "package":  # reference.py failed, not the candidate: say so first
            return "wrong result", tested.reason if (tested.reason or "").startswith("package error: ") \
                else f"package error: {tested.reason}"
        return "wrong result", f"wrong result: {tested.reason}"
    if profiled is not None and not profiled.ok:
        return "profile failed", f"profile failed: {profiled.reason}"
    return ("measured" if measured else "profile failed"), None


async def judge(
    compiled: CompileResult,
    test: Callable[[], Awaitable[TestResult]],
    profile: Callable[[], Awaitable[ProfileResult]],
) -> Judged:
    """Test a compiled library, then profile it if it is correct. A library that did not compile is
    neither tested nor profiled."""
    judged = Judged(compiled)
    if not compiled.ok or compiled.library is None:
        return judged
    judged.tested = await test()
    if judged.tested.correct:
        judged.profiled = await profile()
    return judged
