"""Parent side of the isolated harness: run one test or profile job in a fresh subprocess.

Used by the Temporal test/profile activities. The candidate kernel runs only in the child
(`python -m gpu_worker.harness`), so a segfault, a hang or an exit() in it is a failed result
here, never a dead worker. This module never imports torch: the worker process must not hold a
CUDA context of its own. Candidate failures are data; only bugs in this module raise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from gpu_worker.device import cpu_name
from kopt.models import DType, ExecRequest, KernelSpec, ProfileResult, Shape, Target, TestResult, Tolerance

REPO_ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_S = 5.0
RESULT_LIMIT = 32 << 20  # bytes; a larger "result" is garbage, not a result
TAIL_BYTES = 2048
PROGRESS_PREFIX = "kopt-harness: "  # the child logs one such line per step (see harness.py)

# MEASUREMENT.md defaults when a package is silent about a dtype.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=1.3e-6, atol=1e-5),
    "float16": Tolerance(rtol=1e-3, atol=1e-3),
    "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-3),
}

Heartbeat = Callable[[str], None]


class HarnessJob(BaseModel):
    """The job file the parent writes and the harness child reads."""

    mode: Literal["test", "profile"]
    target: Target
    candidate_id: str
    library: str
    package_dir: str
    spec: KernelSpec
    shapes: list[Shape]
    dtypes: list[DType]
    seed: int = 0
    tolerances: dict[DType, Tolerance]
    trials: int = 2
    time_cap_s: float | None = None  # per shape and dtype; None: the target's default


def tolerances_for(spec: KernelSpec) -> dict[str, Tolerance]:
    """The package's per-dtype tolerances, MEASUREMENT.md defaults where it is silent."""
    return {**DEFAULT_TOLERANCES, **spec.tolerances}


async def run_test(
    req: ExecRequest, library: Path, package_dir: Path, spec: KernelSpec, heartbeat: Heartbeat | None = None
) -> TestResult:
    """Check a compiled candidate against the package reference over req.shapes x req.dtypes."""
    return await _run("test", req, library, package_dir, spec, heartbeat)  # type: ignore[return-value]


async def run_profile(
    req: ExecRequest, library: Path, package_dir: Path, spec: KernelSpec, heartbeat: Heartbeat | None = None
) -> ProfileResult:
    """Time a compiled candidate over req.shapes x req.dtypes (cold L2 on CUDA)."""
    return await _run("profile", req, library, package_dir, spec, heartbeat)  # type: ignore[return-value]


async def _run(
    mode: Literal["test", "profile"],
    req: ExecRequest,
    library: Path,
    package_dir: Path,
    spec: KernelSpec,
    heartbeat: Heartbeat | None,
) -> TestResult | ProfileResult:
    job = HarnessJob(
        mode=mode,
        target=req.target,
        candidate_id=req.candidate_id,
        library=str(Path(library).resolve()),
        package_dir=str(Path(package_dir).resolve()),
        spec=spec,
        shapes=req.shapes,
        dtypes=req.dtypes,
        seed=req.seed,
        tolerances=tolerances_for(spec),
    )
    start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"kopt-{mode}-"))
    try:
        outcome = await _spawn(job, workdir, req.timeout_s, heartbeat)
        result = _interpret(job, outcome)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result.seconds = time.monotonic() - start
    return result


@dataclass(frozen=True)
class _Outcome:
    returncode: int | None
    timed_out: bool
    timeout_s: float
    data: bytes  # what the child wrote to the result pipe
    log: str  # the end of the child's stdout + stderr


