"""The isolated harness on the CPU target: a correct baseline passes, every known cheat is caught.

Each case spawns a real harness subprocess (~1.5 s of torch import each), so the grid is cut to
one dtype for the wrong kernels: each of them fails on its first call whatever the dtype.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from gpu_worker import device, runner
from kopt.build import compile_command, detect_toolchain
from kopt.models import ArtifactRef, ExecRequest, KernelSpec, PackageRef
from kopt.package import load_spec

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCALE2 = FIXTURES / "scale2"
SILU = ROOT / "kernels" / "silu_and_mul"

# wrong kernel -> substring its rejection reason must contain (hang.cpp has a test of its own)
WRONG = {
    "never_writes": "never written",
    "off_by_one": "mismatch",
    "writes_input": "input modified",
    "segfault": "crashed: SIGSEGV",
    "exits": "no valid result",
    "answers_once": "second call on the same buffers",
}


@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, Path]:
    """Every fixture library, compiled in parallel with the project's own g++ command line."""
    tc = detect_toolchain("cpu")
    if tc is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    out = tmp_path_factory.mktemp("libs")
    sources = {"scale2": SCALE2 / "kernel.cpp", **{name: FIXTURES / "wrong" / f"{name}.cpp" for name in [*WRONG, "hang"]}}
    if (SILU / "kernel.cpp").is_file():
        sources["silu_and_mul"] = SILU / "kernel.cpp"
    procs = {
        name: subprocess.Popen(
            compile_command(tc, src, out / f"{name}.so", ["-O2"]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for name, src in sources.items()
    }
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name} failed to compile:\n{log.decode()}"
    return {name: out / f"{name}.so" for name in sources}


@pytest.fixture(scope="session")
def scale2() -> KernelSpec:
    return load_spec(SCALE2)


def request(spec: KernelSpec, kind: str, dtypes: list[str], timeout_s: float = 120.0) -> ExecRequest:
    ref = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
    shapes = getattr(spec.shapes["cpu"], kind)
    return ExecRequest(
        package=PackageRef(spec=spec, files=ref, baseline_sources={}),
        target="cpu", candidate_id=f"{spec.name}-test", library=ref, shapes=shapes, dtypes=dtypes,
        seed=1234, timeout_s=timeout_s,
    )  # fmt: skip


def test_scale2_fixture_is_a_valid_package(scale2):
    assert scale2.entry == "kopt_scale2"
    assert [t.name for t in scale2.tunables_for("cpu")] == ["UNROLL"]
    assert [s.dims for s in scale2.shapes["cpu"].test] == [{"N": 1}, {"N": 17}, {"N": 4096}]


def test_baseline_passes(libs, scale2):
    req = request(scale2, "test", ["float32", "float16"])
    result = asyncio.run(runner.run_test(req, libs["scale2"], SCALE2, scale2))
    assert result.correct, result.reason
    assert len(result.checks) == 3 * 2
    assert all(c.ok and c.max_abs_err == 0.0 for c in result.checks)  # 2*x is exact in both dtypes
    assert result.candidate_id == "scale2-test"
    assert result.device and result.seconds > 0


def test_baseline_profile(libs, scale2):
    req = request(scale2, "bench", ["float32", "float16"])
    result = asyncio.run(runner.run_profile(req, libs["scale2"], SCALE2, scale2))
    assert result.ok, result.reason
    assert result.copy_bandwidth_gbs and result.copy_bandwidth_gbs > 0
    assert [(t.shape, t.dtype) for t in result.timings] == [("N=65536", "float32"), ("N=65536", "float16")]
    for t in result.timings:
        assert 0 < t.p10_us <= t.median_us <= t.p90_us
        assert t.samples >= 20
        assert t.gbytes_per_s > 0 and t.pct_sol is not None and t.pct_sol > 0


@pytest.mark.parametrize("name", list(WRONG))
def test_wrong_kernel_is_rejected(libs, scale2, name):
    req = request(scale2, "test", ["float32"])
    result = asyncio.run(runner.run_test(req, libs[name], SCALE2, scale2))
    assert not result.correct
    assert WRONG[name] in result.reason, result.reason
    assert result.reason.startswith(("N=1 float32", "crashed", "harness produced")), result.reason


def test_answer_once_kernel_fails_the_timed_recheck(libs, scale2):
    req = request(scale2, "bench", ["float32"])
    result = asyncio.run(runner.run_profile(req, libs["answers_once"], SCALE2, scale2))
    assert not result.ok
    assert "timed output re-check failed" in result.reason and "never written" in result.reason


def test_hang_times_out_with_heartbeats(libs, scale2, monkeypatch):
    monkeypatch.setattr(runner, "HEARTBEAT_S", 0.5)
    beats: list[str] = []
    req = request(scale2, "test", ["float32"], timeout_s=5.0)
    result = asyncio.run(runner.run_test(req, libs["hang"], SCALE2, scale2, heartbeat=beats.append))
    assert not result.correct
    assert result.reason.startswith("timed out after 5 s"), result.reason
    # The child names its step once torch has imported (~1.5 s here, more on a loaded machine).
    assert "(during" not in result.reason or "(during test N=1 float32 trial 0)" in result.reason
    assert len(beats) >= 5 and "running for" in beats[-1]


def test_cancel_kills_the_child(libs, scale2, monkeypatch):
    spawned = []
    real_exec = asyncio.create_subprocess_exec

    async def recording_exec(*args, **kwargs):
        proc = await real_exec(*args, **kwargs)
        spawned.append(proc.pid)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording_exec)
    req = request(scale2, "test", ["float32"], timeout_s=60.0)

    async def cancel_soon():
        task = asyncio.create_task(runner.run_test(req, libs["hang"], SCALE2, scale2))
        await asyncio.sleep(2.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # let the child watcher reap it

    asyncio.run(cancel_soon())
    assert len(spawned) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(spawned[0], 0)


@pytest.mark.skipif(not (SILU / "kernel.cpp").is_file(), reason="kernels/silu_and_mul/kernel.cpp not written yet")
def test_silu_and_mul_cpu_baseline_passes(libs):
    spec = load_spec(SILU)
    req = request(spec, "test", ["float16", "bfloat16"])
    result = asyncio.run(runner.run_test(req, libs["silu_and_mul"], SILU, spec))
    assert result.correct, result.reason
    assert len(result.checks) == len(spec.shapes["cpu"].test) * 2


@pytest.mark.parametrize(
    "name, cls",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ],
)
def test_gpu_class_from_name(name, cls):
    assert device.gpu_class_from_name(name) == cls


def test_local_gpus_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert device.local_gpus() == []
    assert device.cpu_name()
