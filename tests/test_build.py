"""The build step: real g++ and nvcc, no GPU needed to compile."""

from __future__ import annotations

import asyncio
import ctypes
import re

import pytest

from containment import build
from kopt.package import apply_tunables, load_spec
from tests.conftest import REPO

SILU = REPO / "kernels" / "silu_and_mul"
SPEC = load_spec(SILU)


def _build(target, source, tmp_path, flags):
    tc = build.detect_toolchain(target)
    return tc, asyncio.run(build.build(tc, source, tmp_path / "b", flags))


def test_cpu_baseline_builds_and_exports_entry(tmp_path):
    tc, out = _build("cpu", (SILU / "kernel.cpp").read_text(), tmp_path, SPEC.build["cpu"].flags)
    assert out.ok, out.log
    lib = ctypes.CDLL(str(tmp_path / "b" / "kernel.so"))
    assert hasattr(lib, SPEC.entry)
    assert not hasattr(lib, "silu_and_mul_rows")  # only the entry point is exported


def test_a_cpu_build_reports_what_the_vectorizer_did_with_each_loop(tmp_path):
    # The profile analyst's CPU counterpart of ptxas -v (#27 item 3): GCC's remarks, one line per loop.
    rmsnorm = (REPO / "kernels" / "fused_add_rmsnorm" / "kernel.cpp").read_text()
    _, out = _build("cpu", rmsnorm, tmp_path, ["-O3"])
    assert out.ok, out.log
    lines = out.resource_usage.splitlines()
    assert any(re.fullmatch(r"kernel\.cpp:\d+: loop vectorized using \d+ byte vectors", ln) for ln in lines), lines
    # A loop left scalar names why: the square root in the row loop keeps it scalar here.
    assert any(re.fullmatch(r"kernel\.cpp:\d+: loop not vectorized: .+", ln) for ln in lines), lines
    assert "remark" not in out.log and "vectorized" not in out.log  # the build log is unchanged
    # And the instruction mix of the library's own code, with the calls it makes out (libm's sqrtf here).
    mix = re.fullmatch(r"instruction mix of the library's own code: (\d+) instructions; 512-bit vector \d+, "
                       r"256-bit vector \d+, FMA \d+, fp16 conversions \d+, scalar float (\d+), packed float (\d+); "
                       r"calls out: (.+)", lines[-1])  # fmt: skip
    assert mix and int(mix[1]) > 100 and int(mix[3]) > 0 and "sqrtf x" in mix[4], lines[-1]
    # The same source with the loops written as a while over a pointer GCC cannot count: nothing vectorized.
    _, plain = _build("cpu", "float s(const float *p) { float a = 0; while (*p) a += *p++; return a; }",
                      tmp_path / "plain", ["-O3"])  # fmt: skip
    assert plain.ok and "loop vectorized" not in plain.resource_usage
    assert "kernel.cpp:1: loop not vectorized" in plain.resource_usage, plain.resource_usage


def test_vectorizer_summary_keeps_the_reasons_with_their_loop():
    remarks = "\n".join([
        "kernel.cpp:31:25: missed: couldn't vectorize loop",
        "kernel.cpp:32:17: missed: not vectorized: no vectype for stmt: gate[i_57] = _66;",
        "/usr/include/c++/12/cmath:223:26: missed: statement clobbers memory: _92 = __builtin_expf (_90);",
        "kernel.cpp:32:17: missed: not vectorized: a third reason",
        "kernel.cpp:40:5: optimized: loop vectorized using 64 byte vectors",
        "kernel.cpp:40:5: note: vectorized 1 loops in function.",
        "/p/kopt_cpu_half.h:26:12: missed: couldn't vectorize loop",
    ])  # fmt: skip
    assert build.vectorizer_summary(remarks, "kernel.cpp").splitlines() == [
        "kernel.cpp:31: loop not vectorized: no vectype for stmt: gate[i_57] = _66; "
        "statement clobbers memory: _92 = __builtin_expf (_90)",
        "kernel.cpp:40: loop vectorized using 64 byte vectors",
        "kopt_cpu_half.h:26: loop not vectorized",
    ]  # fmt: skip
    assert build.vectorizer_summary("", "kernel.cpp") == ""


def test_compile_error_is_data(tmp_path):
    _, out = _build("cpu", "int broken(", tmp_path, [])
    assert not out.ok and "error" in out.log


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("tunables", [{}, {"VEC": 2, "THREADS": 1024, "BLOCKS_PER_ROW": 8}])
def test_cuda_baseline_compiles_with_nvcc(tmp_path, tunables):
    tc = build.detect_toolchain("cuda")
    assert tc.name.startswith("cuda") and tc.name.endswith("-sm90a")
    source = apply_tunables((SILU / "kernel.cu").read_text(), tunables)
    _, out = _build("cuda", source, tmp_path, SPEC.build["cuda"].flags)
    assert out.ok, out.log
    assert "registers" in out.resource_usage  # ptxas -v report kept for the profile analyst
    data = (tmp_path / "b" / "kernel.so").read_bytes()
    assert b"sm_90a" in data or b"kopt_silu_and_mul" in data


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_toolchain_facts_are_the_rules_the_build_applies(target):
    """#27 item 1: what the agents are told of the toolchain is what the build does: the compiler's own
    version line, the fixed command, exactly the headers the static check lets through (each listed one
    passes, one left out is refused), and the toolkit header's declarations."""
    tc = build.detect_toolchain(target)
    if tc is None:
        pytest.skip(f"no {target} compiler")
    facts = build.toolchain_facts(tc)
    assert facts[0] == f"compiler: {tc.version}" and tc.version != "unknown"
    assert facts[1].startswith(f"every build: {'g++' if target == 'cpu' else 'nvcc'} -std=c++17 -shared")
    headers = next(f for f in facts if f.startswith("allowed headers")).split(": ", 1)[1].split(";")[0].split()
    names = [h.strip("<>") for h in headers]
    assert "kopt_abi.h" in names and ("immintrin.h" in names) == (target == "cpu")
    assert build.include_problems("".join(f"#include <{n}>\n" for n in names)) == []
    assert build.include_problems("#include <thread>\n") and "thread" not in names
    toolkit = "kopt_cpu_half.h" if target == "cpu" else "kopt_cuda.h"
    declared = next(f for f in facts if f.startswith(f"{toolkit} declares: "))
    needle = "static inline float f16_to_f32(uint16_t h)" if target == "cpu" else "P load_pack(const P *p)"
    header = (build.KERNELS_INCLUDE / toolkit).read_text()
    assert needle in declared and len(declared) < len(header) / 2  # bodies left out


def test_header_declarations_leave_bodies_out_and_keep_the_comments_above():
    text = ("#pragma once\n/* file comment */\n// Adds.\n// Two lines.\nstatic inline int add(int a,\n"
            "                      int b) {\n  return a + b;\n}\nstruct P { int x; };\ntemplate <int N>\n"
            "struct Q {\n  int v[N];\n};\n")
    assert build.header_declarations(text) == ["(Adds. Two lines.)", "static inline int add(int a, int b)",
                                               "struct P { int x; }", "template <int N> struct Q"]
