"""Test and profile activities on kopt-exec-cpu / kopt-gpu-<class>: one slot per device.

The kernel runs in an isolated child process (gpu_worker.runner); a crash, hang or wrong result
comes back as data, and the worker keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import structlog
from temporalio import activity

from gpu_worker import runner
from kopt.artifacts import ArtifactStore
from kopt.models import ExecRequest, ProfileResult, TestResult

log = structlog.get_logger(__name__)


def _heartbeat(detail: str) -> None:
    activity.heartbeat(detail)


class ExecActivities:
    def __init__(self, store: ArtifactStore, work_dir: Path):
        self.store = store
        self.work_dir = work_dir

    def _inputs(self, req: ExecRequest) -> tuple[Path, Path]:
        lib = self.store.materialize(req.library, self.work_dir / "libs" / f"{req.library.sha256}.so")
        package_dir = self.store.unpack_tree(req.package.files, self.work_dir / "packages")
        return lib, package_dir

    @activity.defn(name="test")
    async def test(self, req: ExecRequest) -> TestResult:
        lib, package_dir = self._inputs(req)
        result = await runner.run_test(req, lib, package_dir, req.package.spec, heartbeat=_heartbeat)
        log.info("tested", candidate=req.candidate_id, correct=result.correct, reason=result.reason)
        return result

    @activity.defn(name="profile")
    async def profile(self, req: ExecRequest) -> ProfileResult:
        lib, package_dir = self._inputs(req)
        result = await runner.run_profile(req, lib, package_dir, req.package.spec, heartbeat=_heartbeat)
        log.info("profiled", candidate=req.candidate_id, ok=result.ok)
        return result
