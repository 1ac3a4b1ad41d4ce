"""Limits the harness child puts on itself before it loads candidate code (no torch here).

The child already runs inside its jail (containment/jail.py: namespaces, a read-only view of the host,
an unprivileged uid, hard rlimits, a minimal environment). Here, once torch and the device are set
up and before the first library loads:
- RLIMIT_AS (hard) on the CPU target: the current size plus the job's headroom (CUDA reserves huge
  virtual ranges, so on CUDA the jail's process cap and the device are the bounds);
- in a kernel host, RLIMIT_STACK (hard): the main thread's stack as it is plus KERNEL_STACK, what a call
  may use (a production caller's thread may have 1 MiB in all: a kernel with a 2 MiB frame passed and
  crashed there, red team 2026-11-27);
- the seccomp allow-list of containment/seccomp.py ("harness" profile): no fork or exec, no ptrace, no
  io_uring, no mounts or namespaces, signals only to itself, rlimits never raised, sockets only
  AF_UNIX. A forbidden call kills the process (SIGSYS) or fails with EPERM.
Where seccomp cannot be installed, the notes say so and the parent reports any process that
outlives the harness.
"""

from __future__ import annotations

import resource
import signal

from containment import seccomp

FSIZE_LIMIT = 64 << 20
KERNEL_STACK = 1 << 20
# The machine's variables a harness child and its kernel hosts may see (none of them secret); everything
# else of the worker's environment (API keys, tokens, paths of the user's home) stays behind.
PASSED_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH",
              "OMP_NUM_THREADS", "TZ")  # fmt: skip  # stack bytes one call may use (kernels/kopt_abi.h says so)
SIGSYS_REASON = seccomp.KILLED_REASON


def _vm_size() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _stack_size() -> int:
    """The main thread's stack mapping as it is now (it grows down to RLIMIT_STACK)."""
    try:
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[stack]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return hi - lo
    except (OSError, ValueError):
        pass
    return 0


def apply(target: str, memory_limit_mb: int, use_seccomp: bool = True, profile: seccomp.Profile = "harness") -> list[str]:
    """Apply every limit; returns notes on what could not be applied (never raises)."""
    notes = []
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it, so a flood would only spin on EFBIG
    limits = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, FSIZE_LIMIT)]
    if target == "cpu" and memory_limit_mb > 0:
        limits.append((resource.RLIMIT_AS, _vm_size() + (memory_limit_mb << 20)))
    if profile in ("host", "cuda-host") and (stack := _stack_size()):
        limits.append((resource.RLIMIT_STACK, stack + KERNEL_STACK))
    for limit, value in limits:
        try:
            _, hard = resource.getrlimit(limit)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value))  # hard: the candidate cannot raise it back
        except (ValueError, OSError) as exc:
            notes.append(f"setrlimit {limit}: {exc}")
    why = seccomp.install(profile) if use_seccomp else "seccomp off for this job"
    if why:
        notes.append(why)
    return notes