async def _spawn(job: HarnessJob, workdir: Path, timeout_s: float, heartbeat: Heartbeat | None) -> _Outcome:
    job_path = workdir / "job.json"
    job_path.write_text(job.model_dump_json())
    log_path = workdir / "child.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONFAULTHANDLER": "1",  # a Python stack in the log when the kernel segfaults
        "PYTHONUNBUFFERED": "1",  # progress lines reach the log before a crash
    }
    loop = asyncio.get_running_loop()
    r, w = os.pipe()
    reader_transport = proc = read_task = wait_task = None
    try:
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpu_worker.harness", str(job_path), str(w),
                pass_fds=(w,), start_new_session=True, cwd=REPO_ROOT, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        os.close(w)
        w = -1
        reader = asyncio.StreamReader(limit=RESULT_LIMIT)
        reader_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", buffering=0)
        )
        r = -1  # owned by the transport now
        read_task = asyncio.create_task(_read_capped(reader))
        wait_task = asyncio.create_task(proc.wait())
        timed_out = await _wait(wait_task, timeout_s, heartbeat, job)
        if timed_out:
            _kill_group(proc.pid)
            await proc.wait()
        else:
            _kill_group(proc.pid)  # leftovers the kernel may have forked
        # EOF comes once every holder of the write end is gone; bound the wait in case one escaped.
        try:
            data = await asyncio.wait_for(read_task, timeout=5.0)
        except asyncio.TimeoutError:
            data = b""
        return _Outcome(proc.returncode, timed_out, timeout_s, data, _read_end(log_path))
    finally:
        # Runs on cancellation too: never leave a candidate running behind a cancelled activity.
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
        for task in (read_task, wait_task):
            if task is not None and not task.done():
                task.cancel()
        if reader_transport is not None:
            reader_transport.close()
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


async def _wait(wait_task: asyncio.Task, timeout_s: float, heartbeat: Heartbeat | None, job: HarnessJob) -> bool:
    """Wait for the child, heartbeating every HEARTBEAT_S; True when the timeout passed first."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return True
        done, _ = await asyncio.wait({wait_task}, timeout=min(HEARTBEAT_S, remaining))
        if done:
            return False
        if heartbeat is not None:
            heartbeat(f"{job.mode} {job.candidate_id}: running for {loop.time() - start:.0f} s")


async def _read_capped(reader: asyncio.StreamReader) -> bytes:
    chunks, size = [], 0
    while chunk := await reader.read(1 << 16):
        size += len(chunk)
        if size > RESULT_LIMIT:
            return b""
        chunks.append(chunk)
    return b"".join(chunks)


def _interpret(job: HarnessJob, out: _Outcome) -> TestResult | ProfileResult:
    """Turn the child's exit status and result bytes into a result model."""
    during = _last_progress(out.log)
    where = f" (during {during})" if during else ""
    tail = _stderr_tail(out.log)
    if out.timed_out:
        return _failed(job, f"timed out after {out.timeout_s:g} s{where}")
    rc = out.returncode
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return _failed(job, f"crashed: {name}{where}\n{tail}")
    if rc:
        return _failed(job, f"exited with code {rc}{where}: {tail}")
    model = TestResult if job.mode == "test" else ProfileResult
    if not out.data.strip():
        return _failed(
            job, f"harness produced no valid result: the process exited with code 0 without writing one{where} "
            f"(does the kernel call exit()?)\n{tail}",
        )  # fmt: skip
    try:
        result = model.model_validate_json(out.data)
    except ValidationError as exc:
        return _failed(job, f"harness produced no valid result: {exc.errors()[0]['msg']}{where}\n{tail}")
    result.candidate_id = job.candidate_id
    return result


def _failed(job: HarnessJob, reason: str) -> TestResult | ProfileResult:
    device = cpu_name() if job.target == "cpu" else ""
    if job.mode == "test":
        return TestResult(candidate_id=job.candidate_id, correct=False, reason=reason.strip(), device=device)
    return ProfileResult(candidate_id=job.candidate_id, ok=False, reason=reason.strip(), device=device)


def _last_progress(log: str) -> str:
    lines = [ln[len(PROGRESS_PREFIX):] for ln in log.splitlines() if ln.startswith(PROGRESS_PREFIX)]
    return lines[-1].strip() if lines else ""


def _read_end(path: Path) -> str:
    """The last few KB of the child's output (enough for a stderr tail and the last progress line)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8 * TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _stderr_tail(log: str) -> str:
    """The last TAIL_BYTES of the child's output without the harness's own progress lines."""
    text = "\n".join(ln for ln in log.splitlines() if not ln.startswith(PROGRESS_PREFIX))
    return text[-TAIL_BYTES:]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
