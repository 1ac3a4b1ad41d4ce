"""Task-queue names, activity timeouts and other constants shared by workflow, workers and CLI."""

from __future__ import annotations

from datetime import timedelta

WORKFLOW_QUEUE = "kopt-workflows"
AGENTS_QUEUE = "kopt-agents"
EXEC_CPU_QUEUE = "kopt-exec-cpu"

WORKFLOW_NAME = "OptimizeKernel"

# GPU classes kopt knows how to name (gpu_worker.device names a device's class).
KNOWN_GPU_CLASSES = ("h100", "h100-pcie", "h100-nvl", "h200", "a100", "l40s", "b200")
DEFAULT_GPU_CLASS = "h100"

PLAN_TIMEOUT = timedelta(minutes=5)
CODE_TIMEOUT = timedelta(minutes=5)
COMPILE_TIMEOUT = timedelta(minutes=10)
EXEC_TIMEOUT = timedelta(minutes=20)
EXEC_HEARTBEAT = timedelta(seconds=60)


def build_queue(toolchain: str) -> str:
    return f"kopt-build-{toolchain}"


def gpu_queue(gpu_class: str) -> str:
    return f"kopt-gpu-{gpu_class}"


def exec_queue(target: str, gpu_class: str | None) -> str:
    if target == "cpu":
        return EXEC_CPU_QUEUE
    if not gpu_class:
        raise ValueError("target cuda needs a GPU class")
    return gpu_queue(gpu_class)
