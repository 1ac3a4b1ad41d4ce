"""Shape-specialized libraries (docs/decisions/0023-shape-specialized-dispatch.md).

A package may declare shape buckets for a target (kernel.toml `[dispatch.<target>]`: a shape
symbol and ascending edges). After the search, the optimizer picks for each bucket the tunable
values of the measured candidate that was fastest on that bucket's timed shapes, and builds one
library from the best's source:

- the source's `#include` lines are hoisted to the top (every allowed header is include-guarded),
- one copy of the rest per distinct setting, each in a namespace `kopt_bucket<k>`, its tunable
  `#define`s rewritten, every macro the source defines `#undef`'d before it, and its entry point
  renamed in the text to `<entry>_bucket<k>` (not by a macro, which the source could test for),
- an entry point of the package's name that reads the symbol from the call's shapes and calls
  the copy of its bucket (a call whose shapes do not even have that dimension goes to the last
  bucket, whose copy rejects it as the package's kernel would).

The result is an ordinary candidate: compiled, tested (at the bucket edges too) and timed like
any other before it may become the best. A source that could tell a copy from the candidate that
was measured (its function's name, line numbers, a counter, a weak reference to a copy's symbol)
is not built: it could behave differently only in the library kopt generates (CONTEXT_PROBES).
Pure string work, importable in the workflow.
"""

from __future__ import annotations

import bisect
import math
import random
import re

from kopt.models import Dispatch, KernelSpec, Shape, ShapeSpeedup, Target
from kopt.package import PackageError, apply_tunables, empty_range, plain_dimension

INCLUDE_LINE = re.compile(r"^[ \t]*#[ \t]*include\b.*$", re.M)
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)", re.M)
# The generated source travels inline in activity inputs and workflow history (as every candidate's
# does): past this size the step builds nothing rather than push a run's history toward its limits.
MAX_SOURCE_BYTES = 512 << 10
# What a copy could observe about where it is compiled (red team, 2026-11-23): the enclosing
# function's or namespace's name, its line, a TU-wide counter, the file, and weak symbols (whether a
# copy's renamed entry exists).
CONTEXT_PROBES = re.compile(r"__(?:PRETTY_)?FUNCTION__|\b__func__\b|__COUNTER__|__LINE__|__FILE__|__BASE_FILE__|"
                            r"__FILE_NAME__|__INCLUDE_LEVEL__|__builtin_(?:FUNCTION|LINE|FILE|COLUMN|source_location)|"
                            r"\bweak\b|__weak__|\bkopt_bucket")


def bucket_of(dispatch: Dispatch, value: int) -> int:
    """Index of the bucket a value of the dispatch symbol falls in: bucket i is (edges[i-1], edges[i]]."""
    return bisect.bisect_left(dispatch.edges, value)


def bucket_labels(dispatch: Dispatch) -> list[str]:
    s, e = dispatch.symbol, dispatch.edges
    return ([f"{s} <= {e[0]}"] + [f"{a} < {s} <= {b}" for a, b in zip(e, e[1:])] + [f"{s} > {e[-1]}"])


def split_shapes(dispatch: Dispatch, shapes: list[Shape]) -> list[list[Shape]]:
    """The shapes of each bucket (some may be empty)."""
    out: list[list[Shape]] = [[] for _ in range(len(dispatch.edges) + 1)]
    for shape in shapes:
        out[bucket_of(dispatch, shape.dims[dispatch.symbol])].append(shape)
    return out


def bucket_speedup(per_shape: list[ShapeSpeedup], shapes: list[Shape]) -> float | None:
    """Geomean speedup over a bucket's shapes (every dtype), or None when a shape was not measured."""
    labels = {s.label for s in shapes}
    values = [s.speedup for s in per_shape if s.shape in labels and s.speedup > 0]
    if not labels or {s.shape for s in per_shape if s.shape in labels} != labels:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def choose(dispatch: Dispatch, shapes: list[Shape],
           options: list[tuple[dict[str, int], list[ShapeSpeedup]]]) -> list[int] | None:
    """For each bucket, the index of the option (tunables, per-shape speedups against the baseline)
    fastest over the bucket's shapes; earlier options win ties. None when a bucket has no timed shape
    (nothing to choose on)."""
    picks = []
    for bucket in split_shapes(dispatch, shapes):
        if not bucket:
            return None
        scored = [(bucket_speedup(per_shape, bucket), i) for i, (_, per_shape) in enumerate(options)]
        scored = [(v, i) for v, i in scored if v is not None]
        if not scored:
            return None
        picks.append(max(scored, key=lambda vi: (vi[0], -vi[1]))[1])
    return picks


