"""Load and validate a kernel package folder (kernel.toml, sources, reference.py).

Every error names the file and the field to fix: a user's first contact with kopt is often a
package that is not quite right.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pydantic import ValidationError

from kopt import expr
from kopt.models import Argument, KernelSpec, Target

TUNABLE_LINE = r"^[ \t]*#define[ \t]+{name}[ \t]+(-?\d+)\b"


class PackageError(ValueError):
    """A kernel package is invalid; the message says which file and field."""


def load_spec(kernel_dir: str | Path) -> KernelSpec:
    root = Path(kernel_dir)
    if not root.is_dir():
        raise PackageError(f"{root}: kernel package folder not found")
    toml_path = root / "kernel.toml"
    if not toml_path.is_file():
        raise PackageError(f"{toml_path}: missing (every kernel package needs a kernel.toml)")
    try:
        raw = tomllib.loads(toml_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PackageError(f"{toml_path}: not valid TOML: {exc}") from None
    raw.setdefault("shapes", {})
    try:
        spec = KernelSpec.model_validate(_normalise_shapes(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise PackageError(f"{toml_path}: field '{field}': {err['msg']}") from None
    _check_semantics(root, toml_path, spec)
    return spec


def source_path(kernel_dir: str | Path, spec: KernelSpec, target: Target) -> Path:
    return Path(kernel_dir) / spec.sources[target]


def read_tunables(source: str, names: list[str]) -> dict[str, int]:
    """Current values of the tunable `#define`s in a source text."""
    values = {}
    for name in names:
        found = re.findall(TUNABLE_LINE.format(name=re.escape(name)), source, flags=re.M)
        if len(found) != 1:
            raise PackageError(f"tunable {name}: expected exactly one '#define {name} <int>' line, found {len(found)}")
        values[name] = int(found[0])
    return values


def apply_tunables(source: str, values: dict[str, int]) -> str:
    """Rewrite the tunable `#define` lines of a source text to the given values."""
    for name, value in values.items():
        pattern = re.compile(TUNABLE_LINE.format(name=re.escape(name)), flags=re.M)
        source, count = pattern.subn(lambda m, v=value: m.group(0).replace(m.group(1), str(v)), source)
        if count != 1:
            raise PackageError(f"tunable {name}: expected exactly one '#define {name} <int>' line, found {count}")
    return source


def _normalise_shapes(raw: dict) -> dict:
    """kernel.toml writes shapes as inline tables of dims; the model wraps them as {dims: ...}."""
    shapes = {}
    for target, sets in raw.get("shapes", {}).items():
        if not isinstance(sets, dict):
            shapes[target] = sets
            continue
        shapes[target] = {
            key: [{"dims": s} if isinstance(s, dict) else s for s in value] if isinstance(value, list) else value
            for key, value in sets.items()
        }
    return {**raw, "shapes": shapes}


def is_integer(arg: Argument) -> bool:
    return arg.dtype in ("int32", "int64")


def shape_symbols(spec: KernelSpec) -> list[str]:
    """Shape symbols in order of first appearance in the argument list."""
    out: list[str] = []
    for arg in spec.arguments:
        for dim in arg.shape:
            out += [name for name in sorted(expr.names(dim)) if name not in out]
    return out


def value_range(arg: Argument, dims: dict[str, int]) -> tuple[int, int]:
    """An integer argument's [low, high) at a shape (kernel.toml `range`)."""
    assert arg.range is not None
    return int(expr.evaluate(arg.range[0], dims)), int(expr.evaluate(arg.range[1], dims))


def empty_range(spec: KernelSpec, dims: dict[str, int]) -> Argument | None:
    """The first argument whose value range holds no value at this shape, if any."""
    for arg in spec.arguments:
        if arg.range is not None:
            low, high = value_range(arg, dims)
            if low >= high:
                return arg
    return None


