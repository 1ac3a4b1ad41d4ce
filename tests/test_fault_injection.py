"""Fault injection: SIGKILL every part of a running cluster, repeatedly, during a multi-round run.

The run must finish with the same best candidate as an undisturbed run of the same request, with
no round lost or recorded twice, and every kernel evaluation executed at most once per recorded
activity attempt (results are cached by content, so a retry after a crash does not run it again).

One driver, two targets: CPU (in CI) and CUDA (marked `gpu`: the build worker uses nvcc and the
exec worker serves the kopt-gpu-<class> queue of a local GPU; it is one of the victims). Both run
the `repeat` fixture, whose offline search path is deterministic (the CPU variant a copy with
REPEAT 16, 4, 1: steps of 4x that load cannot blur). With KOPT_FAULT_SUMMARY set, each
variant writes its figures (kills per victim, extra attempts, executions, wall times) to that JSON
file under its target's key.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from containment import build
from frontend.client import connect
from frontend.history import RunView, load_run
from frontend.runs import prepare_request
from kopt import queues
from kopt.run_models import ActivityTimeouts, OptimizeRequest, OptimizeResult
from kopt.settings import Settings
from tests.cluster import WORKER_ARGS, Cluster
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "repeat"
MIN_KILLS = 20
VICTIMS = ["workflows", "agents", "build", "exec", "server"]
# Classes whose GPUs run the sm_90a code kopt builds and that kopt can name a queue for.
SM90_CLASSES = ("h100", "h100-pcie", "h100-nvl", "h200")


@dataclass(frozen=True)
class Variant:
    """One target's cluster, request and kill schedule."""

    target: str
    rounds: int
    continue_every: int  # several history segments, so continue-as-new is killed through too
    timeouts: ActivityTimeouts  # short heartbeats: a killed worker's activity is retried after seconds
    best_tunables: dict[str, int]  # where the deterministic search ends
    pause_s: tuple[float, float]  # random wait before each kill (and between status polls)
    down_s: tuple[float, float]  # how long a victim stays dead
    deadline_s: float  # the disturbed run must have closed by then
    worker_args: dict[str, list[str]] = field(default_factory=lambda: dict(WORKER_ARGS))
    gpu_class: str | None = None
    # The target's REPEAT values in the run's copy of the fixture (None: the fixture's own). Steps of
    # 4x keep every accept and reject clear of the timing noise of a loaded machine.
    repeat_values: tuple[int, ...] | None = None


CPU = Variant(
    # Rounds: REPEAT 16 -> 4 (accepted), a flag drop (rejected), REPEAT 4 -> 1 (accepted), a flag drop
    # (rejected); two segments. With the fixture's 2x steps a loaded machine (the parallel test
    # phase) once widened round 1's interval to [0.79, 3.45] in the undisturbed run, which then
    # rejected it and took another path than the disturbed one.
    target="cpu", rounds=4, continue_every=2, repeat_values=(16, 4, 1),
    timeouts=ActivityTimeouts(agent_s=60, agent_heartbeat_s=3, compile_s=120, compile_heartbeat_s=3,
                              exec_s=300, exec_heartbeat_s=6),
    best_tunables={"REPEAT": 1}, pause_s=(0.3, 1.5), down_s=(0.0, 1.0), deadline_s=1200,
)  # fmt: skip


def cuda_variant() -> Variant:
    """The CUDA cluster on this machine's first H100/H200, or a skip saying what is missing."""
    from gpu_worker.device import local_gpus
    from kopt.gpu_classes import KNOWN_GPU_CLASSES

    toolchain = build.detect_toolchain("cuda")
    if toolchain is None:
        pytest.skip("needs nvcc")
    gpus = [g for g in local_gpus() if g.gpu_class in SM90_CLASSES and g.gpu_class in KNOWN_GPU_CLASSES]
    if not gpus:
        pytest.skip(f"needs an sm_90 GPU of class {', '.join(SM90_CLASSES)} (nvidia-smi lists "
                    f"{[g.name for g in local_gpus()] or 'none'})")
    gpu = gpus[0]
    return Variant(
        # Rounds: REPEAT 4 -> 2 (accepted), a flag drop (rejected), REPEAT 2 -> 1 (accepted); two segments.
        target="cuda", rounds=3, continue_every=2,
        # An exec activity heartbeats only after 5 s of each harness child's run, and not while a
        # restarted worker's harness zygote imports torch: its first heartbeat can come after zygote
        # start + test child + 5 s (sanitizer child), so 15 s. Compile heartbeats every 2 s around nvcc.
        timeouts=ActivityTimeouts(agent_s=60, agent_heartbeat_s=3, compile_s=120, compile_heartbeat_s=5,
                                  exec_s=300, exec_heartbeat_s=15),
        # A GPU round takes seconds (nvcc, harness start, compute-sanitizer, A/B timing): kills further
        # apart, so the 20 of them spread over the run instead of all landing in its first rounds.
        best_tunables={"REPEAT": 1}, pause_s=(1.0, 3.5), down_s=(0.0, 1.0), deadline_s=420,
        worker_args={
            "workflows": ["--role", "workflows"],
            "agents": ["--role", "agents"],
            "build": ["--role", "build", "--toolchain", toolchain.name],
            "exec": ["--role", "exec", "--target", "cuda", "--gpu-class", gpu.gpu_class,
                     "--gpu-index", str(gpu.index)],
        },
        gpu_class=gpu.gpu_class,
    )  # fmt: skip


