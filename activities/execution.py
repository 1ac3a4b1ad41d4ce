"""Test and profile activities on kopt-exec-cpu / kopt-gpu-<class>: one slot per device.

The kernel runs in an isolated child process (gpu_worker.runner); a crash, hang or wrong result
comes back as data, and the worker keeps serving. Results are cached by content (library, request,
device, harness version), so a retried activity or a replayed workflow never pays twice for
device time (within the run: a new run measures afresh). While a job runs, each finished piece (a check group, a timed shape) is heartbeated,
so a retry after a lost worker resumes after it instead of running it again.

Within one run (one workflow id), library bytes that were already judged under the same conditions
(shapes, dtypes, baseline, settings) are not run again: the earlier passing verdict comes back with
`reused_from` naming the candidate it was measured for (docs/decisions/0026-same-bytes-verdicts.md).
The candidate's own source is still checked first.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import structlog
from pydantic import BaseModel, ValidationError
from temporalio import activity

from gpu_worker import runner, static_checks
from gpu_worker.protocol import HARNESS_VERSION
from gpu_worker.spawn import VISIBLE_GPU
from kopt.activity_table import PROFILE, TEST
from kopt.artifacts import ArtifactStore
from kopt.models import ExecProgress, ExecRequest, Partial, ProfileResult, TestResult

log = structlog.get_logger(__name__)

# What a verdict on library bytes does not depend on: which candidate they were built for, that
# candidate's source text (checked on its own before a reuse), and the seed of the inputs drawn.
SAME_BYTES_IGNORES = frozenset({"candidate_id", "source", "seed"})


class _Progress:
    """The activity's heartbeat details (ExecProgress): the harness's current step and every piece
    (check group, timed shape) finished so far, including those resumed from an earlier attempt, so
    the next attempt after a lost worker resumes after them."""

    def __init__(self, resumed: list[Partial]) -> None:
        self.state = ExecProgress(partials=list(resumed))

    def step(self, detail: str) -> None:
        self.state.step = detail
        activity.heartbeat(self.state.model_dump(mode="json"))

    def partial(self, piece: Partial) -> None:
        self.state.partials.append(piece)
        activity.heartbeat(self.state.model_dump(mode="json"))


def resumed_partials() -> list[Partial]:
    """Pieces an earlier attempt of this activity finished, from its last heartbeat details."""
    for detail in reversed(activity.info().heartbeat_details):
        try:
            return ExecProgress.model_validate(detail).partials
        except ValidationError:
            continue  # an older worker's plain-text heartbeat
    return []


class ExecActivities:
    """`gpus`: the GPUs (nvidia-smi indices) this worker judges on, one activity on each at a time (the
    worker has as many slots): an activity takes a free one for its harness children and its result says
    which (gpu_index). Empty: the process's CUDA_VISIBLE_DEVICES, one slot."""

    def __init__(self, store: ArtifactStore, work_dir: Path, device_class: str, gpus: tuple[int, ...] = ()):
        self.store = store
        self.work_dir = work_dir
        self.device_class = device_class
        self.gpus = gpus
        self._free = list(gpus)  # taken and given back within one event loop: no lock needed
        self.cache_dir = work_dir / "eval-cache"

    def _library(self, ref) -> Path:
        return self.store.materialize(ref, self.work_dir / "libs" / f"{ref.sha256}.so")

    def _cache_key(self, mode: str, req: ExecRequest, exclude: frozenset[str] = frozenset(), **scope: str) -> str:
        blob = json.dumps({"mode": mode, "request": req.model_dump(mode="json", exclude={"package", *exclude}),
                           "package": req.package.files.sha256, "device": self.device_class,
                           "harness": HARNESS_VERSION, **scope}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _same_bytes_path(self, mode: str, req: ExecRequest) -> Path:
        """Where a passing verdict on these library bytes in this run is kept, whichever candidate
        they were built for: keyed by the request without the candidate's id, source and input seed."""
        key = self._cache_key(mode, req, SAME_BYTES_IGNORES, run=activity.info().workflow_id)
        return self.cache_dir / "same-bytes" / f"{key}.json"

    def _reused(self, mode: str, req: ExecRequest, result_type: type[BaseModel], path: Path) -> BaseModel | None:
        """The passing verdict these library bytes got earlier in this run (kept at `path`), as this
        candidate's (no device time); None when there is none or the candidate's source fails its checks."""
        if not path.is_file():
            return None
        if mode == "test" and req.source is not None and static_checks.check_source(req.source, req.target):
            return None  # run it: the harness path reports the source's violations
        earlier = result_type.model_validate_json(path.read_text())
        note = (f"verdict reused: these library bytes passed earlier in this run as {earlier.candidate_id} "
                "(same shapes, dtypes, baseline and settings); not run again")
        return earlier.model_copy(update={"candidate_id": req.candidate_id, "reused_from": earlier.candidate_id,
                                          "seconds": 0.0, "notes": [*earlier.notes, note]})

    def _store(self, path: Path, result: BaseModel) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(result.model_dump_json())
        tmp.replace(path)

    async def _run(self, mode: str, req: ExecRequest, result_type: type[BaseModel], run) -> BaseModel:
        # Keyed by the run too: a retry or a replay within the run never pays twice, and a new run (a
        # --rerun, a nightly re-verification) measures afresh instead of repeating old figures in silence.
        cached = self.cache_dir / f"{self._cache_key(mode, req, run=activity.info().workflow_id)}.json"
        if cached.is_file():
            log.info("exec_cache_hit", mode=mode, candidate=req.candidate_id)
            return result_type.model_validate_json(cached.read_text())
        same_bytes = self._same_bytes_path(mode, req)
        reused = self._reused(mode, req, result_type, same_bytes)
        if reused is not None:
            log.info("exec_verdict_reused", mode=mode, candidate=req.candidate_id, reused_from=reused.reused_from)
            self._store(cached, reused)
            return reused
        lib = self._library(req.library)
        baseline = self._library(req.baseline_library) if req.baseline_library else None
        package_dir = self.store.unpack_tree(req.package.files, self.work_dir / "packages")
        # An audit line per real execution: how often a candidate actually ran on this device.
        resumed = resumed_partials()
        if self.gpus and not self._free:  # more activities than GPUs: the worker's slots forbid it
            raise RuntimeError(f"no free GPU of {self.gpus} for {mode} {req.candidate_id}")
        gpu = self._free.pop(0) if self.gpus else None
        with (self.work_dir / "executions.log").open("a") as fh:
            fh.write(f"{time.time():.3f} {mode} {req.candidate_id} attempt={activity.info().attempt} "
                     f"resumed={len(resumed)}{'' if gpu is None else f' gpu={gpu}'}\n")  # fmt: skip
        if resumed:
            log.info("exec_resume", mode=mode, candidate=req.candidate_id, pieces=len(resumed))
        progress = _Progress(resumed)
        token = VISIBLE_GPU.set(gpu)
        try:
            result = await run(req, lib, package_dir, req.package.spec, heartbeat=progress.step, baseline=baseline,
                               resume=resumed, on_partial=progress.partial)  # fmt: skip
        finally:
            VISIBLE_GPU.reset(token)
            if gpu is not None:
                self._free.append(gpu)
        result.gpu_index = gpu
        self._store(cached, result)
        if result.correct if mode == "test" else result.ok:  # a failure is never reused: it may be the device's
            self._store(same_bytes, result)
        return result

    @activity.defn(name=TEST.name)
    async def test(self, req: ExecRequest) -> TestResult:
        result = await self._run(TEST.name, req, TestResult, runner.run_test)
        log.info("tested", candidate=req.candidate_id, correct=result.correct, reason=result.reason)
        return result

    @activity.defn(name=PROFILE.name)
    async def profile(self, req: ExecRequest) -> ProfileResult:
        result = await self._run(PROFILE.name, req, ProfileResult, runner.run_profile)
        log.info("profiled", candidate=req.candidate_id, ok=result.ok, reason=result.reason)
        return result