def _check_argument(toml_path: Path, field: str, arg: Argument, symbols: set[str]) -> None:
    """Integer arguments are inputs (indices, positions) with an optional value range; `scale` is
    for float inputs."""
    if is_integer(arg) and arg.role != "in":
        raise PackageError(f"{toml_path}: field '{field}.role': an {arg.dtype} argument must have role 'in' "
                           f"(outputs are floating point)")  # fmt: skip
    if arg.range is not None:
        if not is_integer(arg):
            raise PackageError(f"{toml_path}: field '{field}.range': only integer arguments (int32, int64) take a "
                               f"range; this one is {arg.dtype or 'of the run dtype'}")  # fmt: skip
        for bound in arg.range:
            try:
                unknown = expr.names(bound) - symbols
            except expr.ExprError as exc:
                raise PackageError(f"{toml_path}: field '{field}.range': {exc}") from None
            if unknown:
                raise PackageError(f"{toml_path}: field '{field}.range': unknown symbols {sorted(unknown)} "
                                   f"(a bound may use the shape symbols {sorted(symbols)})")  # fmt: skip
    if not arg.scale and (arg.role == "out" or is_integer(arg)):
        raise PackageError(f"{toml_path}: field '{field}.scale': only float inputs are rescaled; "
                           f"remove 'scale = false' here")  # fmt: skip


def plain_dimension(spec: KernelSpec, symbol: str) -> tuple[int, int] | None:
    """(argument index, dimension index) of the first dimension that is exactly `symbol`, if any."""
    for i, arg in enumerate(spec.arguments):
        for j, dim in enumerate(arg.shape):
            if dim.strip() == symbol:
                return i, j
    return None


def _check_dispatch(toml_path: Path, spec: KernelSpec, target: str, dispatch) -> None:
    field = f"dispatch.{target}"
    if target not in spec.targets:
        raise PackageError(f"{toml_path}: field '{field}': target '{target}' is not in 'targets'")
    if plain_dimension(spec, dispatch.symbol) is None:
        raise PackageError(f"{toml_path}: field '{field}.symbol': no argument has a dimension that is exactly "
                           f"{dispatch.symbol!r} (the library reads the value from the call's shapes)")  # fmt: skip
    edges = dispatch.edges
    if edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise PackageError(f"{toml_path}: field '{field}.edges': must be ascending integers >= 1, got {edges}")
    if not spec.tunables_for(target):  # type: ignore[arg-type]
        raise PackageError(f"{toml_path}: field '{field}': target '{target}' has no tunables to specialize")


def _check_ranges(toml_path: Path, spec: KernelSpec, symbols: set[str]) -> None:
    """[ranges] and [sizes]: known symbols, 0 <= min <= max, every size and declared shape inside them."""
    for sym, (low, high) in spec.ranges.items():
        if sym not in symbols:
            raise PackageError(f"{toml_path}: field 'ranges.{sym}': not a shape symbol (the symbols are "
                               f"{sorted(symbols)})")  # fmt: skip
        if not 0 <= low <= high:
            raise PackageError(f"{toml_path}: field 'ranges.{sym}': want [min, max] with 0 <= min <= max, "
                               f"got [{low}, {high}]")  # fmt: skip
    for sym, values in spec.sizes.items():
        if sym not in symbols:
            raise PackageError(f"{toml_path}: field 'sizes.{sym}': not a shape symbol (the symbols are "
                               f"{sorted(symbols)})")  # fmt: skip
        low, high = spec.ranges.get(sym, (1, None))
        outside = [v for v in values if v < low or (high is not None and v > high)]
        if outside:
            raise PackageError(f"{toml_path}: field 'sizes.{sym}': {outside} outside ranges.{sym} [{low}, {high}]")
    for target, sets in spec.shapes.items():
        for kind in ("test", "bench", "holdout"):
            for j, shape in enumerate(getattr(sets, kind)):
                for sym, (low, high) in spec.ranges.items():
                    if not low <= shape.dims.get(sym, low) <= high:
                        raise PackageError(f"{toml_path}: field 'shapes.{target}.{kind}.{j}': {sym}="
                                           f"{shape.dims[sym]} is outside ranges.{sym} [{low}, {high}]")  # fmt: skip