def _package(v: Variant, tmp_path: Path) -> Path:
    """The package both runs of a variant optimize: the fixture, with the variant's REPEAT values."""
    if v.repeat_values is None:
        return FIXTURE
    pkg = tmp_path / "package"
    shutil.copytree(FIXTURE, pkg)
    toml = pkg / "kernel.toml"
    old = 'name = "REPEAT"\ntarget = "cpu"\nvalues = [16, 8, 4, 2, 1]'
    assert v.target == "cpu" and old in toml.read_text()
    toml.write_text(toml.read_text().replace(old, old.replace("[16, 8, 4, 2, 1]", str(list(v.repeat_values)))))
    return pkg


def _request(v: Variant, package: Path, home: Path, seed: int = 3) -> OptimizeRequest:
    req = prepare_request(package, v.target, v.gpu_class, v.rounds, "offline", seed, Settings(home=home))
    return req.model_copy(update={"min_gain": 0.1, "continue_every": v.continue_every, "timeouts": v.timeouts})


@dataclass
class Outcome:
    result: OptimizeResult
    view: RunView
    kills: list[str]
    wall_s: float
    executions: collections.Counter  # (mode, candidate id) -> harness runs, from the exec worker's audit log
    home: Path


async def _status(cluster: Cluster, wf_id: str) -> WorkflowExecutionStatus | None:
    try:
        client = await connect(cluster.address, Settings(home=cluster.home), attempts=100)
        return (await client.get_workflow_handle(wf_id).describe()).status
    except Exception:  # noqa: BLE001 - the server may be down right now
        return None


async def _kill_until_done(v: Variant, cluster: Cluster, wf_id: str, kills: list[str], rng: random.Random,
                           deadline: float) -> None:
    """Kill random parts at random moments until the run closes and MIN_KILLS kills happened."""
    done = False
    while not done or len(kills) < MIN_KILLS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run not done after {len(kills)} kills; logs in {cluster.logs}")
        await asyncio.sleep(rng.uniform(*v.pause_s))
        if len(kills) < MIN_KILLS:
            victim = VICTIMS[len(kills) % len(VICTIMS)] if len(kills) < len(VICTIMS) else rng.choice(VICTIMS)
            cluster.kill(victim)
            kills.append(victim)
            await asyncio.sleep(rng.uniform(*v.down_s))
            cluster.restart(victim)
        if not done:
            status = await _status(cluster, wf_id)
            if status not in (None, WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW):
                assert status == WorkflowExecutionStatus.COMPLETED, f"run closed as {status.name}; logs in {cluster.logs}"
                done = True


def _audit(home: Path) -> list[list[str]]:
    """The exec worker's audit log: one line per real harness run, `TIME MODE CANDIDATE key=value...`."""
    log = home / "work" / "exec" / "executions.log"
    return [line.split() for line in log.read_text().splitlines() if line] if log.is_file() else []


def _executions(home: Path) -> collections.Counter:
    return collections.Counter((fields[1], fields[2]) for fields in _audit(home))


def _resumed(home: Path) -> tuple[int, int]:
    """(executions that resumed an earlier attempt's finished pieces, pieces resumed in all)."""
    counts = [int(f.split("=", 1)[1]) for fields in _audit(home) for f in fields[3:] if f.startswith("resumed=")]
    return sum(1 for n in counts if n), sum(counts)


