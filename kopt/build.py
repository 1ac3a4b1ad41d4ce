"""Compile a candidate's source into a shared library with g++ (cpu) or nvcc (cuda).

Direct compiler calls, no torch: a CUDA candidate builds in a few seconds on a machine without
a GPU. A compile error is data (CompileResult.ok = False), never an exception.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import kernels
from kopt.models import Target
from kopt.procs import kill_group

KERNELS_INCLUDE = Path(kernels.__file__).resolve().parent  # kopt_abi.h ships inside the package
CUDA_ARCH = ["-gencode=arch=compute_90a,code=sm_90a"]  # H100/H200; no PTX embedded


@dataclass(frozen=True)
class Toolchain:
    name: str  # e.g. "cpu" or "cuda13-sm90a"; the build queue is kopt-build-<name>
    target: Target
    compiler: str
    version: str


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def detect_toolchain(target: Target) -> Toolchain | None:
    """The local toolchain for a target, or None when its compiler is missing."""
    if target == "cpu":
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if not cxx:
            return None
        version = _first_line([cxx, "--version"])
        return Toolchain(name="cpu", target="cpu", compiler=cxx, version=version)
    nvcc = find_nvcc()
    if not nvcc:
        return None
    version = _first_line([nvcc, "--version"], pick=r"release (\d+)\.(\d+)")
    major = re.search(r"release (\d+)", version)
    return Toolchain(name=f"cuda{major.group(1) if major else 'x'}-sm90a", target="cuda", compiler=nvcc, version=version)


def compile_command(tc: Toolchain, source: Path, output: Path, flags: list[str]) -> list[str]:
    if tc.target == "cpu":
        return [tc.compiler, "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", *flags,
                f"-I{KERNELS_INCLUDE}", "-o", str(output), str(source)]
    return [tc.compiler, "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", *CUDA_ARCH,
            "-Xptxas", "-v", *flags, f"-I{KERNELS_INCLUDE}", "-o", str(output), str(source)]


@dataclass
class BuildOutput:
    ok: bool
    seconds: float
    log: str
    command: list[str]
    resource_usage: str


async def build(tc: Toolchain, source_text: str, workdir: Path, flags: list[str], timeout_s: float = 300) -> BuildOutput:
    """Write the source into workdir and compile it to workdir/kernel.so."""
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / ("kernel.cu" if tc.target == "cuda" else "kernel.cpp")
    src.write_text(source_text)
    out = workdir / "kernel.so"
    cmd = compile_command(tc, src, out, flags)
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=workdir, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
    )
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
        log = stdout.decode(errors="replace")
        ok = proc.returncode == 0 and out.is_file()
    except asyncio.TimeoutError:
        kill_group(proc.pid)
        await proc.wait()
        log, ok = f"compiler timed out after {timeout_s:.0f} s", False
    except asyncio.CancelledError:
        kill_group(proc.pid)
        raise
    seconds = time.monotonic() - start
    usage = "\n".join(line for line in log.splitlines() if "ptxas info" in line)
    return BuildOutput(ok=ok, seconds=seconds, log=log, command=cmd, resource_usage=usage)


def _first_line(cmd: list[str], pick: str | None = None) -> str:
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if pick:
        for line in text.splitlines():
            if re.search(pick, line):
                return line.strip()
    return text.splitlines()[0].strip() if text else "unknown"