def symbol_range(spec: KernelSpec, symbol: str, target: str) -> tuple[int, int]:
    """[min, max] a caller may give `symbol`: kernel.toml's [ranges], else [1, the largest value any
    declared shape of the target gives it]."""
    if symbol in spec.ranges:
        return spec.ranges[symbol]
    sets = spec.shapes.get(target)  # type: ignore[call-overload]
    declared = [s.dims[symbol] for kind in ("test", "bench", "holdout") for s in (getattr(sets, kind) if sets else [])
                if symbol in s.dims]  # fmt: skip
    return 1, max(declared, default=1)


def _check_workload(root: Path, toml_path: Path, spec: KernelSpec, target: str, name: str) -> None:
    """The file is there, in the package; its entries are read (and checked) by kopt.workload when a
    run takes it (frontend/runs.serving_workload)."""
    field = f"field 'workloads.{target}'"
    if target not in spec.targets:
        raise PackageError(f"{toml_path}: {field}: target '{target}' is not declared in targets")
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()):
        raise PackageError(f"{toml_path}: {field}: {name!r} is outside the package folder")
    if not path.is_file():
        raise PackageError(f"{toml_path}: {field}: workload file {path} not found")


def _check_semantics(root: Path, toml_path: Path, spec: KernelSpec) -> None:
    symbols: set[str] = set()
    for i, arg in enumerate(spec.arguments):
        for dim in arg.shape:
            try:
                symbols |= expr.names(dim)
            except expr.ExprError as exc:
                raise PackageError(f"{toml_path}: field 'arguments.{i}.shape': {exc}") from None
    if not any(a.role in ("out", "inout") for a in spec.arguments):
        raise PackageError(f"{toml_path}: field 'arguments': no argument has role 'out' or 'inout'")
    for i, arg in enumerate(spec.arguments):
        _check_argument(toml_path, f"arguments.{i}", arg, symbols)
    try:
        unknown = expr.names(spec.model.bytes) - symbols - {"elem"}
    except expr.ExprError as exc:
        raise PackageError(f"{toml_path}: field 'model.bytes': {exc}") from None
    if unknown:
        raise PackageError(f"{toml_path}: field 'model.bytes': unknown symbols {sorted(unknown)}")
    for target in spec.targets:
        if target not in spec.sources:
            raise PackageError(f"{toml_path}: field 'sources.{target}': target '{target}' is declared but has no source")
        src = root / spec.sources[target]
        if not src.is_file():
            raise PackageError(f"{toml_path}: field 'sources.{target}': file {src} not found")
        if target not in spec.shapes:
            raise PackageError(f"{toml_path}: field 'shapes.{target}': no test/bench shapes for target '{target}'")
        for kind in ("test", "bench", "holdout"):
            shapes = getattr(spec.shapes[target], kind)
            if not shapes and kind != "holdout":
                raise PackageError(f"{toml_path}: field 'shapes.{target}.{kind}': empty")
            for j, shape in enumerate(shapes):
                missing = symbols - set(shape.dims)
                if missing:
                    raise PackageError(
                        f"{toml_path}: field 'shapes.{target}.{kind}.{j}': missing symbols {sorted(missing)}"
                    )
                empty = empty_range(spec, shape.dims)
                if empty is not None:
                    raise PackageError(f"{toml_path}: field 'arguments.{spec.arguments.index(empty)}.range': empty at "
                                       f"shapes.{target}.{kind}.{j} ({shape.label})")  # fmt: skip
        text = src.read_text()
        for tunable in spec.tunables_for(target):
            try:
                current = read_tunables(text, [tunable.name])[tunable.name]
            except PackageError as exc:
                raise PackageError(f"{src}: {exc}") from None
            if current not in tunable.values:
                raise PackageError(
                    f"{toml_path}: field 'tunables.{tunable.name}.values': the source's value {current} is not listed"
                )
    for target, dispatch in spec.dispatch.items():
        _check_dispatch(toml_path, spec, target, dispatch)
    _check_ranges(toml_path, spec, symbols)
    for target, name in spec.workloads.items():
        _check_workload(root, toml_path, spec, target, name)
    if not (root / "reference.py").is_file():
        raise PackageError(f"{root / 'reference.py'}: missing (the PyTorch reference and input generator)")