async def _run(v: Variant, package: Path, home: Path, rng: random.Random | None,
               kills: list[str] | None = None) -> Outcome:
    """One run of the variant's request on a fresh cluster; killed at random when `rng` is given
    (each kill appended to `kills` as it happens)."""
    cluster = Cluster(home, v.worker_args)
    cluster.start()
    kills = [] if kills is None else kills
    try:
        cluster.wait_ready()
        settings = Settings(home=home)
        client = await connect(cluster.address, settings)
        wf_id = f"{'chaos' if rng else 'calm'}-{v.target}-{uuid.uuid4()}"
        start = time.monotonic()
        handle = await client.start_workflow(queues.WORKFLOW_NAME, _request(v, package, home), id=wf_id,
                                             task_queue=queues.WORKFLOW_QUEUE)
        if rng is None:
            await asyncio.wait_for(handle.result(), timeout=v.deadline_s)
        else:
            await _kill_until_done(v, cluster, wf_id, kills, rng, deadline=start + v.deadline_s)
        wall_s = time.monotonic() - start
        client = await connect(cluster.address, settings, attempts=100)
        result = await client.get_workflow_handle(wf_id, result_type=OptimizeResult).result()
        view = await load_run(client, wf_id)
        return Outcome(result, view, kills, wall_s, _executions(home), home)
    finally:
        cluster.stop()


def _attempts(view: RunView) -> tuple[collections.Counter, collections.Counter]:
    """(recorded attempts per (test|profile, candidate), extra attempts per activity type)."""
    exec_attempts: collections.Counter = collections.Counter()
    extra: collections.Counter = collections.Counter()
    for r in view.rounds:
        for call in r.calls:
            extra[call.activity] += max(call.attempts, 1) - 1
            if call.activity in ("test", "profile"):
                exec_attempts[(call.activity, call.input.candidate_id)] += max(call.attempts, 1)
    return exec_attempts, extra


def _summary(v: Variant, calm: Outcome, chaos: Outcome) -> dict:
    """The figures of one variant: what was killed, what it cost, what ran twice."""
    exec_attempts, extra = _attempts(chaos.view)
    _, calm_extra = _attempts(calm.view)
    resumed = _resumed(chaos.home)
    modes: collections.Counter = collections.Counter()
    for (mode, _), n in chaos.executions.items():
        modes[mode] += n
    best, calm_best = chaos.result.best, calm.result.best
    baseline = chaos.result.baseline.profile
    return {
        "target": v.target, "gpu_class": v.gpu_class, "device": baseline.device if baseline else None,
        "rounds": v.rounds, "segments": chaos.result.segments,
        "kills": len(chaos.kills), "kills_by_victim": dict(collections.Counter(chaos.kills)), "kill_order": chaos.kills,
        # Attempts beyond the first, per activity type (a kill, or a heartbeat timeout).
        "extra_attempts": {"disturbed": {k: n for k, n in sorted(extra.items()) if n},
                           "disturbed_total": sum(extra.values()),
                           "undisturbed": {k: n for k, n in sorted(calm_extra.items()) if n}},
        "executions": {"disturbed": sum(chaos.executions.values()), "undisturbed": sum(calm.executions.values()),
                       "disturbed_by_mode": dict(modes), "exec_activities": len(exec_attempts),
                       "exec_attempts": sum(exec_attempts.values()),
                       "re_executions": sum(chaos.executions.values()) - len(exec_attempts),
                       "resumed_executions": resumed[0], "resumed_pieces": resumed[1]},
        "wall_s": {"undisturbed": round(calm.wall_s, 1), "disturbed": round(chaos.wall_s, 1),
                   "ratio": round(chaos.wall_s / calm.wall_s, 2) if calm.wall_s else None},
        "best": {"candidate_id": best.candidate_id if best else None, "round": best.round if best else None,
                 "tunables": best.tunables if best else None,
                 "speedup_undisturbed": round(calm_best.speedup_geomean, 3) if calm_best else None,
                 "speedup_disturbed": round(best.speedup_geomean, 3) if best else None},
        "same_best": bool(best and calm_best and best.candidate_id == calm_best.candidate_id),
        "rounds_disturbed": [[r.round, r.description, round(r.speedup_geomean or 0, 3), r.accepted]
                             for r in chaos.result.rounds],
    }  # fmt: skip


