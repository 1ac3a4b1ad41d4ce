"""The build step: real g++ and nvcc, no GPU needed to compile."""

from __future__ import annotations

import asyncio
import ctypes

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
