"""The front end as a user meets it: one embedded server per KOPT_HOME, signals, exit codes, read
commands that answer from history, and re-running a command whose run has ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frontend.server import ServerError, attach, ephemeral_ports, free_port, read_record
from kopt.settings import Settings
from tests.conftest import QUICK, REPO, kopt_env

SILU = REPO / "kernels" / "silu_and_mul"
KNOBS = REPO / "tests" / "fixtures" / "knobs"  # a tiny package: these runs are about the front end, not the kernel


def kopt(args, home, timeout=300, **env):
    return subprocess.run([sys.executable, "-m", "frontend.cli", *args], cwd=REPO, env=kopt_env(home, **env),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def servers_on(db: Path) -> list[int]:
    """Pids of every process whose command line names this database (dev servers of that home)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(db).encode() in cmd and b"start-dev" in cmd:
                pids.append(int(entry.name))
    return pids


def test_one_server_per_home_shared_by_its_commands_and_never_by_another_home(tmp_path):
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    notes: list[str] = []
    first = attach(home_a, home_a / "temporal.db", 0, 0, headless=True)
    try:
        second = attach(home_a, home_a / "temporal.db", 0, 0, headless=True)  # a second command of home a
        assert second.address == first.address and first.started and not second.started
        assert servers_on(home_a / "temporal.db") == [read_record(home_a).pid]
        port = int(first.address.rsplit(":", 1)[1])
        # Home b asks for home a's port: not attached to it, a fresh port instead, said in one line...
        other = attach(home_b, home_b / "temporal.db", port, 0, headless=True, say=notes.append)
        try:
            assert other.address != first.address and other.started
            assert notes and f"port {port} is in use by another program" in notes[0]
        finally:
            assert other.release()
        assert not servers_on(home_b / "temporal.db")
        # ... or an error when the port was set explicitly.
        with pytest.raises(ServerError, match=f"KOPT_SERVER_PORT={port}: the port is in use"):
            attach(home_b, home_b / "temporal.db", port, 0, port_fixed=True, headless=True)
        assert not first.release()  # the other command of home a still uses it: it stays
        assert servers_on(home_a / "temporal.db") and read_record(home_a) is not None
    finally:
        assert second.release()  # the last user stops it
    assert not servers_on(home_a / "temporal.db") and read_record(home_a) is None


def test_a_stale_record_is_replaced_and_server_stop_respects_users(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "server.json").write_text(json.dumps({"pid": os.getpid(), "address": "127.0.0.1:1", "ui_url": "x",
                                                  "db": str(home / "temporal.db")}))  # fmt: skip
    held = attach(home, home / "temporal.db", 0, 0, headless=True)
    try:
        assert held.started and read_record(home).pid != os.getpid()
        refused = kopt(["server", "stop"], home, timeout=60)
        assert refused.returncode == 1 and "in use by a running kopt command" in refused.stderr, refused.stderr
        status = kopt(["server", "status"], home, timeout=60)
        assert status.returncode == 0 and held.address in status.stdout
        forced = kopt(["server", "stop", "--force"], home, timeout=60)
        assert forced.returncode == 0 and "stopped the kopt server" in forced.stdout
        deadline = time.monotonic() + 10  # the forced stop returns once the server is a zombie; reaped here
        while held.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not servers_on(home / "temporal.db") and not held.alive()
    finally:
        held.release()
    gone = kopt(["server", "status"], home, timeout=60)
    assert gone.returncode == 1 and "no kopt server is running" in gone.stdout



def _start_optimize(home: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "frontend.cli", "optimize", str(KNOBS), "--rounds", "3", *QUICK,
                             "--report-dir", str(home / "report"), *extra], cwd=REPO, env=kopt_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # times `kopt status` (< 2 s): a loaded machine took 2.1 s (decision 0024)
def test_sigterm_mid_run_leaves_nothing_behind_and_the_same_command_finishes_the_run(tmp_path):
    home = tmp_path / "home"
    proc = _start_optimize(home)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the workflow is under way
        line = proc.stdout.readline()
        lines.append(line)
        if "round 0: baseline" in line or not line:
            break
    assert any("round 0: baseline" in ln for ln in lines), lines
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert err.strip().splitlines()[-1].startswith("kopt: SIGTERM; the run is durable"), err
    assert "Traceback" not in err
    assert not servers_on(home / "temporal.db")  # nothing orphaned
    run = next(ln.split()[1] for ln in lines if ln.startswith("run kopt-"))

    again = _start_optimize(home)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"run {run} " in out and "report:" in out  # the same run, carried on to its end
    assert json.loads((home / "report" / "report.json").read_text())["run_id"] == run

    # The same command once more: it says the run has ended and where its report is; nothing starts.
    done = kopt(["optimize", str(KNOBS), "--rounds", "3", *QUICK, "--report-dir", str(home / "report")], home)
    assert done.returncode == 0, done.stderr
    assert f"run {run} already ran with these arguments: completed" in done.stdout
    assert str(home / "report" / "report.md") in done.stdout and "--rerun" in done.stdout
    listed = kopt(["runs", "--json"], home)
    assert [r["run"] for r in json.loads(listed.stdout)] == [run]  # one run, not one per invocation
    assert not servers_on(home / "temporal.db")

    # Read commands on the finished run answer from history, without a worker, in about a second.
    held = attach(home, home / "temporal.db", 0, 0, headless=True)  # a server already up, as after a run
    try:
        t0 = time.monotonic()
        status = kopt(["status", run], home)
        took = time.monotonic() - t0
        assert status.returncode == 0 and "completed" in status.stdout and "round 3/3" in status.stdout, status
        assert "best:" in status.stdout and took < 2.0, (took, status.stdout)
        watch = kopt(["watch", run], home, timeout=30)
        assert watch.returncode == 0 and f"run {run}: completed" in watch.stdout
        for _ in range(8):  # no abort in interpreter finalization after correct output
            again = kopt(["runs"], home, timeout=60)
            assert again.returncode == 0 and run in again.stdout, (again.returncode, again.stderr[-500:])
    finally:
        held.release()


