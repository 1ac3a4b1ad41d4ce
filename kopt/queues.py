"""Task-queue names shared by workflow, workers and CLI (timeouts and retry policies: kopt/activity_table.py
and ActivityTimeouts in kopt/run_models.py)."""

from __future__ import annotations

WORKFLOW_QUEUE = "kopt-workflows"
AGENTS_QUEUE = "kopt-agents"
EXEC_CPU_QUEUE = "kopt-exec-cpu"

# Workflow type names (the workflows' @workflow.defn names): start them through the classes' methods,
# search history by these.
WORKFLOW_NAME = "OptimizeKernel"
REVERIFY_WORKFLOW_NAME = "ReverifyBest"

DEFAULT_GPU_CLASS = "h100"  # --target cuda without --gpu-class (classes: kopt/gpu_classes.py)


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
