"""What a test job checks: declared shapes, derived edge shapes and input variants (no torch).

Every declared shape and dtype gets `trials` seeded trials plus one trial per input scale; the
package's declared test shapes also yield edge shapes (all symbols 1, one symbol at a time 1 and
every value 2..8, every symbol a prime near its value) and one padded-row layout, each kept cheap by an element
budget. Variants are enforced only where they apply: where the baseline passes them, or, without
a baseline, where the candidate accepts the shape (see correctness.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kopt import expr
from kopt.models import KernelSpec, Shape
from kopt.package import shape_symbols

# Elements over all arguments: edge shapes stay under EDGE_BUDGET, scale and layout variants
# run on declared shapes under VARIANT_BUDGET (CPU kernels are single-threaded and slow).
EDGE_BUDGET = {"cpu": 1 << 18, "cuda": 1 << 22}
VARIANT_BUDGET = {"cpu": 1 << 20, "cuda": 1 << 26}
SCALES = (0.01, 100.0)  # input scales of the scale variants (docs/measurement.md, correctness 2)
ROW_PAD = 8  # elements of padding per row in the strided variant (keeps 16-byte alignment)
SMALL_SIZES = 8  # edge shapes set each symbol to every value 2..SMALL_SIZES (one vector of 8 halves)


@dataclass(frozen=True)
class CaseSpec:
    dims: tuple[tuple[str, int], ...]
    dtype: str
    variant: str = ""
    trial: int = 0
    scale: float = 1.0
    special: bool = False
    row_pad: int = 0

    @property
    def dim_map(self) -> dict[str, int]:
        return dict(self.dims)


@dataclass
class Group:
    """Cases whose errors are aggregated and reported together as one ShapeCheck."""

    label: str
    dtype: str
    variant: str
    declared: bool  # a declared shape with declared inputs: failures always count
    cases: list[CaseSpec] = field(default_factory=list)

    @property
    def key(self) -> str:
        return " ".join(p for p in (self.label, self.dtype, self.variant) if p)


def arg_shapes(spec: KernelSpec, dims: dict[str, int]) -> list[list[int]]:
    return [[int(expr.evaluate(d, dims)) for d in arg.shape] for arg in spec.arguments]


def elements(spec: KernelSpec, dims: dict[str, int]) -> int:
    return sum(math.prod(s) for s in arg_shapes(spec, dims))


def valid(spec: KernelSpec, dims: dict[str, int]) -> bool:
    try:
        return all(d > 0 for s in arg_shapes(spec, dims) for d in s)
    except (expr.ExprError, ZeroDivisionError, TypeError):
        return False


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, math.isqrt(n) + 1))


def prime_at_most(n: int) -> int:
    while n > 2 and not is_prime(n):
        n -= 1
    return max(n, 2)


def next_prime(n: int) -> int:
    n += 1
    while not is_prime(n):
        n += 1
    return n


def label(dims: dict[str, int]) -> str:
    return Shape(dims=dims).label


def edge_shapes(spec: KernelSpec, declared: list[Shape], target: str) -> list[dict[str, int]]:
    """Edge shapes derived from the declared ones: all ones, one symbol at a time set to 1 (1 row)
    and to every value 2..SMALL_SIZES, and every symbol a prime near its value; valid, under the
    budget, not already declared."""
    syms = shape_symbols(spec)
    budget = EDGE_BUDGET.get(target, EDGE_BUDGET["cuda"])
    fitting = [s.dims for s in declared if valid(spec, s.dims) and elements(spec, s.dims) <= budget]
    base = max(fitting, key=lambda d: elements(spec, d)) if fitting else None
    seen = [dict(s.dims) for s in declared]
    out: list[dict[str, int]] = []

    def add(dims: dict[str, int]) -> None:
        if dims not in seen and valid(spec, dims) and elements(spec, dims) <= budget:
            seen.append(dims)
            out.append(dims)

    add({s: 1 for s in syms})
    if base is None:
        return out
    for s in syms:
        if base[s] > 1:
            add({**base, s: 1})
    # Every small size up to one vector width, one symbol at a time: a shortcut or a dropped tail
    # that shows only at some remainders (2, 4 or 6 rows of a kernel that works in 8s) is met.
    for s in syms:
        for v in range(2, SMALL_SIZES + 1):
            if v < base[s]:
                add({**base, s: v})
    primes = {s: prime_at_most(v) if v > 2 else v for s, v in base.items()}
    if primes in seen:
        primes = {s: next_prime(v) for s, v in base.items()}
    add(primes)
    return out


def test_plan(
    spec: KernelSpec, target: str, shapes: list[Shape], dtypes: list[str], trials: int, edge: bool, special: bool
) -> list[Group]:
    """Groups to check, declared shapes first. `special`: make_inputs takes special=True."""
    groups: list[Group] = []
    budget = VARIANT_BUDGET.get(target, VARIANT_BUDGET["cuda"])
    two_d = any(len(a.shape) >= 2 for a in spec.arguments)
    for shape in shapes:
        dims = tuple(shape.dims.items())
        small = elements(spec, shape.dims) <= budget
        for dtype in dtypes:
            groups.append(Group(shape.label, dtype, "", True, [CaseSpec(dims, dtype, "", t) for t in range(trials)]))
            if not small:
                continue
            for scale in SCALES:
                v = f"x{scale:g}"
                groups.append(Group(shape.label, dtype, v, False, [CaseSpec(dims, dtype, v, 0, scale=scale)]))
            if special:
                groups.append(Group(shape.label, dtype, "special", False, [CaseSpec(dims, dtype, "special", 0,
                                                                                    special=True)]))
    if edge:
        for dims in edge_shapes(spec, shapes, target):
            for dtype in dtypes:
                case = CaseSpec(tuple(dims.items()), dtype, "edge", 0)
                groups.append(Group(label(dims), dtype, "edge", False, [case]))
    if two_d:
        fitting = [s for s in shapes if elements(spec, s.dims) <= budget]
        if fitting:
            shape = max(fitting, key=lambda s: elements(spec, s.dims))
            for dtype in dtypes:
                case = CaseSpec(tuple(shape.dims.items()), dtype, "strided", 0, row_pad=ROW_PAD)
                groups.append(Group(shape.label, dtype, "strided", False, [case]))
    return groups
