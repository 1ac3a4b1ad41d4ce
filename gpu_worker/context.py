"""What a harness job loads once: device and stream, the reference module, the kernels.

The order matters (see harness.py): device, reference and copy bandwidth first (trusted code),
then the kernel hosts, then the judge's own sandbox. Each library loads in a kernel host of its own
(remote.py), never in this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from gpu_worker import cases
from gpu_worker.abi import KernelFailure, Packed
from gpu_worker.device import cpu_name
from gpu_worker.nvml import Nvml
from gpu_worker.protocol import HarnessJob, arena_bytes
from gpu_worker.remote import Arena, CudaArena, Hosts, RemoteKernel
from kopt.models import Partial


class Context:
    def __init__(self, job: HarnessJob, progress: Callable[[str], None]) -> None:
        self.job = job
        self.progress = progress
        self.report: Callable[[Partial], None] = lambda partial: None  # a finished piece (harness: a frame)
        self.resumed = {p.key: p for p in job.resume}  # pieces an earlier attempt finished
        self.notes: list[str] = []
        self.cuda = job.target == "cuda"
        self.nvml: Nvml | None = None
        self.stream = None
        self.kernel: RemoteKernel | None = None
        self.baseline: RemoteKernel | None = None
        self.hosts = Hosts()  # the kernel hosts: round-trip clock, idle check (and threads on CUDA)
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("target cuda, but torch sees no CUDA device")
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.arena: Arena | CudaArena = CudaArena(self.device)
        else:
            self.device = torch.device("cpu")
            pin_to_one_cpu()  # the kernel hosts inherit it
            self.arena = Arena(arena_bytes(job.memory_limit_mb))
        self.arena.fence_only = job.fence_only
        cases.ARENA = self.arena
        cases.READONLY_INPUTS = not job.writable_inputs
        # Both kernel hosts start first: their process and CUDA-context start-ups overlap with each
        # other and with this process's own (load_kernels waits for them).
        try:
            if job.baseline_library:
                self.baseline = self._start(job.baseline_library, "baseline")
            self.kernel = self._start(job.library, "candidate")
            self._set_up_device()
            self.ref = load_reference(Path(job.package_dir))
        except BaseException:
            self.close()
            raise

    def _set_up_device(self) -> None:
        if not self.cuda:
            self.device_name = cpu_name()
            return
        # A stream of our own, so the stream a kernel is given is never the legacy default one.
        self.stream = torch.cuda.Stream(self.device)
        torch.cuda.set_stream(self.stream)
        props = torch.cuda.get_device_properties(self.device)
        self.device_name = props.name
        bus = getattr(props, "pci_bus_id", None)
        pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0" \
            if bus is not None else None  # fmt: skip
        self.nvml = Nvml(pci, self.device.index or 0)
        if self.nvml.error:
            self.notes.append(f"{self.nvml.error}: clocks, temperature and throttling not recorded")

    @property
    def stream_handle(self) -> int | None:
        return self.stream.cuda_stream if self.stream is not None else None

    def load_kernels(self) -> None:
        """Wait for the kernel hosts started in __init__: baseline first, candidate last, each in a
        host of its own (CPU: whose seccomp profile allows no threads; CUDA: whose threads the judge
        counts). On a failure close() ends both."""
        for host in (self.baseline, self.kernel):
            if host is not None:
                host.wait_ready()

    def close(self) -> None:
        for k in (self.kernel, self.baseline):
            if k is not None:
                k.close()

    def _start(self, library: str, role: str) -> RemoteKernel:
        before = (lambda: self.stream.synchronize()) if self.cuda else None  # the judge's writes land first
        return RemoteKernel(library, self.job.spec.entry, role, self.arena, self.job.memory_limit_mb, self.hosts,
                            before, prefix=self.job.host_prefix)  # fmt: skip

    def sync(self, who: str = "candidate") -> None:
        """Wait for the harness stream only (work hidden on another stream is not waited for);
        a CUDA error raised here was caused by the last kernel call."""
        if self.cuda:
            try:
                self.stream.synchronize()
            except RuntimeError as exc:
                raise KernelFailure(f"{who}: {cuda_error(exc)}", party=who) from None

    def sync_device(self, who: str = "candidate") -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as exc:
                raise KernelFailure(f"{who}: {cuda_error(exc)}", party=who) from None

    def call(self, kernel: RemoteKernel, packed: Packed, fp_bits: int = 0) -> int:
        """One synchronous call (the host waits for its stream before it answers); `fp_bits`: from a caller
        with these MXCSR control bits set (plan.FP_ENVS)."""
        if fp_bits:
            kernel.caller_mode(fp_bits)
        rc = kernel(packed)
        if fp_bits:
            kernel.caller_mode(0)
        self.sync(kernel.role)
        return rc


def pin_to_one_cpu() -> None:
    """CPU target: the judge and its kernel hosts share the CPU the judge runs on. Every call is then
    a switch between two processes on one core (its caches hot, as a call in one process had them),
    the same for both sides of an A/B, instead of a wake-up on whichever core each host happened to
    be on (which moved from block to block and between the two hosts)."""
    try:
        cpu = ctypes.CDLL(None).sched_getcpu()
        if cpu >= 0 and cpu in os.sched_getaffinity(0):
            os.sched_setaffinity(0, {cpu})
    except (OSError, AttributeError):
        pass


def cuda_error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"CUDA error after the kernel call: {first}"


def load_reference(package_dir: Path) -> ModuleType:
    path = package_dir / "reference.py"
    spec = importlib.util.spec_from_file_location(f"kopt_reference_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for fn in ("make_inputs", "reference"):
        if not callable(getattr(module, fn, None)):
            raise ValueError(f"{path}: no function {fn}()")
    return module


def derive_seed(job_seed: int, salt: str, *parts: object) -> int:
    """A seed the candidate cannot predict (salted per job), reproducible from the job seed + salt."""
    digest = hashlib.blake2b(json.dumps([job_seed, salt, *map(str, parts)]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
