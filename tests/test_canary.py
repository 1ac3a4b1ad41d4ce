"""A canary API key and a planted secret reach no store and no prompt, through a whole LLM-driven run.

The agent worker's key is a canary; a secret file sits on the host, readable by everyone. Round 1's
coder (a scripted endpoint on 127.0.0.1: tests/fake_openai.py) writes a hostile candidate that
passes the static checks (raw system calls through libc's own syscall(), reached from an allowed
import's address: tests/hostile/libc_syscall.cpp) and, inside the harness, reads its
environment and the secret file and prints a key-shaped string before it crashes: its failure
text reaches the workflow history, the eval cache, the report and round 2's planner prompt. After
the run, every file of the test session's temporary directories (kopt's home: artifacts, caches,
logs; the dev server's database), the workflow history, the report and every request body the
endpoint received are searched for the canary, the secret and the planted string.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from kopt.settings import Settings
from tests.conftest import QUICK
from tests.fake_openai import FakeOpenAI
from tests.test_containment import libc_syscall_offset
from tests.test_llm_workflow import BASE_SOURCE, KEY_ENV, MODEL, OLD_LINE, code, design, diagnosis, execute, \
    make_request, plan  # fmt: skip

CANARY_KEY = f"sk-canary-{uuid.uuid4().hex}"
SECRET_FILE = Path("/tmp/kopt-canary-secret.txt")
SECRET = f"secret-{uuid.uuid4().hex}"
PLANTED = f"planted{uuid.uuid4().hex}"
LEAK = r"""
extern "C" int *__errno_location(void) noexcept;
typedef long (*gate_fn)(long number, ...);

static long sys3(long n, long a, long b, long c) {  // libc's syscall(): no instruction or import of its own
  const long r = ((gate_fn)((const char *)&__errno_location + (LIBC_SYSCALL_OFFSET)))(n, a, b, c);
  return r < 0 ? -*__errno_location() : r;
}

static void copy_out(const char *path) {  // a file's first bytes to stderr, when it can be opened
  char buf[512];
  long fd = sys3(257, -100, (long)path, 0);
  if (fd < 0) return;
  long n = sys3(0, fd, (long)buf, sizeof buf);
  if (n > 0) sys3(1, 2, (long)buf, n);
}

static void leak() {
  static const char key[] = "api_key=sk-", rest[] = "PLANTED\n";  // whole only in the output
  sys3(1, 2, (long)key, sizeof key - 1);
  sys3(1, 2, (long)rest, sizeof rest - 1);
  copy_out("/pro" "c/self/environ");  // split, past the static check (on CPU the first open ends it)
  copy_out("/pro" "c/1/environ");
  copy_out("SECRET_PATH");
  __builtin_trap();
}

"""


def hostile_source() -> str:
    helper = LEAK.replace("SECRET_PATH", str(SECRET_FILE)).replace("PLANTED", PLANTED)
    helper = helper.replace("LIBC_SYSCALL_OFFSET", str(libc_syscall_offset()))
    src = BASE_SOURCE.replace("KOPT_EXPORT int kopt_repeat", helper + "KOPT_EXPORT int kopt_repeat")
    return src.replace(OLD_LINE, "leak();  // reads what it can and prints it")


@pytest.fixture
def canary_env(monkeypatch, tmp_path):
    SECRET_FILE.write_text(SECRET + "\n")
    SECRET_FILE.chmod(0o644)
    monkeypatch.setenv(KEY_ENV, CANARY_KEY)
    monkeypatch.setenv("KOPT_OPENAI_API_KEY_ENV", KEY_ENV)
    monkeypatch.setenv("KOPT_OPENAI_MODEL", MODEL)
    monkeypatch.setenv("KOPT_OPENAI_TIMEOUT_S", "5")
    for var in ("KOPT_OPENAI_ROLES", "KOPT_OPENAI_TEMPERATURE", "KOPT_TEMPORAL_ADDRESS", "KOPT_OPENAI_PRICES"):
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch
    SECRET_FILE.unlink(missing_ok=True)


def files_containing(root: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                hits += [f"{path}: {n.decode()}" for n in needles if n in data]
        except OSError:
            continue
    return hits


@pytest.mark.slow
def test_canary_reaches_no_store_and_no_prompt(temporal_server, tmp_path_factory, canary_env):
    settings = Settings(home=tmp_path_factory.mktemp("kopt-canary"))
    hostile = hostile_source()
    script = [design(), diagnosis(), plan(8, "REPEAT 16 -> 8, hostile"), code(hostile),
              diagnosis(), plan(4, "REPEAT 8 -> 4"), code(BASE_SOURCE.replace("#define REPEAT 16", "#define REPEAT 4"))]
    with FakeOpenAI(script) as srv:
        run = execute(temporal_server, settings, make_request(settings, srv, canary_env, *QUICK, rounds=2))
    assert run.result is not None, (run.error, [(c.activity, c.result) for c in run.view_calls()][-6:])

    # The hostile candidate ran and failed; its failure text went into history with the key-shaped
    # string redacted, and nothing it tried to read was there to print.
    first = run.result.rounds[0]
    assert first.compiled and not first.correct, first
    # On CPU the loaded kernel host's filter ends it at its first open (containment/seccomp.py, `served`).
    assert "killed by the sandbox" in first.failure and "[REDACTED]" in first.failure, first.failure
    tests = [c for c in run.view_calls() if c.activity == "test"]
    assert any("[REDACTED]" in (c.result.reason or "") for c in tests)

    needles = [CANARY_KEY, SECRET, f"sk-{PLANTED}"]
    history = run.history.to_json()
    report = run.report().to_json()
    bodies = [json.dumps(r.body) for r in srv.requests]
    assert len(srv.requests) == len(script)
    assert "[REDACTED]" in bodies[-2]  # round 2's planner saw round 1's failure, redacted
    for needle in needles:
        assert needle not in history
        assert needle not in report
        assert all(needle not in b for b in bodies)
    assert all(r.headers["authorization"] == f"Bearer {CANARY_KEY}" for r in srv.requests)  # only where it belongs
    assert files_containing(tmp_path_factory.getbasetemp(), [n.encode() for n in needles]) == []
