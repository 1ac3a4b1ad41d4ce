"""Held-out shapes: problem sizes a run's search never tests or times, on which the best is judged
once after the last round (docs/decisions/0020-held-out-shapes.md).

With a workload, `count` of its shapes (split_workload). Else the package's own
`[shapes.<target>] holdout` list when it declares one; otherwise `count` shapes
derived from the bench shapes by the run's seed: each symbol of a bench shape scaled by a factor
drawn log-uniformly in [1/SPAN, SPAN], kept no larger in elements than the largest bench shape (so
the held-out run fits where the search ran), and different from every test and bench shape.
"""

from __future__ import annotations

import math
import random

from kopt.models import KernelSpec, Shape, Target
from kopt.package import empty_range

SPAN = 3.0
TRIES = 50


def split_workload(workload: list[Shape], seed: int, count: int) -> tuple[list[Shape], list[Shape]]:
    """(search shapes, held-out shapes) of a workload: `count` of its shapes (at most a third of
    them, none when it has fewer than 3) chosen by the seed and kept out of the search."""
    n = min(count, len(workload) // 3)
    if n <= 0:
        return list(workload), []
    rng = random.Random(f"workload/{seed}")
    held = set(rng.sample(range(len(workload)), n))
    return ([s for i, s in enumerate(workload) if i not in held],
            [s for i, s in enumerate(workload) if i in held])  # fmt: skip


def holdout_shapes(spec: KernelSpec, target: Target, seed: int, count: int) -> list[Shape]:
    sets = spec.shapes[target]
    if count <= 0:
        return []
    if sets.holdout:
        return list(sets.holdout)
    seen = {tuple(sorted(s.dims.items())) for s in [*sets.test, *sets.bench]}
    largest = max(_size(s.dims) for s in sets.bench)
    rng = random.Random(f"{spec.name}/{target}/{seed}")
    out: list[Shape] = []
    for _ in range(TRIES * count):
        if len(out) == count:
            break
        base = rng.choice(sets.bench).dims
        dims = {k: max(1, round(v * math.exp(rng.uniform(-1, 1) * math.log(SPAN)))) for k, v in base.items()}
        while _size(dims) > largest:
            k = max(dims, key=lambda name: dims[name])
            dims[k] = max(1, dims[k] // 2)
        key = tuple(sorted(dims.items()))
        if key in seen or empty_range(spec, dims) is not None:
            continue
        seen.add(key)
        out.append(Shape(dims=dims))
    return out


def _size(dims: dict[str, int]) -> int:
    return math.prod(dims.values())

