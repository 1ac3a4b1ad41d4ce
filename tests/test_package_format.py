"""The package format's integer arguments, value ranges and `scale = false` (docs/kernel-packages.md),
on the `rotary` fixture: int64 positions drawn by kopt from their range, a cos/sin table never
rescaled. Each mistake in kernel.toml names its file and field; the harness catches a kernel that
ignores the positions or mishandles the range's edge, and passes an honest one that relies on what
the table means."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from gpu_worker import runner
from kopt.models import ArtifactRef, ExecRequest, KernelSpec, PackageRef
from kopt.package import PackageError, load_spec
from tests.conftest import REPO, compile_all

ROTARY = REPO / "tests" / "fixtures" / "rotary"
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")
SOURCE = (ROTARY / "kernel.cpp").read_text()
# Variants of kernel.cpp: (text to replace, replacement).
VARIANTS = {
    # wrong: the token's index taken for its position
    "index_as_position": ("tab + p[t] * table.strides[0]", "tab + (t % table.shape[0]) * table.strides[0]"),
    # wrong only at the range's top edge (position P - 1 read as 0)
    "edge_wraps": ("tab + p[t] * table.strides[0]", "tab + (p[t] % (table.shape[0] - 1 > 0 ? table.shape[0] - 1 : 1)) "
                   "* table.strides[0]"),
    # right: recomputes the angles the table holds (in double) instead of reading them
    "recomputes_the_table": (
        "const float c = cs[i], s = cs[half + i], a = xi[i], b = xi[half + i];",
        "(void)cs; const double ang = (double)p[t] / std::pow(10000.0, (double)(2 * i) / (double)D);\n"
        "        const float c = (float)std::cos(ang), s = (float)std::sin(ang), a = xi[i], b = xi[half + i];",
    ),
}


def _request(spec: KernelSpec, shapes=None) -> ExecRequest:
    return ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target="cpu",
                       candidate_id="rotary", library=NO_ARTIFACT, shapes=shapes or spec.shapes["cpu"].test,
                       dtypes=["float32"], seed=77, timeout_s=120, time_cap_s=0.3)  # fmt: skip


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("rotary-libs")
    sources = {}
    for name, (old, new) in {"baseline": ("", ""), **VARIANTS}.items():
        assert old in SOURCE, f"{name}: the text to replace is no longer in kernel.cpp"
        text = SOURCE.replace(old, new) if old else SOURCE
        if name == "recomputes_the_table":
            text = "#include <cmath>\n" + text
        sources[name] = out / f"{name}.cpp"
        sources[name].write_text(text)
    return compile_all("cpu", sources, out)


@pytest.fixture
def pkg(tmp_path) -> Path:
    dest = tmp_path / "rotary"
    shutil.copytree(ROTARY, dest)
    return dest


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_integer_arguments_load_with_their_range():
    spec = load_spec(ROTARY)
    by_name = {a.name: a for a in spec.arguments}
    assert by_name["positions"].dtype == "int64" and by_name["positions"].range == ("0", "P")
    assert by_name["cos_sin"].dtype == "float32" and not by_name["cos_sin"].scale
    assert by_name["x"].scale and by_name["x"].range is None


@pytest.mark.parametrize(
    "edit, message",
    [
        (('name = "out"\nrole = "out"', 'name = "out"\nrole = "out"\ndtype = "int32"'),
         "field 'arguments.3.role': an int32 argument must have role 'in'"),
        (('dtype = "float32"\nscale = false', 'dtype = "float32"\nrange = ["0", "2"]'),
         "field 'arguments.2.range': only integer arguments"),
        (('range = ["0", "P"]', 'range = ["0", "Q"]'), "field 'arguments.0.range': unknown symbols ['Q']"),
        (('range = ["0", "P"]', 'range = ["0", "P +"]'), "field 'arguments.0.range': cannot parse"),
        (('range = ["0", "P"]', 'range = ["1", "P"]'), "field 'arguments.0.range': empty at shapes.cpu.test.0"),
        (('name = "out"\nrole = "out"', 'name = "out"\nrole = "out"\nscale = false'),
         "field 'arguments.3.scale': only float inputs are rescaled"),
        (('dtype = "int64"', 'dtype = "int16"'), "field 'arguments.0.dtype'"),
    ],
)
def test_mistakes_in_integer_arguments_name_file_and_field(pkg, edit, message):
    _edit(pkg / "kernel.toml", *edit)
    with pytest.raises(PackageError, match="kernel.toml: " + message.replace("(", r"\(").replace("[", r"\[")):
        load_spec(pkg)


@pytest.mark.slow
def test_kopt_draws_the_positions_and_the_harness_tells_right_from_wrong(libs):
    spec = load_spec(ROTARY)
    results = {name: asyncio.run(runner.run_test(_request(spec), lib, ROTARY, spec)) for name, lib in libs.items()}
    assert results["baseline"].correct, results["baseline"].reason
    # The table is never rescaled (x0.01 and x100 variants included), so a kernel that computes the
    # angles instead of reading them is right.
    assert results["recomputes_the_table"].correct, results["recomputes_the_table"].reason
    assert any(c.variant for c in results["baseline"].variant_checks)
    for wrong in ("index_as_position", "edge_wraps"):
        assert not results[wrong].correct and "out" in (results[wrong].reason or ""), (wrong, results[wrong].reason)


@pytest.mark.slow
def test_a_table_that_is_rescaled_fails_a_kernel_that_relies_on_its_meaning(pkg, libs):
    """The counterpart of scale = false: without it the harness's x100 variant scales the table, and
    the reference (which reads the table) no longer agrees with a kernel that knows what it holds."""
    _edit(pkg / "kernel.toml", "scale = false  ", "scale = true  ")
    spec = load_spec(pkg)
    result = asyncio.run(runner.run_test(_request(spec), libs["recomputes_the_table"], pkg, spec))
    assert not result.correct and any(v in (result.reason or "") for v in ("x100", "x0.01")), result.reason


@pytest.mark.slow
@pytest.mark.serial  # an A/A verdict
def test_timed_calls_keep_integer_inputs_in_range(libs):
    """Profiling perturbs every input between timed calls: integer inputs by elements of another
    input set (so still in range: an index out of range would read outside the table), the
    unscaled table not at all, and the timed outputs are re-checked."""
    spec = load_spec(ROTARY)
    req = _request(spec, spec.shapes["cpu"].bench)
    result = asyncio.run(runner.run_profile(req, libs["baseline"], ROTARY, spec, baseline=libs["baseline"]))
    assert result.ok, result.reason
    assert result.timings and result.ab is not None and result.ab.verdict == "same"
    wrong = asyncio.run(runner.run_profile(req, libs["edge_wraps"], ROTARY, spec, baseline=libs["baseline"]))
    assert not wrong.ok and "out" in (wrong.reason or ""), wrong.reason


@pytest.mark.slow
def test_make_inputs_outside_the_declared_range_is_a_clear_error(pkg, libs):
    _edit(pkg / "reference.py", 'return {"x": x.to(dtype=dtype, device=device),',
          'return {"positions": torch.full((dims["T"],), dims["P"], dtype=torch.int64, device=device),\n'
          '            "x": x.to(dtype=dtype, device=device),')
    spec = load_spec(pkg)
    result = asyncio.run(runner.run_test(_request(spec), libs["baseline"], pkg, spec))
    assert not result.correct
    assert "make_inputs() gave 'positions' values in [1, 1], outside its kernel.toml range [0, 1)" in result.reason


@pytest.mark.slow
def test_a_generator_that_ignores_special_is_named(pkg, libs):
    """make_inputs(special=True) that plants nothing makes the 'special' checks ordinary ones; the
    result says so (one that plants values gets no such note: test_packages_extra)."""
    _edit(pkg / "reference.py", "def make_inputs(dims, dtype, seed, device):",
          "def make_inputs(dims, dtype, seed, device, special=False):")
    spec = load_spec(pkg)
    result = asyncio.run(runner.run_test(_request(spec), libs["baseline"], pkg, spec))
    assert result.correct, result.reason
    assert any(c.variant == "special" for c in result.variant_checks)
    assert any("accepts special=True but returns the same inputs" in n for n in result.notes), result.notes
    plain = asyncio.run(runner.run_test(_request(spec), libs["baseline"], ROTARY, load_spec(ROTARY)))
    assert not any("special" in n for n in plain.notes) and not any(c.variant == "special" for c in plain.variant_checks)
