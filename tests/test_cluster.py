"""Cluster on one host (#28 item 4): the dev server and every role as its own `kopt worker` process, two
exec workers among them, each worker with a KOPT_HOME of its own and one artifact store shared by all (as
machines sharing a volume or bucket would), and `kopt optimize` pointed at the server; the run completes
and both exec workers judged candidates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster import WORKER_ARGS, Cluster
from tests.conftest import QUICK, REPO


@pytest.mark.slow
def test_a_cluster_of_worker_processes_with_two_exec_workers_completes_a_run(tmp_path):
    shared = tmp_path / "artifacts"
    args = {**WORKER_ARGS, "exec-2": ["--role", "exec", "--target", "cpu"]}
    env = {name: {"KOPT_HOME": str(tmp_path / f"home-{name}"), "KOPT_ARTIFACT_DIR": str(shared)} for name in args}
    cluster = Cluster(tmp_path / "server", args, env)
    cluster.start()
    try:
        cluster.wait_ready()
        client_env = {**cluster.env(), "KOPT_HOME": str(tmp_path / "home-cli"), "KOPT_ARTIFACT_DIR": str(shared)}
        proc = subprocess.run([sys.executable, "-m", "frontend.cli", "optimize", str(REPO / "tests" / "fixtures" /
                               "repeat"), "--rounds", "2", "--candidates", "2", *QUICK, "--report-dir",
                               str(tmp_path / "report")], cwd=REPO, env=client_env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    finally:
        cluster.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["status"] == "completed" and len(report["rounds"]) == 4
    executed = {name: (tmp_path / f"home-{name}" / "work" / "exec" / "executions.log") for name in ("exec", "exec-2")}
    counts = {name: len(log.read_text().splitlines()) if log.is_file() else 0 for name, log in executed.items()}
    assert all(n > 0 for n in counts.values()), counts  # both exec workers judged candidates
    assert not (tmp_path / "home-build" / "artifacts").exists()  # every worker used the shared store
