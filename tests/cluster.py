"""A local kopt cluster of real processes: the dev server on a SQLite file and one worker per role.

Used by the fault-injection tests to SIGKILL any part, as a crash would, and start it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kopt.server import DevServer, free_port, start_dev_server
from tests.conftest import REPO

WORKER_ARGS = {
    "workflows": ["--role", "workflows"],
    "agents": ["--role", "agents"],
    "build": ["--role", "build", "--toolchain", "cpu"],
    "exec": ["--role", "exec", "--target", "cpu"],
}


class Cluster:
    def __init__(self, home: Path):
        self.home = home
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
            [sys.executable, "-m", "kopt.cli", "worker", *WORKER_ARGS[role]], cwd=REPO, env=self.env(),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self) -> None:
        self.start_server()
        for role in WORKER_ARGS:
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

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p.poll() is None for p in self.workers.values()):
                return
            time.sleep(0.2)
        raise RuntimeError("a worker died at start; see logs in " + str(self.logs))
