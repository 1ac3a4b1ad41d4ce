"""Every local GPU of the class serves the embedded campaign (#28 item 1): the exec worker gets a slot per
GPU, each activity takes a free GPU for its harness children (gpu_worker/spawn.VISIBLE_GPU), and the
results, round records and progress lines say which GPU judged each candidate. Exercised here with a
CPU exec worker whose slots stand for two GPUs (the mechanism, not the device); the real thing ran on a
two-GPU host (the #28 note has the figures)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from frontend.client import connect
from frontend.runs import prepare_request
from frontend.workers import WorkerPlan, running_workers, toolchains_for
from gpu_worker import spawn
from kopt import queues
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO


def test_a_tasks_gpu_reaches_its_harness_children_and_not_the_zygote():
    assert "CUDA_VISIBLE_DEVICES" not in spawn.harness_env() or spawn.VISIBLE_GPU.get() is None

    async def in_task(index: int) -> tuple[dict, dict]:
        spawn.VISIBLE_GPU.set(index)
        return spawn.harness_env(), spawn.harness_env(task_gpu=False)

    async def main():
        return await asyncio.gather(in_task(0), in_task(1))

    (child0, zygote0), (child1, _) = asyncio.run(main())
    assert child0["CUDA_VISIBLE_DEVICES"] == "0" and child1["CUDA_VISIBLE_DEVICES"] == "1"
    assert zygote0.get("CUDA_VISIBLE_DEVICES") != "0" or spawn.VISIBLE_GPU.get() is not None
    assert spawn.VISIBLE_GPU.get() is None  # each task had its own


def test_two_gpu_slots_judge_a_rounds_candidates_side_by_side(temporal_server, tmp_path):
    settings = Settings(home=tmp_path / "home")
    req = prepare_request(REPO / "tests" / "fixtures" / "repeat", "cpu", None, 1, "offline", 0, settings)
    req = req.model_copy(update={"candidates_per_round": 2, "time_cap_s": 0.1})
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=toolchains_for(["cpu"]),
                      exec_target="cpu", gpu_indices=(0, 1))  # fmt: skip

    async def run() -> OptimizeResult:
        client = await connect(temporal_server.address, settings)
        async with running_workers(client, settings, plan):
            return await client.execute_workflow(queues.WORKFLOW_NAME, req, id=f"every-gpu-{uuid.uuid4()}",
                                                 task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)

    result = asyncio.run(run())
    assert result.status == "completed" and len(result.rounds) == 2, result
    assert {r.gpu_index for r in result.rounds} <= {0, 1}
    # Each execution's audit line names its GPU. A round's two candidates are compiled together and judged
    # at once, one on each slot; which of them a round record names depends on who finished first.
    executions = (settings.work_dir / "exec" / "executions.log").read_text().splitlines()
    used = {line.rsplit("gpu=", 1)[1] for line in executions}
    assert used == {"0", "1"}, executions
    assert result.baseline.profile is not None and result.baseline.profile.gpu_index in (0, 1)


def test_candidates_default_to_two_slots_a_gpu_offline_and_one_in_lockstep(tmp_path, monkeypatch):
    """Decision 0041: offline, in asynchronous slots, two candidates per local GPU (one compiled while the
    other is judged); with --lockstep or an LLM provider one per GPU (decision 0038); an explicit
    --candidates wins; on the CPU target one."""
    from frontend import runs
    from frontend.cli import _parser

    monkeypatch.setattr(runs, "local_gpu_indices", lambda gpu_class, gpus="all": [0, 1] if gpus == "all" else [0])
    settings = Settings(home=tmp_path / "home")

    def candidates(*options: str, target: str = "cuda") -> tuple[int, bool]:
        args = _parser().parse_args(["optimize", str(REPO / "kernels" / "silu_and_mul"), "--target", target, *options])
        req = prepare_request(args.kernel_dir, args.target, "h100" if target == "cuda" else None, 1, "offline", 0,
                              settings)  # fmt: skip
        req = runs.apply_run_options(req, args, settings)
        return req.candidates_per_round, req.lockstep

    assert candidates() == (4, False)
    assert candidates("--gpus", "1") == (2, False)
    assert candidates("--lockstep") == (2, True)
    assert candidates("--candidates", "3") == (3, False)
    assert candidates(target="cpu") == (1, False)


def fake_nvidia_smi(tmp_path) -> str:
    """A PATH whose nvidia-smi lists two H100s (indices 0, 1) and an H200 (2)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=index,name,uuid ] || exit 9\n"
                    "echo '0, NVIDIA H100 80GB HBM3, GPU-aaaa-0000'\necho '1, NVIDIA H100 80GB HBM3, GPU-bbbb-1111'\n"
                    "echo '2, NVIDIA H200, GPU-cccc-2222'\n")  # fmt: skip
    fake.chmod(0o755)
    return f"{fake.parent}:/usr/bin:/bin"


def test_a_cuda_exec_worker_checks_its_gpu_index_and_class(tmp_path):
    """`kopt worker --role exec --target cuda` once failed on every GPU host ("too many values to unpack"),
    when the GPU list gained a UUID column; CI has no GPU, so a fake nvidia-smi stands in. Each wrong
    index or class is a one-line usage error before any server starts."""
    from tests.test_frontend import kopt

    path = fake_nvidia_smi(tmp_path)
    home = tmp_path / "home"
    missing = kopt(["worker", "--role", "exec", "--target", "cuda", "--gpu-index", "7"], home, PATH=path)
    assert missing.returncode == 2 and "no local GPU with index 7 (found [0, 1, 2])" in missing.stderr, missing.stderr
    other = kopt(["worker", "--role", "exec", "--target", "cuda", "--gpu-index", "2", "--gpu-class", "h100"], home,
                 PATH=path)  # fmt: skip
    assert other.returncode == 2 and "GPU 2 is a h200, not a h100" in other.stderr, other.stderr
    assert not (home / "server.json").exists()


def test_cuda_visible_devices_chooses_the_embedded_campaigns_gpus(tmp_path, monkeypatch):
    """A user who sets CUDA_VISIBLE_DEVICES=1 on a shared host gets GPU 1 and only it (the embedded plan once
    took nvidia-smi's first GPU whatever it said). Entries are indices or UUID prefixes; as in CUDA, the
    list ends at the first entry that names no GPU, and an empty one hides them all."""
    from frontend import runs
    from kopt.errors import UsageError

    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path))

    def chosen(visible: str | None, gpus: str = "all") -> list[int]:
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return runs.local_gpu_indices("h100", gpus)

    assert chosen(None) == [0, 1]
    assert chosen("1") == [1] and chosen("GPU-bbbb") == [1]
    assert chosen("1,0") == [1, 0] and chosen("1,0", "1") == [1]
    assert chosen("0,7,1") == [0]  # CUDA stops at 7
    assert chosen("2,1") == [1]  # the H200 is another class
    for hidden in ("", "7", "GPU-zzzz"):
        with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES="):
            chosen(hidden)
    with pytest.raises(UsageError, match="from 1 to 1"):
        chosen("0", "2")