def _failure_summary(v: Variant, tmp_path: Path, calm: Outcome | None, kills: list[str], exc: BaseException) -> dict:
    """What is known when a run did not finish: the error, the kills so far, each log's last lines."""
    home = tmp_path / ("chaos" if calm else "calm")
    tails = {}
    for log in sorted((home / "logs").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        tails[log.stem] = lines[-15:]
    return {
        "target": v.target, "gpu_class": v.gpu_class, "error": f"{type(exc).__name__}: {exc}"[:2000],
        "failed_in": "disturbed" if calm else "undisturbed", "kills": len(kills),
        "kills_by_victim": dict(collections.Counter(kills)), "kill_order": kills,
        "wall_s": {"undisturbed": round(calm.wall_s, 1) if calm else None},
        "executions": {"so_far": sum(_executions(home).values())}, "log_tails": tails,
    }  # fmt: skip


def _write_summary(target: str, summary: dict) -> None:
    """Merge this variant's figures into $KOPT_FAULT_SUMMARY (one key per target)."""
    path = os.environ.get("KOPT_FAULT_SUMMARY")
    if not path:
        return
    out = Path(path)
    try:
        data = json.loads(out.read_text()) if out.is_file() else {}
    except ValueError:
        data = {}
    data[target] = summary
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def check_survives_kills(v: Variant, tmp_path: Path, seed: int = 11) -> None:
    """The protocol: an undisturbed run, then the same request under MIN_KILLS kills, compared."""
    calm = chaos = None
    kills: list[str] = []
    package = _package(v, tmp_path)
    try:
        calm = asyncio.run(_run(v, package, tmp_path / "calm", None))
        chaos = asyncio.run(_run(v, package, tmp_path / "chaos", random.Random(seed), kills))
    except BaseException as exc:
        _write_summary(v.target, _failure_summary(v, tmp_path, calm, kills, exc))
        raise
    result, view = chaos.result, chaos.view

    summary = _summary(v, calm, chaos)
    _write_summary(v.target, summary)
    for name, res in (("calm", calm.result), ("chaos", result)):
        print(name, [(r.round, r.description, round(r.speedup_geomean or 0, 3), r.speedup_ci, r.accepted)
                     for r in res.rounds])
    counts = collections.Counter(kills)
    print(f"\n{v.target}: kills: {len(kills)} {dict(counts)}; undisturbed {calm.wall_s:.1f}s, disturbed "
          f"{chaos.wall_s:.1f}s, segments {result.segments}")
    assert len(kills) >= MIN_KILLS and set(counts) == set(VICTIMS)
    assert calm.result.status == "completed", calm.result.reason
    assert result.status == "completed", result.reason

    # Same outcome as the undisturbed run: same best, same rounds, none lost or twice.
    assert calm.result.best.tunables == v.best_tunables, [(r.description, r.speedup_geomean) for r in calm.result.rounds]
    assert result.best.candidate_id == calm.result.best.candidate_id
    assert [r.round for r in result.rounds] == list(range(1, v.rounds + 1))
    assert [r.candidate_id for r in result.rounds] == [r.candidate_id for r in calm.result.rounds]
    assert [r.accepted for r in result.rounds] == [r.accepted for r in calm.result.rounds]
    assert result.best.tunables == v.best_tunables
    assert [r.round for r in view.rounds] == list(range(v.rounds + 1))
    assert result.segments == calm.result.segments > 1

    # Executions on the device: at most one per recorded attempt of each test/profile activity.
    attempts, _ = _attempts(view)
    ran = chaos.executions
    print(f"evaluations: {sum(ran.values())} executions for {len(attempts)} activities "
          f"({sum(ran.values()) - len(attempts)} re-executions after kills); activity attempts recorded: "
          f"{sum(attempts.values())}")
    print("summary:", json.dumps(summary, sort_keys=True))
    for key, n in ran.items():
        assert n <= attempts[key], (key, n, attempts[key])


@pytest.mark.slow
def test_run_survives_repeated_kills_of_every_part(tmp_path):
    check_survives_kills(CPU, tmp_path)


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_run_survives_repeated_kills_of_every_part(tmp_path):
    """The same protocol on a GPU: nvcc build worker, exec worker on kopt-gpu-<class> (a victim too)."""
    check_survives_kills(cuda_variant(), tmp_path)


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("repeat", [4, 2, 1])
def test_cuda_fixture_compiles_and_passes_static_checks(tmp_path, repeat):
    """The GPU variant's fixture, at every REPEAT the search visits: builds with nvcc, no GPU needed."""
    from gpu_worker.static_checks import check_library, check_source
    from kopt.package import apply_tunables, load_spec

    spec = load_spec(FIXTURE)
    assert [t.values for t in spec.tunables_for("cuda")] == [[4, 2, 1]]
    req = prepare_request(FIXTURE, "cuda", "h100", 1, "offline", 0, Settings(home=tmp_path / "home"))
    assert req.baseline.tunables == {"REPEAT": 4} and req.toolchain.endswith("-sm90a")
    source = apply_tunables((FIXTURE / "kernel.cu").read_text(), {"REPEAT": repeat})
    tc = build.detect_toolchain("cuda")
    out = asyncio.run(build.build(tc, source, tmp_path / "b", spec.build["cuda"].flags))
    assert out.ok, out.log
    assert "registers" in out.resource_usage
    assert b"kopt_repeat" in (tmp_path / "b" / "kernel.so").read_bytes()
    assert check_source(source, "cuda") == []
    assert check_library(tmp_path / "b" / "kernel.so", "cuda")[0] == []
