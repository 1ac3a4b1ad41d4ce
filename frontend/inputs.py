"""The checks every command that builds a package makes before anything runs (kopt optimize,
evaluate, verify): the target, the package and the compiler, each failure one UsageError line that
names what to fix."""

from __future__ import annotations

from pathlib import Path

from containment.build import Toolchain, detect_toolchain
from kopt.errors import UsageError
from kopt.models import KernelSpec
from kopt.package import PackageError, load_spec


def package_and_toolchain(kernel_dir: Path, target: str) -> tuple[KernelSpec, Toolchain]:
    if target not in ("cpu", "cuda"):
        raise UsageError(f"unknown target {target!r}; use --target cpu or --target cuda")
    try:
        spec = load_spec(kernel_dir)
    except PackageError as exc:
        raise UsageError(str(exc)) from None
    if target not in spec.targets:
        raise UsageError(f"{Path(kernel_dir) / 'kernel.toml'}: field 'targets': {spec.name} has no {target!r} target "
                         f"(it has {', '.join(spec.targets)})")
    toolchain = detect_toolchain(target)
    if toolchain is None:
        raise UsageError("no CUDA compiler: nvcc not found on PATH or in /usr/local/cuda/bin" if target == "cuda"
                         else "no C++ compiler: g++ not found on PATH")
    return spec, toolchain