def specialized_source(spec: KernelSpec, source: str, dispatch: Dispatch, settings: list[dict[str, int]]) -> str:
    """One source whose entry point calls, for each bucket, a copy of `source` with that bucket's
    tunable values (settings[i] for bucket i). Raises PackageError when a value cannot be applied or
    the result would exceed MAX_SOURCE_BYTES."""
    assert len(settings) == len(dispatch.edges) + 1
    entry = spec.entry
    probe = CONTEXT_PROBES.search(source)
    if probe:
        raise PackageError(f"the source uses {probe.group(0)!r}, with which a copy could tell it is not the "
                           f"candidate that was measured")  # fmt: skip
    where = plain_dimension(spec, dispatch.symbol)
    assert where is not None  # kernel.toml checks it
    arg, dim = where
    distinct: list[dict[str, int]] = []
    for s in settings:
        if s not in distinct:
            distinct.append(s)
    includes: list[str] = []
    for line in INCLUDE_LINE.findall(source):
        if line.strip() not in includes:
            includes.append(line.strip())
    body = INCLUDE_LINE.sub("", source)  # hoisted above the copies (each line left empty)
    macros = sorted({m for m in DEFINE.findall(source) if m != entry and not m.startswith("KOPT_")})
    undef = [f"#undef {m}" for m in macros]
    labels = bucket_labels(dispatch)
    out = ["// Shape-specialized build of " + spec.name + " (generated by kopt.dispatch): one copy per setting,",
           "// and an entry point that picks the copy by " + dispatch.symbol + " = dimension "
           + f"{dim} of argument {arg} ({spec.arguments[arg].name}).",
           *(f"//   {label}: copy {distinct.index(s)} {s}" for label, s in zip(labels, settings)),
           *includes]  # fmt: skip
    for k, values in enumerate(distinct):
        copy = re.sub(rf"\b{re.escape(entry)}\b", f"{entry}_bucket{k}", apply_tunables(body, values))
        out += [*undef, f"namespace kopt_bucket{k} {{", copy, f"}}  // namespace kopt_bucket{k}"]
    out += undef
    out += [f'extern "C" __attribute__((visibility("default"))) int {entry}(const kopt_tensor *args, int32_t nargs,',
            "                                                        void *stream) {",
            f"  const int64_t v = (args && nargs > {arg} && args[{arg}].ndim > {dim}) ? args[{arg}].shape[{dim}] : -1;"]  # fmt: skip
    for i, edge in enumerate(dispatch.edges):
        k = distinct.index(settings[i])
        out.append(f"  if (v >= 0 && v <= {edge}) return kopt_bucket{k}::{entry}_bucket{k}(args, nargs, stream);")
    k = distinct.index(settings[-1])
    out += [f"  return kopt_bucket{k}::{entry}_bucket{k}(args, nargs, stream);", "}", ""]
    text = "\n".join(out)
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise PackageError(f"the shape-specialized source would be {len(text.encode()) >> 10} KiB, over the "
                           f"{MAX_SOURCE_BYTES >> 10} KiB a candidate may carry")  # fmt: skip
    return text


def interior_shapes(spec: KernelSpec, target: Target, dispatch: Dispatch, seed: int) -> list[Shape]:
    """One test shape strictly inside each bucket, drawn by the run's seed (log-uniform; the last
    bucket up to 4x its lower edge): the copies are checked between the edges too, at sizes no search
    shape fixed in advance."""
    rng = random.Random(f"{spec.name}/{target}/dispatch/{seed}")
    values = []
    for i, low in enumerate([1, *(e + 1 for e in dispatch.edges)]):
        high = dispatch.edges[i] if i < len(dispatch.edges) else 4 * low
        if high - low >= 2:
            values.append(min(high - 1, max(low + 1, round(math.exp(rng.uniform(math.log(low + 1),
                                                                               math.log(high - 1)))))))
    return _test_shapes_at(spec, target, dispatch.symbol, values)


def edge_shapes(spec: KernelSpec, target: Target, dispatch: Dispatch) -> list[Shape]:
    """Test shapes on both sides of every edge (symbol = edge and edge + 1): each bucket's copy is
    checked where the dispatch switches."""
    return _test_shapes_at(spec, target, dispatch.symbol, [v for e in dispatch.edges for v in (e, e + 1)])


def _test_shapes_at(spec: KernelSpec, target: Target, symbol: str, values: list[int]) -> list[Shape]:
    """The package's first test shape with `symbol` set to each value (where its arguments' value
    ranges are not empty)."""
    base = spec.shapes[target].test[0].dims
    dims = [{**base, symbol: v} for v in values]
    return [Shape(dims=d) for d in dims if empty_range(spec, d) is None]
