"""A local kopt cluster of real processes: the dev server on a SQLite file and one worker per role.

Used by the fault-injection tests to SIGKILL any part, as a crash would, and start it again.
WORKER_ARGS is the CPU cluster; a CUDA cluster passes its own (a cuda build toolchain, an exec
worker on a GPU queue).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from frontend.server import DevServer, free_port, start_dev_server
from tests.conftest import REPO

WORKER_ARGS = {
    "workflows": ["--role", "workflows"],
    "agents": ["--role", "agents"],
    "build": ["--role", "build", "--toolchain", "cpu"],
    "exec": ["--role", "exec", "--target", "cpu"],
}


class Cluster:
    def __init__(self, home: Path, worker_args: dict[str, list[str]] | None = None,
                 worker_env: dict[str, dict[str, str]] | None = None):  # fmt: skip
        self.home = home
        self.worker_args = worker_args or WORKER_ARGS  # `kopt worker` arguments by worker name
        self.worker_env = worker_env or {}  # extra environment by worker name (its own KOPT_HOME, say)
        self.port = free_port()
        self.db = home / "temporal.db"
        self.server: DevServer | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KOPT_")}
        pythonpath = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.update(KOPT_HOME=str(self.home), KOPT_TEMPORAL_ADDRESS=self.address, PYTHONPATH=pythonpath,
                   KOPT_LOG_FORMAT="json")
        return env

    def start_server(self) -> None:
        self.server = start_dev_server(self.db, self.port, free_port(), headless=True,
                                       log_file=self.logs / "server.log")

    def start_worker(self, role: str) -> None:
        log = open(self.logs / f"{role}.log", "ab")
        self.workers[role] = subprocess.Popen(
            [sys.executable, "-m", "frontend.cli", "worker", *self.worker_args[role]], cwd=REPO,
            env={**self.env(), **self.worker_env.get(role, {})},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self) -> None:
        self.start_server()
        for role in self.worker_args:
            self.start_worker(role)

    def kill(self, name: str) -> None:
        """SIGKILL a worker (its whole process group, kernels included) or the server."""
        if name == "server":
            self.server.kill()
            return
        proc = self.workers[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def restart(self, name: str) -> None:
        if name == "server":
            self.start_server()
        else:
            self.start_worker(name)

    def stop(self) -> None:
        for name in list(self.workers):
            self.kill(name)
        if self.server:
            self.server.stop()

    def wait_ready(self, timeout: float = 60) -> None:
        """Until every worker has connected and says so in its log; a worker that exits fails fast."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, proc in self.workers.items():
                if proc.poll() is not None:
                    tail = (self.logs / f"{role}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the {role} worker exited with code {proc.returncode} at start:\n{tail}")
            if all("worker_started" in (self.logs / f"{role}.log").read_text(errors="replace")
                   for role in self.workers):
                return
            time.sleep(0.2)
        raise RuntimeError(f"workers not started after {timeout:.0f} s; see logs in {self.logs}")
