"""Static refusals for what only a cheat needs (issue #25, item 7): system calls of its own, the process
environment, and the calls that tell the harness from production. The source rules have their cheat
twins in tests/cheats/*/static_*.c* (test_cheats.py); here: the scan of the compiled library's machine
code, which the preprocessor cannot dodge, on candidates that hide their system call from every source
rule; the package baselines' libraries pass it; and the source rules on short snippets, honest ones
included.
"""

from __future__ import annotations

import asyncio
import shutil
import tomllib
from pathlib import Path

import pytest

from containment import build
from gpu_worker import runner, static_checks
from kopt.models import ArtifactRef, ExecRequest, PackageRef
from kopt.package import load_spec
from tests.conftest import REPO, compile_all

BASELINES = ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"]
SILU = REPO / "kernels" / "silu_and_mul"
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")

# A silu_and_mul entry that tells the harness (a pid namespace: a low pid) from production with a raw
# getpid. The asm keyword is pasted from two tokens and the template is a stringified macro argument:
# the source text holds neither `asm` nor a string literal, so no source rule sees the instruction.
HIDDEN = r"""
#include <cstdint>
#include "kopt_abi.h"

#define PASTE(a, b) a##b
#define TEXT(x) #x
#define RAW(insn) PASTE(__as, m__) PASTE(__vol, atile__)(TEXT(insn) : "=a"(ret) : "a"(nr) : "rcx", "r11", "memory")

static long raw(long nr) {
  long ret;
  RAW(INSN);
  return ret;
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)args, (void)nargs, (void)stream;
  return raw(39) < 1000 ? KOPT_OK : KOPT_ERR_ARGS;
}
"""
# The instruction, spelled three ways: by name, as bytes (0f 05 is syscall), and the 32-bit gate.
HIDDEN_INSNS = {"syscall": "syscall", "bytes": ".byte 0x0f; .byte 0x05", "int80": "int $0x80"}
SEEN_AS = {"syscall": "syscall at", "bytes": "syscall at", "int80": "int $0x80 at"}


# Instructions that read what a kernel has no use for, hidden the same way, and the words of their refusal.
HIDDEN_READS = {"rdfsbase": "rdfsbase %0", "rdrand": "rdrand %0"}
HIDDEN_READ_WORDS = {"rdfsbase": "reads the thread control block directly", "rdrand": "draws random numbers"}


def hidden_source(insn: str) -> str:
    return HIDDEN.replace("RAW(INSN)", f"RAW({insn})")


# Honest per-thread state: the compiler reaches a thread_local through %fs (and __tls_get_addr in a shared
# library), the source never names the thread pointer. Neither the source nor the library scan refuses it.
THREAD_LOCAL = r"""
#include <cstdint>
#include "kopt_abi.h"

static thread_local float scratch[256];
static __thread int64_t calls;

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)args, (void)stream;
  scratch[calls++ & 255] = (float)nargs;
  return nargs == 2 ? KOPT_OK : KOPT_ERR_ARGS;
}
"""


# A system call hidden inside another instruction (red team, 2026-11-26): the asm holds a `movl` whose
# immediate is the bytes 0f 05 c3 (syscall; ret) and jumps one byte into it. Neither the source's words
# nor the machine code's linear sweep show a syscall; the branch target, inside an instruction, does.
MID_JUMP = r"""
#include <cstdint>
#include "kopt_abi.h"

extern "C" long kstub(long nr);
__asm__(".text\n.globl kstub\n.type kstub,@function\nkstub:\n movq %rdi, %rax\n jmp .Lk+1\n"
        ".Lk:\n movl $0x90c3050f, %ecx\n ret\n.size kstub, .-kstub\n");

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)args, (void)nargs, (void)stream;
  return kstub(39) < 1000 ? KOPT_OK : KOPT_ERR_ARGS;
}
"""


def write_sources(out: Path, suffix: str) -> dict[str, Path]:
    sources = {}
    for name, insn in HIDDEN_INSNS.items():
        sources[name] = out / f"hidden_{name}{suffix}"
        sources[name].write_text(hidden_source(insn))
    sources["mid_jump"] = out / f"mid_jump{suffix}"
    sources["mid_jump"].write_text(MID_JUMP)
    return sources


