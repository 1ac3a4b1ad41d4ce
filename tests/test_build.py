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
