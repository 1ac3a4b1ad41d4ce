"""Kernel package loading: a valid package loads; each kind of mistake names its file and field."""

from __future__ import annotations

import shutil

import pytest

from kopt.package import PackageError, apply_tunables, load_spec, read_tunables
from tests.conftest import REPO

SILU = REPO / "kernels" / "silu_and_mul"


def test_silu_and_mul_loads():
    spec = load_spec(SILU)
    assert spec.entry == "kopt_silu_and_mul"
    assert [a.name for a in spec.arguments] == ["x", "out"]
    assert {t.name for t in spec.tunables_for("cuda")} == {"VEC", "THREADS", "BLOCKS_PER_ROW"}
    assert spec.shapes["cuda"].bench[0].dims == {"T": 512, "D": 14336}


@pytest.fixture
def pkg(tmp_path):
    dest = tmp_path / "pkg"
    shutil.copytree(SILU, dest)
    return dest


def _edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    "edit, message",
    [
        (("entry = ", "entry = = "), "kernel.toml: not valid TOML"),
        (('entry = "kopt_silu_and_mul"\n', ""), "field 'entry'"),
        (('role = "in"', 'role = "input"'), "field 'arguments.0.role'"),
        (('cuda = "kernel.cu"', 'cuda = "missing.cu"'), "field 'sources.cuda'"),
        (('bytes = "T*2*D*elem + T*D*elem"', 'bytes = "T*2*Q"'), "field 'model.bytes'"),
        (("{ T = 3, D = 13 },", "{ T = 3 },"), "field 'shapes.cpu.test.1'"),
        (("values = [128, 256, 512, 1024]", "values = [128, 512]"), "field 'tunables.THREADS.values'"),
    ],
)
def test_bad_kernel_toml_names_file_and_field(pkg, edit, message):
    _edit(pkg / "kernel.toml", *edit)
    with pytest.raises(PackageError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_spec(pkg)


def test_missing_folder_and_reference(tmp_path, pkg):
    with pytest.raises(PackageError, match="kernel package folder not found"):
        load_spec(tmp_path / "nope")
    (pkg / "reference.py").unlink()
    with pytest.raises(PackageError, match="reference.py: missing"):
        load_spec(pkg)


def test_tunable_define_missing_in_source(pkg):
    _edit(pkg / "kernel.cu", "#define THREADS", "#define THREADZ")
    with pytest.raises(PackageError, match=r"kernel.cu: tunable THREADS"):
        load_spec(pkg)


def test_apply_tunables_rewrites_only_the_define():
    src = "#define VEC 8\n#define VEC2 3\nint x = VEC;\n"
    out = apply_tunables(src, {"VEC": 4})
    assert out == "#define VEC 4\n#define VEC2 3\nint x = VEC;\n"
    assert read_tunables(out, ["VEC", "VEC2"]) == {"VEC": 4, "VEC2": 3}
    with pytest.raises(PackageError):
        apply_tunables(src, {"NOPE": 1})