@pytest.fixture(scope="module")
def cpu_libs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("static-refusals-cpu")
    sources = write_sources(out, ".cpp")
    sources |= {f"baseline_{name}": REPO / "kernels" / name / "kernel.cpp" for name in BASELINES}
    sources["getenv"] = REPO / "tests" / "cheats" / "cpu" / "static_getenv.cpp"
    sources["raw_asm"] = REPO / "tests" / "hostile" / "raw_asm.cpp"
    for name, insn in HIDDEN_READS.items():
        sources[name] = out / f"hidden_{name}.cpp"
        sources[name].write_text(hidden_source(insn))
    sources["thread_local"] = out / "thread_local.cpp"
    sources["thread_local"].write_text(THREAD_LOCAL)
    return compile_all("cpu", sources, out)


# ---------------------------------------------------------------- the machine-code scan


@pytest.mark.parametrize("name", BASELINES)
def test_cpu_baseline_libraries_pass_every_library_check(cpu_libs, name):
    """g++ links libc dynamically: an honest library holds no system-call instruction at all."""
    assert static_checks.check_machine_code(cpu_libs[f"baseline_{name}"], "cpu") == ([], [])
    assert static_checks.check_library(cpu_libs[f"baseline_{name}"], "cpu") == ([], [])


def test_a_system_call_hidden_inside_another_instruction_is_refused_by_the_library_scan(cpu_libs):
    violations, _ = static_checks.check_machine_code(cpu_libs["mid_jump"], "cpu")
    assert len(violations) == 1 and "hides machine code inside another instruction" in violations[0], violations
    assert "in kstub" in violations[0] and "syscall" not in violations[0]  # the sweep itself sees no syscall


@pytest.mark.parametrize("name", list(HIDDEN_INSNS))
def test_a_system_call_hidden_from_the_source_rules_is_refused_by_the_library_scan(cpu_libs, name):
    violations, notes = runner.static_check(hidden_source(HIDDEN_INSNS[name]), cpu_libs[name], "cpu")
    assert notes == []
    found = [v for v in violations if v.startswith("its machine code makes system calls itself")]
    assert found and SEEN_AS[name] in found[0] and "kopt_silu_and_mul" in found[0], violations


@pytest.mark.parametrize("name", list(HIDDEN_READS))
def test_a_read_hidden_from_the_source_rules_is_refused_by_the_library_scan(cpu_libs, name):
    """rdfsbase hands over the thread pointer, the way to glibc's cached thread id (a pid) without a call;
    rdrand a draw that makes one call in many wrong (red team, 2026-11-27, by its intrinsic)."""
    violations, notes = runner.static_check(hidden_source(HIDDEN_READS[name]), cpu_libs[name], "cpu")
    assert notes == []
    found = [v for v in violations if v.startswith(f"its machine code {HIDDEN_READ_WORDS[name]}")]
    assert found and f"{name} at" in found[0], violations


def test_thread_local_state_passes_the_fs_scans_and_is_refused_as_state(cpu_libs):
    """The compiled code reads %fs (thread_local, the stack protector); only the source spelling it counts
    as reaching the thread control block. The thread_local data itself is state kept between calls."""
    assert static_checks.check_source(THREAD_LOCAL, "cpu") == []
    violations, notes = static_checks.check_library(cpu_libs["thread_local"], "cpu")
    assert notes == [] and len(violations) == 1, violations
    assert violations[0].startswith("keeps writable state between calls") and ".tbss" in violations[0], violations


def test_the_verdict_says_why(cpu_libs):
    """The refusal comes before anything runs, with the reason in the verdict."""
    spec = load_spec(SILU)
    req = ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target="cpu",
                      candidate_id="hidden", library=NO_ARTIFACT, shapes=spec.shapes["cpu"].test, dtypes=spec.dtypes,
                      seed=7, timeout_s=60, source=hidden_source(HIDDEN_INSNS["syscall"]))  # fmt: skip
    result = asyncio.run(runner.run_test(req, cpu_libs["syscall"], SILU, spec))
    assert not result.correct and result.checks == []
    assert result.reason.startswith("static check: its machine code makes system calls itself (syscall at"), result
    assert "tells the harness from production" in result.reason


