"""The compile activity on kopt-build-<toolchain>: source in, shared library (by reference) out."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import structlog
from temporalio import activity

from activities.errors import invalid_request
from activities.heartbeat import heartbeating
from containment import build
from kopt.activity_table import COMPILE
from kopt.artifacts import ArtifactStore
from kopt.models import CompileRequest, CompileResult

log = structlog.get_logger(__name__)
LOG_TAIL = 4000


class BuildActivities:
    def __init__(self, store: ArtifactStore, toolchain: build.Toolchain, work_dir: Path):
        self.store = store
        self.toolchain = toolchain
        self.work_dir = work_dir
        self.cache_dir = work_dir / "compile-cache"

    @activity.defn(name=COMPILE.name)
    async def compile(self, req: CompileRequest) -> CompileResult:
        if req.toolchain != self.toolchain.name or req.target != self.toolchain.target:
            raise invalid_request(f"toolchain {req.toolchain!r} ({req.target}) sent to a {self.toolchain.name} worker")
        # Content-addressed cache: a retried or repeated compile of the same candidate is free.
        cached = self.cache_dir / f"{req.candidate.id}.json"
        if cached.is_file():
            result = CompileResult.model_validate_json(cached.read_text())
            if result.library is None or (self.store.root / result.library.sha256[:2] / result.library.sha256).is_file():
                return self._described(req, result)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"build-{req.candidate.id}-", dir=self.work_dir))
        try:
            async with heartbeating(f"compiling {req.candidate.id}"):
                out = await build.build(self.toolchain, req.candidate.source, workdir, req.candidate.flags)
            library = self.store.put_file(workdir / "kernel.so") if out.ok else None
            full_log = self.store.put_bytes(out.log.encode()) if out.log else None
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        result = CompileResult(
            candidate_id=req.candidate.id, ok=out.ok, library=library, seconds=round(out.seconds, 3),
            log_tail=out.log[-LOG_TAIL:], log=full_log, resource_usage=out.resource_usage,
            command=[Path(c).name if i == 0 else c for i, c in enumerate(out.command)],
        )
        log.info("compiled", candidate=req.candidate.id, ok=out.ok, seconds=result.seconds)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cached.write_text(result.model_dump_json())
        return self._described(req, result)

    def _described(self, req: CompileRequest, result: CompileResult) -> CompileResult:
        """The result with this worker's toolchain facts where the request asks for them."""
        if not req.describe_toolchain:
            return result
        return result.model_copy(update={"toolchain_facts": build.toolchain_facts(self.toolchain)})
