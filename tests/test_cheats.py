"""The cheat corpus (tests/cheats/): every known cheat is rejected, for the right reason.

Each cheat source says what it does and what must catch it in its header:
  // cheat:   what it does (docs/measurement.md's table of known cheats, plus crashes and hangs)
  // expect:  substrings of the rejection reason, alternatives separated by " | "
  // layer:   runtime (test mode), profile (profile mode), static (source/library checks only) or ab
  //          (profile mode against the package baseline: whatever it does, it must not come out
  //          "faster"; expect is then "not faster"), or sanitizer (CUDA test mode with
  //          compute-sanitizer, the full runner.run_test: what only the tool can see), or fault
  //          (an access outside its buffers: the full runner.run_test, which names the argument), or
//          library (the compiled library's checks: runner.static_check, which also reads the source)
  // static:  (optional) what the static checks also say about it
  // package: (optional) scale2; default silu_and_mul
  // timing:  (optional) the profile's timing mode (graph, cold); default auto
  // large:   (optional) yes: the test job checks the large shape, as the gates (kopt evaluate, verify) do
Runtime cheats run through the harness alone (no static checks), so each test shows that the
runtime layer catches its cheat by itself. CPU cheats run here; CUDA ones on a GPU (marker gpu).
The package baselines must pass the same calibrated checks: no false rejections.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_worker import plan, runner, static_checks
from kopt.models import ArtifactRef, ExecRequest, KernelSpec, PackageRef
from kopt.package import load_spec
from tests.conftest import compile_all

# Cheats must gain nothing against the baseline: A/B verdicts between near-equal kernels, run alone.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parent.parent
CHEATS = Path(__file__).resolve().parent / "cheats"
PACKAGES = {"silu_and_mul": ROOT / "kernels" / "silu_and_mul", "scale2": Path(__file__).parent / "fixtures" / "scale2",
            "merge_attn_states_lse": ROOT / "kernels" / "merge_attn_states_lse",
            "fused_add_rmsnorm": ROOT / "kernels" / "fused_add_rmsnorm"}
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
HANG_TIMEOUT_S = 6.0
PARALLEL = 2  # CI has 2 cores; each harness child is one busy process


@dataclass(frozen=True)
class Cheat:
    name: str
    path: Path
    target: str
    package: str
    expect: tuple[str, ...]
    layer: str
    static: str | None
    timing: str = "auto"
    large: bool = False

    @property
    def source(self) -> str:
        return self.path.read_text()


def _header(text: str, key: str) -> str | None:
    m = re.search(rf"^// {key}: (.+)$", text, flags=re.M)
    return m.group(1).strip() if m else None


def load_cheats(target: str) -> list[Cheat]:
    out = []
    for path in sorted((CHEATS / target).glob("*.c*")):
        text = path.read_text()
        out.append(Cheat(
            name=path.stem, path=path, target=target, package=_header(text, "package") or "silu_and_mul",
            expect=tuple(e.strip() for e in _header(text, "expect").split("|")), layer=_header(text, "layer"),
            static=_header(text, "static"), timing=_header(text, "timing") or "auto",
            large=_header(text, "large") == "yes",
        ))  # fmt: skip
    return out


CPU_CHEATS = load_cheats("cpu")
CUDA_CHEATS = load_cheats("cuda")
ALL = CPU_CHEATS + CUDA_CHEATS


def request(spec: KernelSpec, target: str, kind: str, timeout_s: float = 120.0, **extra) -> ExecRequest:
    return ExecRequest(
        package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target=target,
        candidate_id="cheat", library=NO_ARTIFACT, shapes=getattr(spec.shapes[target], kind), dtypes=spec.dtypes,
        seed=7, timeout_s=timeout_s, time_cap_s=0.3, **extra,
    )  # fmt: skip


async def run_cheat(cheat: Cheat, lib: Path, baseline: Path, target: str, sem: asyncio.Semaphore):
    pkg = PACKAGES[cheat.package]
    spec = load_spec(pkg)
    mode = "profile" if cheat.layer in ("profile", "ab") else "test"
    timeout = HANG_TIMEOUT_S if cheat.name == "hang" else 120.0
    req = request(spec, target, "bench" if mode == "profile" else "test", timeout, timing_mode=cheat.timing,
                  large_shapes=cheat.large)
    async with sem:
        if cheat.layer == "fault":
            return await runner.run_test(req.model_copy(update={"source": cheat.source}), lib, pkg, spec,
                                         baseline=baseline)  # fmt: skip
        return await runner.run_harness(mode, req, lib, pkg, spec, baseline=baseline)


# ---------------------------------------------------------------- static layer (no compiler needed)


@pytest.mark.parametrize("cheat", [c for c in ALL if c.layer == "static" or c.static], ids=lambda c: c.path.name)
def test_static_checks_flag_the_cheat(cheat):
    want = cheat.expect if cheat.layer == "static" else (cheat.static,)
    violations = static_checks.check_source(cheat.source, cheat.target)
    assert any(w in v for v in violations for w in want), violations


@pytest.mark.parametrize("name", ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"])
def test_static_checks_pass_the_baselines(name):
    pkg = ROOT / "kernels" / name
    for target, file in (("cpu", "kernel.cpp"), ("cuda", "kernel.cu")):
        assert static_checks.check_source((pkg / file).read_text(), target) == []


# ---------------------------------------------------------------- CPU: compiled and run here


@pytest.fixture(scope="session")
def cpu_libs(tmp_path_factory) -> dict[str, Path]:
    sources = {c.name: c.path for c in CPU_CHEATS}
    sources |= {f"baseline_{k}": v / "kernel.cpp" for k, v in PACKAGES.items()}
    return compile_all("cpu", sources, tmp_path_factory.mktemp("cheats-cpu"))


@pytest.fixture(scope="session")
def cpu_outcomes(cpu_libs) -> dict[str, object]:
    """Every CPU cheat through the harness, PARALLEL at a time; plus the controls."""

    async def main():
        sem = asyncio.Semaphore(PARALLEL)
        runtime = [c for c in CPU_CHEATS if c.layer not in ("static", "library")]
        jobs = {c.name: run_cheat(c, cpu_libs[c.name], cpu_libs[f"baseline_{c.package}"], "cpu", sem)
                for c in runtime}  # fmt: skip
        # Control: the calibrated bound, not the package tolerance, is what catches low_bits.
        low_bits = next(c for c in CPU_CHEATS if c.name == "scale2_low_bits")
        spec = load_spec(PACKAGES["scale2"])

        async def uncalibrated():
            async with sem:
                return await runner.run_harness("test", request(spec, "cpu", "test"), cpu_libs[low_bits.name],
                                                PACKAGES["scale2"], spec)  # fmt: skip

        async def baseline_accepted():
            silu = load_spec(PACKAGES["silu_and_mul"])
            lib = cpu_libs["baseline_silu_and_mul"]
            async with sem:
                return await runner.run_test(request(silu, "cpu", "test", source=(PACKAGES["silu_and_mul"] /
                                             "kernel.cpp").read_text()), lib, PACKAGES["silu_and_mul"], silu,
                                             baseline=lib)  # fmt: skip

        jobs["control:low_bits_uncalibrated"] = uncalibrated()
        jobs["control:silu_baseline"] = baseline_accepted()
        names = list(jobs)
        results = await asyncio.gather(*jobs.values())
        return dict(zip(names, results))

    return asyncio.run(main())


@pytest.mark.parametrize("cheat", [c for c in CPU_CHEATS if c.layer == "ab"], ids=lambda c: c.name)
def test_cpu_cheat_gains_nothing_against_the_baseline(cpu_outcomes, cheat):
    result = cpu_outcomes[cheat.name]
    assert result.ab is not None or not result.ok, result
    if result.ok:
        assert result.ab.verdict != "faster" and result.ab.speedup_geomean < 1.5, result.ab


@pytest.mark.parametrize("cheat", [c for c in CPU_CHEATS if c.layer not in ("static", "ab", "library")],
                         ids=lambda c: c.name)  # fmt: skip
def test_cpu_cheat_is_rejected(cpu_outcomes, cheat):
    result = cpu_outcomes[cheat.name]
    ok = result.correct if cheat.layer != "profile" else result.ok
    assert not ok, f"{cheat.name} was accepted"
    assert any(e in result.reason for e in cheat.expect), result.reason


@pytest.mark.parametrize("cheat", [c for c in CPU_CHEATS if c.static or c.layer in ("static", "library")],
                         ids=lambda c: c.name)  # fmt: skip
def test_cpu_cheat_library_or_source_is_flagged_before_running(cpu_libs, cheat):
    violations, _ = runner.static_check(cheat.source, cpu_libs[cheat.name], "cpu")
    assert violations
    if cheat.layer == "library":
        assert any(e in v for v in violations for e in cheat.expect), violations


def test_low_bits_passes_the_package_tolerance_alone(cpu_outcomes):
    assert cpu_outcomes["control:low_bits_uncalibrated"].correct


def test_silu_baseline_passes_its_own_calibrated_checks(cpu_outcomes):
    result = cpu_outcomes["control:silu_baseline"]
    assert result.correct, result.reason
    assert not result.static_violations
    checks = result.checks + result.variant_checks
    planted = {f"planted:{k}" for k in plan.PLANTED_KINDS}
    fills = {f"fill:{f}" for f in plan.OUTPUT_FILLS}
    layouts = {f"layout:{lay}" for lay in plan.LAYOUTS + plan.EDGE_LAYOUTS if lay not in plan.LAYOUTS_3D}  # silu: 2-D
    fpenv = {plan.FPENV + m for m in plan.FP_ENVS if plan.FPENV_APPLIES}  # CPU, x86-64
    assert {c.variant for c in result.variant_checks} == {"x0.01", "x100", "edge", "strided", "special", "fuzz",
                                                          "size", "residue", "update", "repeat", "burst", *planted,
                                                          *fills, *layouts, "dtype:float32", "far:x", "far:out",
                                                          *fpenv, plan.BATCHED}  # fmt: skip
    # The layouts this baseline refuses (its rows must be dense, its inner stride 1) and the rank above the
    # declared one: not applicable; every other check ran.
    skipped = {c.variant for c in result.variant_checks if c.skipped}
    refused = {"layout:transposed", *(f"layout:{lay}" for lay in plan.EDGE_LAYOUTS), plan.BATCHED}
    assert skipped <= refused, [c.key for c in result.variant_checks if c.skipped]
    calibrated = [c for c in checks if c.error_bound is not None]
    assert calibrated and all(c.max_abs_err <= c.error_bound for c in calibrated)


# ---------------------------------------------------------------- CUDA: on a GPU machine


@pytest.fixture(scope="session")
def cuda_libs(tmp_path_factory) -> dict[str, Path]:
    sources = {c.name: c.path for c in CUDA_CHEATS if c.layer != "static"}
    sources |= {f"baseline_{k}": v / "kernel.cu" for k, v in PACKAGES.items() if (v / "kernel.cu").is_file()}
    return compile_all("cuda", sources, tmp_path_factory.mktemp("cheats-cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("cheat", [c for c in CUDA_CHEATS if c.layer == "ab"], ids=lambda c: c.name)
def test_cuda_cheat_gains_nothing_against_the_baseline(cuda_libs, cheat):
    result = asyncio.run(run_cheat(cheat, cuda_libs[cheat.name], cuda_libs[f"baseline_{cheat.package}"], "cuda",
                                   asyncio.Semaphore(1)))  # fmt: skip
    assert result.ab is not None or not result.ok, result
    if result.ok:
        assert result.ab.verdict != "faster" and result.ab.speedup_geomean < 1.5, result.ab


@pytest.mark.gpu
@pytest.mark.parametrize("cheat", [c for c in CUDA_CHEATS if c.layer not in ("static", "ab", "sanitizer")],
                         ids=lambda c: c.name)  # fmt: skip
def test_cuda_cheat_is_rejected(cuda_libs, cheat):
    result = asyncio.run(run_cheat(cheat, cuda_libs[cheat.name], cuda_libs[f"baseline_{cheat.package}"], "cuda",
                                   asyncio.Semaphore(1)))  # fmt: skip
    ok = result.correct if cheat.layer != "profile" else result.ok
    assert not ok, f"{cheat.name} was accepted"
    assert any(e in result.reason for e in cheat.expect), result.reason


@pytest.mark.gpu
def test_cuda_baseline_is_accepted_and_ab_against_itself_is_even(cuda_libs):
    pkg = PACKAGES["silu_and_mul"]
    spec = load_spec(pkg)
    lib = cuda_libs["baseline_silu_and_mul"]
    source = (pkg / "kernel.cu").read_text()
    tested = asyncio.run(runner.run_test(request(spec, "cuda", "test", source=source), lib, pkg, spec, baseline=lib))
    assert tested.correct, tested.reason
    assert "memcheck: clean" in tested.sanitizer, tested.sanitizer
    profiled = asyncio.run(runner.run_profile(request(spec, "cuda", "bench"), lib, pkg, spec, baseline=lib))
    assert profiled.ok, profiled.reason
    assert profiled.ab is not None and profiled.ab.ci_low <= 1.03 and profiled.ab.ci_high >= 0.97, profiled.ab
    for t in profiled.timings:
        assert t.mode in ("cold", "graph") and 10 < t.pct_sol < 110, t


@pytest.mark.gpu
@pytest.mark.parametrize("cheat", [c for c in CUDA_CHEATS if c.layer == "sanitizer"], ids=lambda c: c.name)
def test_cuda_cheat_only_the_sanitizer_sees_is_rejected(cuda_libs, cheat):
    """Right outputs, no fault, an invalid access or a race all the same: the harness alone accepts it,
    the test step (compute-sanitizer memcheck or racecheck on the kernel host) rejects it."""
    pkg = PACKAGES[cheat.package]
    spec = load_spec(pkg)
    alone = asyncio.run(run_cheat(cheat, cuda_libs[cheat.name], cuda_libs[f"baseline_{cheat.package}"], "cuda",
                                  asyncio.Semaphore(1)))  # fmt: skip
    assert alone.correct, alone.reason
    tested = asyncio.run(runner.run_test(request(spec, "cuda", "test", source=cheat.source), cuda_libs[cheat.name],
                                         pkg, spec, baseline=cuda_libs[f"baseline_{cheat.package}"]))  # fmt: skip
    assert not tested.correct and any(e in tested.reason for e in cheat.expect), tested.reason