def test_every_read_command_names_an_unknown_run_the_same_way(tmp_path):
    home = tmp_path / "home"
    held = attach(home, home / "temporal.db", 0, 0, headless=True)
    try:
        for args in (["status"], ["watch"], ["history"], ["export"], ["replay"], ["cancel"], ["approve"]):
            args = [*args, "no-such-run"] + (["cand"] if args == ["approve"] else [])
            proc = kopt(args, home, timeout=60)
            assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
            assert proc.stderr.strip() == "kopt: error: unknown run 'no-such-run' (see `kopt runs`)", (args, proc.stderr)
    finally:
        held.release()


def test_settings_and_arguments_fail_in_one_line_before_any_server(tmp_path):
    home = tmp_path / "home"
    bad = kopt(["runs"], home, KOPT_UI_PORT="eighty")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("kopt: error: KOPT_UI_PORT='eighty':"), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    choice = kopt(["worker", "--role", "exec", "--target", "tpu"], home)
    assert choice.returncode == 2 and "invalid choice: 'tpu'" in choice.stderr and "usage:" not in choice.stderr
    empty = kopt(["runs"], home)
    assert empty.returncode == 0 and "no runs yet" in empty.stdout
    if not any(Path(p, "nvidia-smi").exists() for p in os.environ.get("PATH", "").split(os.pathsep)):
        gpu = kopt(["optimize", str(SILU), "--target", "cuda"], home)
        assert gpu.returncode == 2 and "this machine has" in gpu.stderr, gpu.stderr
    assert not (home / "temporal.db").exists() and not (home / "server.json").exists()  # no server was started


