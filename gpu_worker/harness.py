"""The harness child, the judge: check or time one candidate library against the reference.

    python -m gpu_worker.harness RESULT_FD      (job and key on stdin; see protocol.py)

The child runs in its jail from its first instruction (containment/jail.py: namespaces, a read-only view
of the host, an unprivileged uid, hard limits, a minimal environment). Order:
  1. read the per-job key and the job from stdin, then close stdin; make this process
     non-dumpable (no other process of the same uid can read its memory);
  2. move the result pipe to a private, close-on-exec descriptor and close the number it came on;
  3. import torch, set up the device and its stream, load the package reference, measure the copy
     bandwidth (profile);
  4. start one kernel host per library (remote.py, kernel_host.py): a fresh interpreter without
     torch that maps the shared buffers (CPU: a memfd arena; CUDA: device-memory segments),
     seccomps itself and loads only that library. The judge never loads candidate code: the key,
     the references, the checks, the clock and the verdict stay out of the candidate's reach
     (docs/decisions/0014-..., 0015-...);
  5. apply this process's limits (a hard address-space cap, the seccomp allow-list: sandbox.py).
Everything reported goes out as HMAC-authenticated frames (progress steps, then one result), so
nothing a kernel writes to any descriptor can pass for a result. A Python error or a candidate
failure is a result too; a crash, hang or exit() of a kernel host is reported by the judge, one of
this process by the parent, naming the last authenticated step.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
import traceback
import warnings

from gpu_worker.protocol import PROGRESS_PREFIX, HarnessJob, decode_stdin, frame

STDIN_LIMIT = 16 << 20
PRIVATE_FD_RANGE = (100, 900)  # far from the 3..20 a candidate would guess; below the default 1024


class Channel:
    """The authenticated result channel: numbered, HMAC'd frames on a private descriptor."""

    def __init__(self, fd: int, key: bytearray) -> None:
        import fcntl

        lo, hi = PRIVATE_FD_RANGE
        private = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lo + secrets.randbelow(hi - lo))
        os.close(fd)
        self.fd, self.key, self.seq = private, key, 0
        self.step = ""

    def send(self, kind: str, body: str) -> None:
        data = frame(self.key, self.seq, kind, body)
        self.seq += 1
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def progress(self, step: str) -> None:
        """One frame per step; the parent names the last one when the kernel crashes or hangs."""
        self.step = step
        print(PROGRESS_PREFIX + step, file=sys.stderr, flush=True)
        self.send("progress", step)


def read_stdin() -> tuple[bytearray, HarnessJob]:
    chunks, size = [], 0
    while chunk := os.read(0, 1 << 16):
        size += len(chunk)
        if size > STDIN_LIMIT:
            raise ValueError("job larger than the stdin limit")
        chunks.append(chunk)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return decode_stdin(b"".join(chunks))


def run_job(job: HarnessJob, channel: Channel):
    _not_dumpable()
    _keep_freed_memory()
    # Some environments ship torch without numpy; the warning would fill every failure's log tail.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    from gpu_worker import sandbox, timing
    from gpu_worker.context import Context

    # One host thread: torch's intra-op pool, on a loaded machine, makes every host op (refresh,
    # perturb, re-check) wait for a descheduled worker thread; under one CPU hog on 2 cores that cut
    # the A/B samples in a 0.5 s cap from ~1500 to ~50 a side (docs/measurement.md, A/B).
    torch.set_num_threads(1)
    with torch.no_grad():
        channel.progress("setup")
        ctx = Context(job, channel.progress)
        ctx.report = lambda partial: channel.send("partial", partial.model_dump_json())
        try:
            channel.progress("load libraries")  # in kernel hosts, started before this process's seccomp
            ctx.load_kernels()
            copy_bw = job.copy_bandwidth_gbs
            if job.mode == "profile" and copy_bw is None:  # after the hosts' start-up, which would disturb it
                channel.progress("profile copy bandwidth")
                copy_bw = timing.cuda_copy_bandwidth(ctx.device) if ctx.cuda else timing.cpu_copy_bandwidth()
            if job.sandbox:
                ctx.notes += sandbox.apply(job.target, job.memory_limit_mb)
            else:
                ctx.notes.append("seccomp off for this job (compute-sanitizer run; the jail and its tool profile hold)")
            if job.mode == "test":
                from gpu_worker.correctness import run_test

                return run_test(ctx)
            from gpu_worker.profiling import run_profile

            return run_profile(ctx, copy_bw)
        finally:
            ctx.close()


