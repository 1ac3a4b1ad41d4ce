"""Hostile candidates are contained (tests/hostile/): no secret, file, network or process outside the jail.

Each source in tests/hostile/ tries one way out in its entry point (or at load), prints what it got
and crashes; its header names the substring the rejection reason must carry. They run through the
harness alone (no static checks: most would be refused before running), so each shows that the
runtime sandbox holds by itself; `libc_syscall` passes the static checks (what no static check can
see: libc's own syscall() reached from an allowed import's address), and runs the full path.
Around them: a secret file readable by everyone on the host, a canary in the worker's environment,
a TCP listener on 127.0.0.1 and the zygote's pid compiled in as a target. Afterwards nothing was
written outside the scratch, no connection arrived, the zygote lives and no process is left.
The compiler is attacked too: flags and sources that read or write files at compile time.
CPU here; CUDA (the same sources, nvcc, the GPU jail) on a GPU machine.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import re
import shutil
import socket
import subprocess
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from containment import build, jail
from containment.build import compile_command, detect_toolchain
from gpu_worker import runner, spawn
from kopt.models import ArtifactRef, ExecRequest, PackageRef
from kopt.package import load_spec

# Counts every process of the sandbox's uid on the machine: run alone.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = Path(__file__).resolve().parent / "hostile"
SCALE2 = Path(__file__).resolve().parent / "fixtures" / "scale2"
SILU = ROOT / "kernels" / "silu_and_mul"
SECRET_DIR = Path("/tmp/kopt-hostile")
SECRET = SECRET_DIR / "secret.txt"
OUTSIDE = SECRET_DIR / "written-by-candidate"
CANARY = f"kopt-canary-{uuid.uuid4().hex}"
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")


@dataclass(frozen=True)
class Hostile:
    name: str
    path: Path
    expect: str
    targets: tuple[str, ...]  # `// targets: cpu` for what only the CPU's kernel hosts refuse

    expect_cpu: str  # `// expect-cpu:` where the CPU's loaded kernel host ends it sooner (seccomp `served`)

    @classmethod
    def load(cls, path: Path) -> Hostile:
        text = path.read_text()
        targets = re.search(r"^// targets: (.+)$", text, re.M)
        expect = re.search(r"^// expect: (.+)$", text, re.M).group(1).strip()
        on_cpu = re.search(r"^// expect-cpu: (.+)$", text, re.M)
        return cls(path.stem, path, expect, tuple(targets.group(1).split()) if targets else ("cpu", "cuda"),
                   on_cpu.group(1).strip() if on_cpu else expect)  # fmt: skip

    def expected(self, target: str) -> str:
        return self.expect_cpu if target == "cpu" else self.expect


ALL_HOSTILE = [Hostile.load(p) for p in sorted(HOSTILE.glob("*.cpp"))]


def corpus(target: str) -> list[Hostile]:
    return [h for h in ALL_HOSTILE if target in h.targets]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The secret file (world-readable: only the jail hides it), a canary key in the environment,
    a TCP listener on 127.0.0.1 and the zygote, whose pid the candidates aim at."""
    SECRET_DIR.mkdir(exist_ok=True)
    SECRET_DIR.chmod(0o755)
    SECRET.write_text(f"{CANARY} sk-hostilecanary{CANARY[-16:]}\n")
    SECRET.chmod(0o644)
    OUTSIDE.unlink(missing_ok=True)
    old_env = {k: os.environ.get(k) for k in ("KOPT_HOSTILE_CANARY", "OPENAI_API_KEY")}
    os.environ.update(KOPT_HOSTILE_CANARY=CANARY, OPENAI_API_KEY=f"sk-{CANARY}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[bytes] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn.recv(64))
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    zygote = spawn.ZygoteClient.shared()
    yield {"port": listener.getsockname()[1], "accepted": accepted, "zygote": zygote,
           "jailed_before": set(jailed_processes())}
    listener.close()
    shutil.rmtree(SECRET_DIR, ignore_errors=True)
    for k, v in old_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def libc_syscall_offset() -> int:
    """Where libc's syscall() lies from its __errno_location() (the same libc in the jail): how
    libc_syscall reaches it with nothing imported but an allowed symbol."""
    libc = ctypes.CDLL(None)
    return (ctypes.cast(libc.syscall, ctypes.c_void_p).value or 0) - (
        ctypes.cast(libc.__errno_location, ctypes.c_void_p).value or 0)


def compile_corpus(target: str, out: Path, planted: dict, entry: str, pkg: Path) -> dict[str, Path]:
    """The corpus, and the package's own kernel as "baseline" (every hostile runs beside it, as a
    candidate does: on CPU in a kernel host next to the baseline's)."""
    tc = detect_toolchain(target)
    if tc is None:
        pytest.skip(f"no compiler for {target}")
    defines = [f"-DENTRY={entry}", f"-DTARGET_PID={planted['zygote'].proc.pid}", f"-DHOSTILE_PORT={planted['port']}",
               f"-DLIBC_SYSCALL_OFFSET={libc_syscall_offset()}", f"-I{HOSTILE}", "-O1"]  # fmt: skip
    libs, procs = {}, {}
    for h in corpus(target):
        src = h.path if target == "cpu" else shutil.copy(h.path, out / f"{h.name}.cu")
        libs[h.name] = out / f"{h.name}.so"
        procs[h.name] = subprocess.Popen(compile_command(tc, Path(src), libs[h.name], defines), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT)  # fmt: skip
    libs["baseline"] = out / "baseline.so"
    procs["baseline"] = subprocess.Popen(compile_command(tc, pkg / ("kernel.cpp" if target == "cpu" else "kernel.cu"),
                                                         libs["baseline"], ["-O2"]), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT)  # fmt: skip
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{log.decode()}"
    return libs


def request(spec, target: str, **extra) -> ExecRequest:
    return ExecRequest(
        package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=target, candidate_id="hostile",
        library=NO_ARTIFACT, shapes=spec.shapes[target].test[:1], dtypes=spec.dtypes[:1], seed=3, timeout_s=120,
        time_cap_s=0.2, **extra,
    )  # fmt: skip


def one_file(path: Path) -> str:
    """A corpus source as a candidate submits it, one file: the corpus's own headers ("hostile_*.h")
    written in where they are included."""
    return re.sub(r'#include "(hostile_\w+\.h)"\n', lambda m: (HOSTILE / m.group(1)).read_text(), path.read_text())


def run_corpus(target: str, pkg: Path, libs: dict[str, Path]) -> dict[str, object]:
    spec = load_spec(pkg)

    async def one(h: Hostile, sem: asyncio.Semaphore):
        async with sem:
            if h.name in ("libc_syscall", "judge_uid"):  # the full path: static checks first, then the run
                return await runner.run_test(request(spec, target, source=one_file(h.path), sanitize=False),
                                             libs[h.name], pkg, spec)  # fmt: skip
            return await runner.run_harness("test", request(spec, target), libs[h.name], pkg, spec,
                                            baseline=libs["baseline"])  # fmt: skip

    async def main():
        sem = asyncio.Semaphore(2)
        hostile = corpus(target)
        return dict(zip([h.name for h in hostile], await asyncio.gather(*(one(h, sem) for h in hostile))))

    return asyncio.run(main())


def jailed_processes() -> dict[int, str]:
    """Processes of the sandbox's uid (65534 when the tests run as root), by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == jail.NOBODY:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
    return out


def check_contained(results: dict[str, object], libs: dict[str, Path], hashes: dict[str, str], planted: dict,
                    target: str):
    for h in ALL_HOSTILE:
        if h.name not in results:
            continue
        r = results[h.name]
        assert not r.correct, f"{h.name} was accepted"
        assert h.expected(target) in r.reason, f"{h.name}: {r.reason}"
        assert "HOSTILE value" not in r.reason and "HOSTILE content" not in r.reason, f"{h.name}: {r.reason}"
        assert CANARY not in r.reason + "".join(r.notes), f"{h.name} leaked the canary"
    assert not OUTSIDE.exists(), "a candidate wrote outside its scratch"
    assert SECRET.read_text().startswith(CANARY)
    assert {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in libs.items()} == hashes, "a library changed"
    assert planted["accepted"] == [], "a candidate reached the TCP listener"
    zygote = planted["zygote"]
    assert zygote.proc.poll() is None and not zygote.dead, "the zygote died"
    assert spawn.ZygoteClient.shared() is zygote
    if os.geteuid() == 0:
        # (another test session running on the same machine at the same time would show here too)
        left = {p: c for p, c in jailed_processes().items() if p not in planted["jailed_before"]}
        assert left == {}, "a sandboxed process outlived its job"


def test_hostile_corpus_is_contained_on_cpu(tmp_path, planted):
    libs = compile_corpus("cpu", tmp_path, planted, "kopt_scale2", SCALE2)
    hashes = {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in libs.items()}
    results = run_corpus("cpu", SCALE2, libs)
    check_contained(results, libs, hashes, planted, "cpu")
    assert results["libc_syscall"].static_violations == []  # it got past the static checks; the jail held
    assert results["judge_uid"].static_violations == []  # likewise; the loaded host's filter ended it
    violations, _ = runner.static_check(HOSTILE.joinpath("raw_asm.cpp").read_text(), libs["raw_asm"], "cpu")
    assert any("makes system calls itself" in v for v in violations)  # run without them: the jail held it too
    assert "killed by the sandbox" in results["io_uring"].reason


@pytest.mark.gpu
def test_hostile_corpus_is_contained_on_cuda(tmp_path, planted):
    spec = load_spec(SILU)
    libs = compile_corpus("cuda", tmp_path, planted, spec.entry, SILU)
    hashes = {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in libs.items()}
    results = run_corpus("cuda", SILU, libs)
    check_contained(results, libs, hashes, planted, "cuda")


def jailed(spec: jail.JailSpec, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """`argv` run in a jail of `spec`, as the launcher runs it; output captured as text."""
    return subprocess.run(jail.command(spec, argv), capture_output=True, text=True, env=jail.launcher_env(),
                          timeout=timeout)  # fmt: skip


def test_the_jobs_pid_is_drawn_like_a_production_processes(tmp_path):
    """A fresh PID namespace numbers its first process 2, and a small pid told a kernel it was being judged
    (tests/cheats/cpu/tls_scan_pid.cpp: read from glibc's thread control block, no system call). Each
    jail draws its job's pid at random up to pid_max; the job's threads count up from it."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    spec = jail.JailSpec(scratch=str(scratch), env={"PATH": "/usr/bin:/bin"})
    probe = "import os,threading;t=threading.Thread(target=lambda:print(threading.get_native_id()));" \
            "print(os.getpid());t.start();t.join()"
    pids, tids = [], []
    for _ in range(4):
        out = jailed(spec, ["python3", "-c", probe])
        assert out.returncode == 0, out.stderr
        pid, tid = (int(x) for x in out.stdout.split())
        pids.append(pid)
        tids.append(tid)
    pid_max = jail.host_pid_max()
    assert len(set(pids)) == 4 and all(jail.JOB_PID_LOW <= p < pid_max for p in pids), pids
    assert max(pids) >= 1000, pids  # all four below 1000: about (700 / pid_max) ** 4 by chance
    assert all(0 < t - p < 64 for p, t in zip(pids, tids)), (pids, tids)


def test_the_jail_hides_the_host_and_holds_its_limits(tmp_path, planted):
    """What a process in a harness jail sees: no host files, no other process, no network, no
    privileges, hard limits, only its own environment."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    spec = jail.JailSpec(scratch=str(scratch), env={"PATH": "/usr/bin:/bin", "ONLY": "this"}, address_space_mb=4096)
    probe = (
        "import os,resource,socket,json;"
        "print(json.dumps({'uid': os.getuid(), 'pids': sorted(p for p in os.listdir('/proc') if p.isdigit()),"
        f"'secret': os.path.exists('{SECRET}'),"
        "'env': dict(os.environ), 'as': resource.getrlimit(resource.RLIMIT_AS),"
        "'cap': open('/proc/self/status').read().split('CapEff:')[1].split()[0],"
        "'ifaces': sorted(os.listdir('/sys/class/net')), 'writable_usr': os.access('/usr', os.W_OK)}))"
    )
    out = jailed(spec, ["python3", "-c", probe])
    assert out.returncode == 0, out.stderr
    seen = __import__("json").loads(out.stdout)
    # A PID namespace of its own: its init and itself, at a pid drawn like a production process's
    assert len(seen["pids"]) == 2 and "1" in seen["pids"], seen
    assert min(int(p) for p in seen["pids"] if p != "1") >= jail.JOB_PID_LOW, seen
    assert not seen["secret"] and not seen["writable_usr"]
    assert {k: v for k, v in seen["env"].items() if k != "LC_CTYPE"} == {"PATH": "/usr/bin:/bin", "ONLY": "this"}
    assert seen["as"] == [4096 << 20, 4096 << 20]  # hard
    assert int(seen["cap"], 16) == 0
    assert seen["ifaces"] == ["lo"]
    if os.geteuid() == 0:
        assert seen["uid"] == jail.NOBODY


# ---------------------------------------------------------------- the compiler


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize(("flags", "prefix"), [
    (["-Wa,@/tmp/kopt-hostile/secret.txt"], []),
    (["-fdump-tree-original=/tmp/kopt-hostile/dump"], []),
    (["-Xcompiler=-Wa,@/etc/shadow"], []),
    (["--compiler-options=-include/tmp/kopt-hostile/secret.txt"], []),
    (["-Xptxas", "-v"], []),
    (["-O3"], ['#include "/tmp/kopt-hostile/secret.txt"']),
    (["-O3"], ['#define F "/tmp/kopt-hostile/secret.txt"', "#include F"]),
    (["-O3"], ['asm(".incbin \\"/tmp/kopt-hostile/secret.txt\\"");']),
    (["-O3"], ['#if __has_include("/etc/shadow")', "#endif"]),
    (["-O3"], ['_Pragma("GCC dependency \\"/etc/shadow\\"")']),
    # found by a red-team session: spellings of #include and .include that a plain pattern misses
    (["-O3"], ['%:include "/tmp/kopt-hostile/secret.txt"']),
    (["-O3"], ['??=include "/tmp/kopt-hostile/secret.txt"']),
    (["-O3"], ['#inc\\', 'lude "/tmp/kopt-hostile/secret.txt"']),
    (["-O3"], ['#/**/include "/tmp/kopt-hostile/secret.txt"']),
    (["-O3"], ['asm(".inc" "lude \\"/tmp/kopt-hostile/secret.txt\\"");']),
    (["-O3"], ['#define PART ".inc"', 'asm(PART "bin \\"/tmp/kopt-hostile/secret.txt\\"");']),
    (["-O3"], [r'asm(".macro zz a\n.\\a \"/tmp/kopt-hostile/secret.txt\"\n.endm\nzz include");']),
], ids=["Wa-at-file", "fdump", "Xcompiler-Wa", "include-option", "Xptxas-next-item", "include-abs", "include-macro",
        "incbin", "has_include", "pragma-dependency", "digraph", "trigraph", "line-splice", "comment-in-directive",
        "asm-concatenated", "asm-macro", "gas-macro"])  # fmt: skip
def test_compile_time_file_access_is_refused_before_the_compiler_runs(tmp_path, planted, target, flags, prefix):
    tc = detect_toolchain(target)
    if tc is None:
        pytest.skip(f"no compiler for {target}")
    base = (SILU / ("kernel.cpp" if target == "cpu" else "kernel.cu")).read_text()
    out = asyncio.run(build.build(tc, "\n".join([*prefix, base]), tmp_path / "b", flags))
    assert not out.ok and out.log.startswith("refused before compiling"), out.log
    assert CANARY not in out.log
    assert not (SECRET_DIR / "dump").exists() and not (tmp_path / "b" / "kernel.so").exists()


def test_the_compiler_jail_holds_when_the_checks_are_bypassed(tmp_path, planted):
    """The last line: g++ in its jail, given the hostile include and a dump path directly."""
    tc = detect_toolchain("cpu")
    work = tmp_path / "w"
    work.mkdir()
    src = work / "kernel.cpp"
    src.write_text(f'#include "{SECRET}"\nint x;\n')
    spec = build.compiler_jail(tc, work)
    argv = build.compile_command(tc, src, work / "kernel.so", [f"-fdump-tree-original={SECRET_DIR}/dump"])
    out = jailed(spec, argv, timeout=120)
    assert out.returncode != 0 and "No such file or directory" in out.stdout + out.stderr
    assert CANARY not in out.stdout + out.stderr
    assert not (SECRET_DIR / "dump").exists()
    limits = jailed(spec, ["cat", "/proc/self/limits"]).stdout
    address = re.search(r"Max address space\s+(\d+)\s+(\d+)", limits).groups()
    processes = re.search(r"Max processes\s+(\d+)\s+(\d+)", limits).groups()
    assert address == (str(build.COMPILER_MEMORY_MB << 20),) * 2  # soft and hard: a cap the compiler cannot lift
    assert processes == (str(build.COMPILER_PROCESSES),) * 2


def test_compiler_logs_are_redacted(tmp_path, monkeypatch):
    """A compile error that quotes a secret-shaped string (a key planted in the source) is redacted
    in the log that goes to history and to the repair prompt."""
    tc = detect_toolchain("cpu")
    monkeypatch.setenv("KOPT_TEST_SOME_TOKEN", "tok-" + CANARY)
    src = f'int x = "sk-{CANARY}" + tok-{CANARY};\n'
    out = asyncio.run(build.build(tc, src, tmp_path / "r", ["-O2"]))
    assert not out.ok and "error" in out.log
    assert CANARY not in out.log and "[REDACTED]" in out.log


# ---------------------------------------------------------------- hosts without namespaces


def test_no_jail_no_candidate(monkeypatch):
    """A child whose jail could not be built ran nothing: its result says so; the escape hatch needs
    both variables, and the probe reports either state."""
    from gpu_worker.protocol import FrameReader

    spec = load_spec(SCALE2)
    job = runner._job("test", request(spec, "cpu"), SCALE2 / "kernel.cpp", SCALE2, spec, None)
    log = "kopt-jail: cannot create namespaces: Operation not permitted (user namespaces disabled?)\n"
    out = spawn.Outcome(returncode=jail.SETUP_FAILED, timed_out=False, timeout_s=5, frames=FrameReader(key=b"k"),
                        log=log, leftover=False)  # fmt: skip
    result = runner.interpret(job, out)
    assert not result.correct
    assert result.reason.startswith("sandbox unavailable, candidate not run: cannot create namespaces")
    assert jail.ESCAPE_HATCH in result.reason

    assert jail.probe() is None  # this host builds jails
    monkeypatch.setenv("KOPT_SANDBOX", "off")
    assert not jail.disabled() and jail.probe() is None  # not without the second variable
    monkeypatch.setenv(jail.ESCAPE_HATCH, "1")
    assert jail.disabled() and "sandbox off" in jail.probe()