def test_an_empty_setting_is_an_unset_one(tmp_path, monkeypatch):
    """`KOPT_HOME= kopt ...` once put a server lock in the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("KOPT_HOME", "KOPT_SERVER_PORT", "KOPT_TEMPORAL_ADDRESS"):
        monkeypatch.setenv(name, "")
    settings = Settings()
    assert settings.home == tmp_path / ".kopt" and settings.server_port == 7233 and settings.temporal_address is None


def test_openai_base_url_is_the_fallback_for_kopt_openai_base_url(monkeypatch):
    from kopt.llm_settings import LLMSettings

    monkeypatch.delenv("KOPT_OPENAI_BASE_URL", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    assert LLMSettings().base_url == "http://127.0.0.1:9/v1"
    monkeypatch.setenv("KOPT_OPENAI_BASE_URL", "http://127.0.0.1:8/v1")
    assert LLMSettings().base_url == "http://127.0.0.1:8/v1"


def test_the_foreground_server_exits_when_its_server_is_stopped(tmp_path):
    home = tmp_path / "home"
    fg = subprocess.Popen([sys.executable, "-m", "frontend.cli", "server"], cwd=REPO, env=kopt_env(home),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "Temporal dev server at 127.0.0.1:" in fg.stdout.readline()
        stop = kopt(["server", "stop", "--force"], home, timeout=60)
        assert stop.returncode == 0, stop.stderr
        _, err = fg.communicate(timeout=30)
        assert fg.returncode == 0 and "the server stopped" in err, err
    finally:
        if fg.poll() is None:
            fg.kill()
    assert not servers_on(home / "temporal.db")


def test_server_ports_are_chosen_below_the_kernels_ephemeral_range(temporal_server):
    """A port picked inside the ephemeral range can be handed out again before the server binds it:
    once in CI the dev server's own worker service (which binds port 0) took the front end's port, and
    the server panicked after the front end was up. Every port kopt picks, and those it names for the
    server's HTTP API and metrics, lie below the range; `avoid` keeps a server's ports distinct."""
    low, _ = ephemeral_ports()
    picks = [free_port() for _ in range(40)]
    assert all(1024 <= p < low for p in picks), picks
    taken = frozenset(picks[:20])
    assert all(free_port(taken) not in taken for _ in range(40))
    args = temporal_server.process.args
    ports = [int(args[args.index(flag) + 1]) for flag in ("--port", "--ui-port", "--http-port", "--metrics-port")]
    assert all(p < low for p in ports) and len(set(ports)) == 4, ports


@pytest.mark.parametrize("name, value, says", [
    ("KOPT_SERVER_PORT", "99999", "less than or equal to 65535"),
    ("KOPT_UI_PORT", "-5", "greater than or equal to 0"),
    ("KOPT_LOG_LEVEL", "loud", "'debug', 'info', 'warning', 'error' or 'critical'"),
    ("KOPT_LOG_FORMAT", "xml", "'auto', 'console' or 'json'"),
    ("KOPT_SANDBOX", "maybe", "'on' or 'off'"),
    ("KOPT_SANDBOX", "off", "only with KOPT_ALLOW_UNSANDBOXED=1"),
    ("KOPT_TEMPORAL_ADDRESS", "not an address", "expected HOST:PORT"),
    ("KOPT_TEMPORAL_ADDRESS", "host:99999", "expected HOST:PORT"),
    ("KOPT_HOME", "/proc/nope", "cannot create it"),
])  # fmt: skip
def test_every_setting_that_cannot_work_exits_2_in_one_line_before_anything_starts(tmp_path, monkeypatch, capsys,
                                                                                  name, value, says):
    """Settings outside the exit-2 promise once ended in a traceback (a port out of range, a home that
    cannot exist), a 10 s connection attempt (a malformed address) or silence (an unknown log level or
    sandbox mode, the sandbox off without its escape hatch)."""
    from frontend.cli import main

    monkeypatch.setenv("KOPT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KOPT_ALLOW_UNSANDBOXED", raising=False)
    monkeypatch.setenv(name, value)
    assert main(["runs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kopt: error: {name}=") and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "home" / "temporal.db").exists()


def test_a_signal_after_the_report_keeps_the_runs_exit_code(tmp_path, monkeypatch, capsys):
    """SIGINT that arrived after "report: ..." was printed (while workers and the server shut down) said
    "interrupted; the run is durable" and exited 130: the run had ended, and a CI job saw a failure.
    A signal before the report still exits 128+N."""
    import frontend.runs
    from frontend.cli import main

    monkeypatch.setenv("KOPT_HOME", str(tmp_path / "home"))
    for written in (True, False):

        async def interrupted(*args, finished=None, **kwargs):
            if written:
                finished["code"] = 0  # what run_optimization sets once the report is written
            raise KeyboardInterrupt

        monkeypatch.setattr(frontend.runs, "run_optimization", interrupted)
        code = main(["optimize", str(SILU), "--target", "cpu", "--rounds", "1"])
        err = capsys.readouterr().err
        if written:
            assert code == 0 and "after the run ended" in err, err
        else:
            assert code == 130 and "the run is durable" in err, err


def test_an_abbreviated_option_is_not_taken_for_a_longer_one(tmp_path, monkeypatch, capsys):
    """`--round 3` was taken as `--rounds 3`: a typo that silently changed the run."""
    from frontend.cli import main

    monkeypatch.setenv("KOPT_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as exc:
        main(["optimize", str(SILU), "--round", "3"])
    assert exc.value.code == 2 and "unrecognized arguments: --round 3" in capsys.readouterr().err


def test_a_mismatch_prints_digits_enough_to_tell_the_values_apart_and_glosses_the_variant():
    """"got -13.3664, expected -13.3664" showed no difference, and "x100" said nothing."""
    from gpu_worker.checks import distinct
    from gpu_worker.correctness import VARIANT_GLOSS

    assert distinct(-13.36641, -13.366412) == ("-13.36641", "-13.366412")
    assert distinct(1.5, 2.0) == ("1.5", "2")
    assert VARIANT_GLOSS["x100"] == " (every float input scaled by 100)" and "x0.01" in VARIANT_GLOSS


def test_the_wall_time_budget_counts_from_the_command_start_and_keeps_the_run_id(tmp_path):
    """`--max-wall-time` counts from the command's start (the dev server's and workers' start-up count):
    the process's own start time, read from /proc, not the workflow's. The same request started again
    attaches to its run: that moment is left out of the run's id."""
    from frontend.runs import prepare_request, workflow_id

    probe = ("import time; time.sleep(1.0); from frontend.runs import command_started_at; "
             "print(time.time() - command_started_at())")
    age = float(subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                               check=True, timeout=60).stdout)
    assert 1.0 <= age < 10, age  # the sleep and the imports before it: counted
    req = prepare_request(KNOBS, "cpu", None, 2, "offline", 0, Settings(home=tmp_path / "home"))
    req = req.model_copy(update={"budgets": req.budgets.model_copy(update={"max_wall_time_s": 60.0})})
    later = req.model_copy(update={"budgets": req.budgets.model_copy(update={"wall_time_from": time.time()})})
    assert workflow_id(later) == workflow_id(req)
    longer = req.model_copy(update={"budgets": req.budgets.model_copy(update={"max_wall_time_s": 61.0})})
    assert workflow_id(longer) != workflow_id(req)