def _not_dumpable() -> None:
    """Kernel hosts run as the same uid: without this they could open /proc/<judge>/mem or read its
    environment and descriptors (their seccomp kills ptrace and cross-process memory calls too)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (glibc malloc.h)


def _keep_freed_memory() -> None:
    """Large tensors from the heap, and freed heap memory kept for the next. A test job allocates and
    frees tensors of one size over and over (hundreds of MB each at the large shape); glibc maps each
    such block afresh and unmaps it when freed, so that every page faults in again, which doubles the
    time of an elementwise op there. The peak stays the same; the address-space limit still holds."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))


def failed(job: HarnessJob | None, reason: str):
    from kopt.models import ProfileResult, TestResult

    cid = job.candidate_id if job else ""
    if job is None or job.mode == "test":
        return TestResult(candidate_id=cid, correct=False, reason=reason)
    return ProfileResult(candidate_id=cid, ok=False, reason=reason)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    key, job = read_stdin()
    channel = Channel(int(args[0]), key)
    start = time.monotonic()
    try:
        result = run_job(job, channel)
    except Exception as exc:  # any Python error is a failed result, never a missing one
        from gpu_worker.abi import KernelFailure, PackageFault
        from gpu_worker.context import cuda_error

        where = f" (during {channel.step})" if channel.step else ""
        party = None  # a Python error of the harness itself: nobody's kernel
        if isinstance(exc, KernelFailure):
            reason, party = f"{exc}{where}", exc.party
        elif isinstance(exc, PackageFault):
            reason, party = f"{exc}{where}", "package"
        elif "CUDA error" in str(exc) or "CUDA" in type(exc).__name__:
            reason, party = f"candidate: {cuda_error(exc)}{where}", "candidate"
        else:
            traceback.print_exc()
            reason = f"{type(exc).__name__}: {exc}{where}"
        result = failed(job, reason)
        result.failed_party = party
        if isinstance(exc, KernelFailure) and exc.memory_fault and job.mode == "test":
            result.fault_group = exc.group
    result.seconds = time.monotonic() - start
    if not result.device:
        result.device = _device_name(job)
    if job is not None and job.mode != "test" and not result.device_facts:
        result.device_facts = _device_facts(job)
    channel.send("result", result.model_dump_json())
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: library destructors and CUDA shutdown of a broken context may crash.
    os._exit(0)


def _device_facts(job: HarnessJob) -> list[str]:
    """The timing machine's facts for the agents (gpu_worker/device.py for the CPU; the CUDA device's
    properties as torch reads them); an empty list where they cannot be read."""
    try:
        if job.target == "cpu":
            from gpu_worker.device import cpu_facts

            return cpu_facts()
        import torch

        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        facts = [f"GPU: {p.name}, compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
                 f"{p.total_memory >> 30} GiB"]  # fmt: skip
        l2 = getattr(p, "L2_cache_size", 0)
        smem = getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0)
        smem_sm = getattr(p, "shared_memory_per_multiprocessor", 0)
        regs = getattr(p, "regs_per_multiprocessor", 0)
        threads = getattr(p, "max_threads_per_multi_processor", 0)
        facts.append(f"L2 {l2 >> 20} MiB; shared memory {smem >> 10} KiB per block (opt-in), {smem_sm >> 10} KiB "
                     f"per SM; {regs} registers and {threads} threads per SM; warp {getattr(p, 'warp_size', 32)}")
        return facts
    except Exception:  # noqa: BLE001 - facts are a courtesy to the agents, never a failure
        return []


def _device_name(job: HarnessJob) -> str:
    from gpu_worker.device import cpu_name

    if job.target == "cpu":
        return cpu_name()
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_initialized() else ""
    except Exception:  # a broken context may refuse even this
        return ""


if __name__ == "__main__":
    main()
