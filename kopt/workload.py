"""Workloads: the shapes a model really calls a kernel at, with how often (docs/kernel-packages.md,
Workloads). With a workload the optimizer times the workload's shapes and maximises the
workload-weighted time (baseline time / candidate time, each shape counted by its weight) instead
of the geomean over the package's bench shapes.

Two file forms, both turned into weighted shapes by `load_workload`:

- TOML, `[[shape]]` entries with a `weight` (any positive number: counts are fine) and a value for
  every shape symbol; a symbol may be a range `{ from = 1, to = 64, points = 4 }`, sampled at
  `points` log-spaced integers that share the entry's weight (a family: decode at 1-64 tokens);
- CSV with a header naming every shape symbol and a `count` (or `weight`) column: one row per
  shape, as `kopt workload from-trace` writes it from a torch profiler trace.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tomllib
from collections import Counter
from pathlib import Path

from kopt import expr
from kopt.models import KernelSpec, Shape
from kopt.package import empty_range, shape_symbols


class WorkloadError(ValueError):
    """A workload file is invalid; the message names the file and the entry."""


def load_workload(path: str | Path, spec: KernelSpec) -> list[Shape]:
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: workload file not found")
    text = path.read_text()
    rows = _csv_rows(path, text) if path.suffix.lower() == ".csv" else _toml_rows(path, text)
    need = set(shape_symbols(spec))
    merged: dict[tuple, float] = {}
    for where, dims, weight in rows:
        missing, extra = need - set(dims), set(dims) - need
        if missing or extra:
            raise WorkloadError(f"{path}: {where}: " + (f"missing symbols {sorted(missing)}" if missing else
                                                        f"unknown symbols {sorted(extra)}")
                                + f" (the package's shape symbols are {sorted(need)})")  # fmt: skip
        if any(v < 1 for v in dims.values()):
            raise WorkloadError(f"{path}: {where}: every symbol must be >= 1, got {dims}")
        empty = empty_range(spec, dims)
        if empty is not None:
            raise WorkloadError(f"{path}: {where}: argument {empty.name!r} has an empty range at {dims}")
        key = tuple((k, dims[k]) for k in sorted(dims))
        merged[key] = merged.get(key, 0.0) + weight
    if not merged:
        raise WorkloadError(f"{path}: no shapes")
    total = sum(merged.values())
    return [Shape(dims=dict(k), weight=w / total) for k, w in sorted(merged.items(), key=lambda kv: -kv[1])]


def _toml_rows(path: Path, text: str) -> list[tuple[str, dict[str, int], float]]:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML: {exc}") from None
    entries = raw.get("shape")
    if not isinstance(entries, list) or not entries:
        raise WorkloadError(f"{path}: no [[shape]] entries")
    rows = []
    for i, entry in enumerate(entries):
        where = f"shape {i + 1}"
        weight = entry.get("weight")
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise WorkloadError(f"{path}: {where}: 'weight' must be a positive number")
        fixed, ranges = {}, {}
        for name, value in entry.items():
            if name == "weight":
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                fixed[name] = value
            elif isinstance(value, dict) and set(value) <= {"from", "to", "points"} and {"from", "to"} <= set(value):
                ranges[name] = _points(path, f"{where}: {name}", value)
            else:
                raise WorkloadError(f"{path}: {where}: {name} must be an integer or {{ from = A, to = B, points = N }}")
        combos = [dict(fixed)]
        for name, values in ranges.items():
            combos = [{**c, name: v} for c in combos for v in values]
        rows += [(where, c, weight / len(combos)) for c in combos]
    return rows


def _points(path: Path, where: str, spec: dict) -> list[int]:
    lo, hi, n = spec["from"], spec["to"], spec.get("points", 4)
    if not all(isinstance(v, int) for v in (lo, hi, n)) or not 1 <= lo <= hi or n < 1:
        raise WorkloadError(f"{path}: {where}: a range needs integers 1 <= from <= to and points >= 1")
    if n == 1 or lo == hi:
        return [lo] if lo == hi or n == 1 else [lo, hi]
    values = [round(math.exp(math.log(lo) + k * (math.log(hi) - math.log(lo)) / (n - 1))) for k in range(n)]
    return sorted(set(values))


def _csv_rows(path: Path, text: str) -> list[tuple[str, dict[str, int], float]]:
    reader = csv.DictReader(io.StringIO(text))
    fields = reader.fieldnames or []
    count = "count" if "count" in fields else "weight" if "weight" in fields else None
    if count is None:
        raise WorkloadError(f"{path}: the header needs a 'count' (or 'weight') column; it has {fields}")
    rows = []
    for i, row in enumerate(reader):
        where = f"row {i + 2}"
        try:
            weight = float(row[count])
            dims = {k: int(v) for k, v in row.items() if k != count}
        except (TypeError, ValueError):
            raise WorkloadError(f"{path}: {where}: every value must be a number, got {row}") from None
        if weight <= 0:
            continue
        rows.append((where, dims, weight))
    return rows


# ---------------------------------------------------------------- from a torch profiler trace


def shapes_from_trace(trace: str | Path, op: str, spec: KernelSpec) -> Counter:
    """Count the calls of `op` in a torch profiler trace (chrome JSON, recorded with
    record_shapes=True) by shape: each call's "Input Dims" are matched to the package's arguments in
    kernel.toml order, and the shape symbols solved from them (a dimension written as a symbol gives
    it; one written as an expression of a single unknown symbol, e.g. 2*D, is solved for it)."""
    try:
        data = json.loads(Path(trace).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"{trace}: not a readable chrome trace: {exc}") from None
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    counts: Counter = Counter()
    seen_names: set[str] = set()
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") not in ("X", None):
            continue
        name = ev.get("name", "")
        seen_names.add(name)
        if name != op:
            continue
        dims_list = (ev.get("args") or {}).get("Input Dims")
        if dims_list is None:
            raise WorkloadError(f"{trace}: {op} events carry no 'Input Dims': record the trace with "
                                f"torch.profiler.profile(record_shapes=True)")  # fmt: skip
        dims = solve(spec, [d for d in dims_list if d != []][: len(spec.arguments)])
        if dims is None:
            raise WorkloadError(f"{trace}: a call of {op} with input dims {dims_list} does not match the package's "
                                f"arguments {[f'{a.name}{a.shape}' for a in spec.arguments]}")  # fmt: skip
        counts[tuple(sorted(dims.items()))] += 1
    if not counts:
        close = sorted(n for n in seen_names if op.split("::")[-1] in n)[:5]
        raise WorkloadError(f"{trace}: no calls of {op!r}" + (f"; similar names: {close}" if close else ""))
    return counts


def solve(spec: KernelSpec, dims_list: list[list[int]]) -> dict[str, int] | None:
    if len(dims_list) != len(spec.arguments):
        return None
    pairs = [(d, v) for arg, dims in zip(spec.arguments, dims_list) if len(dims) == len(arg.shape)
             for d, v in zip(arg.shape, dims)]  # fmt: skip
    if len(pairs) != sum(len(a.shape) for a in spec.arguments):
        return None
    known: dict[str, int] = {}
    for _ in range(len(pairs) + 1):
        for d, v in pairs:
            unknown = expr.names(d) - set(known)
            if len(unknown) != 1:
                continue
            (name,) = unknown
            f1, f2 = expr.evaluate(d, {**known, name: 1}), expr.evaluate(d, {**known, name: 2})
            if f2 == f1:
                continue
            x = (v - f1) / (f2 - f1) + 1  # linear in the symbol
            if x >= 1 and abs(x - round(x)) < 1e-9:
                known[name] = int(round(x))
    if set(known) != set(shape_symbols(spec)):
        return None
    return known if all(expr.evaluate(d, known) == v for d, v in pairs) else None


def write_csv(counts: Counter, spec: KernelSpec, out: str | Path) -> Path:
    names = shape_symbols(spec)
    lines = [",".join([*names, "count"])]
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        dims = dict(key)
        lines.append(",".join([*(str(dims[k]) for k in names), str(n)]))
    Path(out).write_text("\n".join(lines) + "\n")
    return Path(out)
