"""The fused_add_rmsnorm and merge_attn_states_lse packages: valid, correct on CPU, strict enough.

CPU only (the CUDA sources are compiled, not run, and only where nvcc exists). Each harness case
spawns a subprocess (~1.5 s of torch import), so the grid is kept small.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
from pathlib import Path

import pytest

from containment.build import compile_command, detect_toolchain, find_nvcc
from gpu_worker import runner
from kopt.models import ArtifactRef, ExecRequest, KernelSpec, PackageRef
from kopt.package import apply_tunables, load_spec

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = ROOT / "kernels" / "fused_add_rmsnorm"
MERGE = ROOT / "kernels" / "merge_attn_states_lse"
PACKAGES = {"fused_add_rmsnorm": RMSNORM, "merge_attn_states_lse": MERGE}

# Deliberately wrong CPU variants: (package, text to replace, replacement, what the reason names).
WRONG = {
    "residual_not_written": ("fused_add_rmsnorm", "rr[j + k] = S::store(s);", "(void)0;", "residual"),
    "log2_merge": ("merge_attn_states_lse", "std::log(sum) + m", "std::log2(sum) + m", "s_out"),
}


def _compile(tc, source: str, out: Path, flags: list[str], suffix: str) -> subprocess.CompletedProcess:
    src = out.with_suffix(suffix)
    src.write_text(source)
    return subprocess.run(compile_command(tc, src, out, flags), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def specs() -> dict[str, KernelSpec]:
    return {name: load_spec(path) for name, path in PACKAGES.items()}


@pytest.fixture(scope="module")
def libs(specs, tmp_path_factory) -> dict[str, Path]:
    """CPU baselines and the wrong variants, built with the project's g++ command line."""
    tc = detect_toolchain("cpu")
    if tc is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    out = tmp_path_factory.mktemp("extra-libs")
    sources = {name: (PACKAGES[name] / specs[name].sources["cpu"]).read_text() for name in PACKAGES}
    for variant, (pkg, old, new, _) in WRONG.items():
        assert sources[pkg].count(old) == 1, f"{variant}: the text to break is no longer in {pkg}/kernel.cpp"
        sources[variant] = sources[pkg].replace(old, new)
    libs = {}
    for name, text in sources.items():
        pkg = WRONG[name][0] if name in WRONG else name
        lib = out / f"{name}.so"
        proc = _compile(tc, text, lib, specs[pkg].build["cpu"].flags, ".cpp")
        assert proc.returncode == 0, f"{name} failed to compile:\n{proc.stderr}"
        libs[name] = lib
    return libs


def _request(spec: KernelSpec, dtypes: list[str]) -> ExecRequest:
    ref = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
    return ExecRequest(
        package=PackageRef(spec=spec, files=ref, baseline_sources={}), target="cpu",
        candidate_id=f"{spec.name}-extra", library=ref, shapes=spec.shapes["cpu"].test, dtypes=dtypes,
        seed=4321, timeout_s=120.0,
    )  # fmt: skip