def test_the_hostile_raw_asm_library_is_refused_too(cpu_libs):
    violations, _ = static_checks.check_library(cpu_libs["raw_asm"], "cpu")
    assert any(v.startswith("its machine code makes system calls itself (syscall at") for v in violations)


def test_an_imported_getenv_says_why(cpu_libs):
    violations, _ = static_checks.check_library(cpu_libs["getenv"], "cpu")
    assert any(v.startswith("imports getenv") and "reads the process environment" in v for v in violations)


def test_without_objdump_a_note_not_a_failure(cpu_libs, monkeypatch):
    which = shutil.which
    monkeypatch.setattr(static_checks.shutil, "which", lambda name: None if name == "objdump" else which(name))
    violations, notes = static_checks.check_library(cpu_libs["syscall"], "cpu")
    assert violations == [] and notes == ["objdump not found (or failed): machine code not checked"]


def test_on_cuda_only_the_static_runtimes_own_instructions_are_allowed(cpu_libs, monkeypatch):
    """nvcc links the static CUDA runtime in: an instruction inside a function that holds the same
    instruction in libcudart_static.a is the runtime's; the same instruction elsewhere is the candidate's."""
    lib = cpu_libs["syscall"]
    monkeypatch.setattr(static_checks, "_cuda_runtime_sites", lambda: frozenset({("kopt_silu_and_mul", "syscall")}))
    assert static_checks.check_machine_code(lib, "cuda") == ([], [])
    monkeypatch.setattr(static_checks, "_cuda_runtime_sites", lambda: frozenset({("other", "syscall")}))
    assert static_checks.check_machine_code(lib, "cuda")[0]
    monkeypatch.setattr(static_checks, "_cuda_runtime_sites", lambda: None)
    assert static_checks.check_machine_code(lib, "cuda") == (
        [], ["static CUDA runtime (libcudart_static.a) not found: machine code not checked"])


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
def test_cuda_libraries_baselines_pass_and_a_hidden_system_call_is_refused(tmp_path):
    sources = {f"baseline_{name}": REPO / "kernels" / name / "kernel.cu" for name in BASELINES}
    written = write_sources(tmp_path, ".cu")
    sources["bytes"] = written["bytes"]  # the best hidden of the three; nvcc is slow
    sources["mid_jump"] = written["mid_jump"]
    libs = compile_all("cuda", sources, tmp_path, ["-O3"])
    for name in BASELINES:
        assert static_checks.check_library(libs[f"baseline_{name}"], "cuda") == ([], [])
    violations, notes = static_checks.check_library(libs["bytes"], "cuda")
    assert notes == [] and any("syscall at" in v and "kopt_silu_and_mul" in v for v in violations), violations
    violations, notes = static_checks.check_library(libs["mid_jump"], "cuda")
    assert notes == [] and any("hides machine code inside another instruction" in v and "kstub" in v
                               for v in violations), violations


# ---------------------------------------------------------------- the source rules on snippets

# The snippets, one case a key: FLAGGED[case] = [source, target, what one of its violations must contain],
# HONEST[case] = [source, target].
SNIPPETS = tomllib.loads((Path(__file__).parent / "static_refusal_snippets.toml").read_text())
FLAGGED, HONEST = SNIPPETS["flagged"], SNIPPETS["honest"]


@pytest.mark.parametrize("case", list(FLAGGED))
def test_source_rules_flag(case):
    source, target, want = FLAGGED[case]
    violations = static_checks.check_source(source, target)
    assert any(want in v for v in violations), violations


@pytest.mark.parametrize("case", list(HONEST))
def test_source_rules_pass_honest_code(case):
    source, target = HONEST[case]
    assert static_checks.check_source(source, target) == []


def test_honest_sources_in_the_repository_pass():
    """The package baselines, the test fixtures that are not meant to fail the checks, and the kept
    benchmark kernels: no new rule refuses them."""
    sources = [*REPO.glob("kernels/*/kernel.c*"), *REPO.glob("tests/fixtures/*/kernel.c*"),
               *REPO.glob("bench/results/**/*.cu")]  # fmt: skip
    assert len(sources) >= 10
    for path in sources:
        target = "cuda" if path.suffix == ".cu" else "cpu"
        assert static_checks.check_source(path.read_text(), target) == [], path