def _reference(path: Path):
    spec = importlib.util.spec_from_file_location(f"ref_{path.name}", path / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_packages_load(specs):
    rms, merge = specs["fused_add_rmsnorm"], specs["merge_attn_states_lse"]
    assert rms.entry == "kopt_fused_add_rmsnorm" and merge.entry == "kopt_merge_attn_states_lse"
    assert [a.name for a in rms.arguments if a.exact] == ["residual"]
    assert [a.name for a in merge.arguments if a.dtype == "float32"] == ["s_a", "s_b", "s_out"]
    for spec in specs.values():
        assert spec.targets == ["cpu", "cuda"] and spec.dtypes == ["float16", "bfloat16"]
        assert {t.target for t in spec.tunables} == {"cpu", "cuda"}


@pytest.mark.parametrize("name", list(PACKAGES))
def test_cpu_baseline_passes(libs, specs, name):
    spec = specs[name]
    result = asyncio.run(runner.run_test(_request(spec, spec.dtypes), libs[name], PACKAGES[name], spec))
    assert result.correct, result.reason
    assert len(result.checks) == len(spec.shapes["cpu"].test) * len(spec.dtypes)
    # fused_add_rmsnorm's generator plants special values: no note that it ignores the keyword
    assert not any("accepts special=True" in n for n in result.notes), result.notes


@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_variant_is_rejected(libs, specs, variant):
    pkg, _, _, names = WRONG[variant]
    result = asyncio.run(runner.run_test(_request(specs[pkg], ["float16"]), libs[variant], PACKAGES[pkg], specs[pkg]))
    assert not result.correct
    assert names in result.reason and "mismatch" in result.reason, result.reason


def test_residual_is_bit_exact(libs):
    """The harness compares with tolerances; the residual must match the reference bit for bit."""
    import torch

    from gpu_worker.abi import Kernel, Packed

    ref = _reference(RMSNORM)
    kernel = Kernel(str(libs["fused_add_rmsnorm"]), "kopt_fused_add_rmsnorm", None)
    for dtype in (torch.float16, torch.bfloat16):
        for dims in ({"T": 3, "H": 13}, {"T": 5, "H": 4099}):
            inputs = ref.make_inputs(dims, dtype, 7, "cpu")
            want = ref.reference({k: v.clone() for k, v in inputs.items()})["residual"]
            x, r = inputs["input"].clone(), inputs["residual"].clone()
            assert kernel(Packed([x, r, inputs["weight"]])) == 0
            assert torch.equal(r.view(torch.int16), want.view(torch.int16)), (dtype, dims)


def test_merge_reference_semantics():
    """Empty states (+-inf) on both sides, one side, and +inf read as -inf; planted on every call."""
    import torch

    ref = _reference(MERGE)
    inf = float("inf")
    v_a = torch.tensor([[[1.0, 2.0]] * 5])
    v_b = torch.tensor([[[3.0, 5.0]] * 5])
    s_a = torch.tensor([[-inf, inf, -inf, 2.0, 0.0]])
    s_b = torch.tensor([[-inf, -inf, 1.0, inf, 0.0]])
    out = ref.reference({"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b})
    assert out["v_out"].tolist() == [[[1.0, 2.0], [1.0, 2.0], [3.0, 5.0], [1.0, 2.0], [2.0, 3.5]]]
    s = out["s_out"][0]
    assert s[:2].tolist() == [-inf, -inf] and s[2:4].tolist() == [1.0, 2.0]
    assert abs(float(s[4]) - float(torch.log(torch.tensor(2.0)))) < 1e-6
    for seed in range(3):
        made = ref.make_inputs({"T": 17, "NH": 8, "D": 4}, torch.float16, seed, "cpu")
        a, b = made["s_a"], made["s_b"]
        assert bool((a == -inf).any() and (a == inf).any() and (b == -inf).any() and (b == inf).any())
        assert bool(((a == -inf) & (b == -inf)).any()) and bool(torch.isfinite(a * b).float().mean() > 0.5)
    made = ref.make_inputs({"T": 1, "NH": 1, "D": 8}, torch.float16, 0, "cpu")
    assert bool(torch.isfinite(made["s_a"]).all() and torch.isfinite(made["s_b"]).all())


CUDA_VARIANTS = {
    "fused_add_rmsnorm": [{}, {"VEC": 2, "THREADS": 1024, "CACHE_ROW": 2, "ROWS_PER_BLOCK": 4}],
    "merge_attn_states_lse": [{}, {"VEC": 4, "THREADS": 512, "PACKS_PER_THREAD": 4}],
}


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("name, index", [(n, i) for n, vs in CUDA_VARIANTS.items() for i in range(len(vs))])
def test_cuda_source_compiles(specs, tmp_path, name, index):
    spec = specs[name]
    tc = detect_toolchain("cuda")
    source = apply_tunables((PACKAGES[name] / spec.sources["cuda"]).read_text(), CUDA_VARIANTS[name][index])
    proc = _compile(tc, source, tmp_path / "kernel.so", spec.build["cuda"].flags, ".cu")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "warning" not in log.lower(), log
    assert "registers" in log
