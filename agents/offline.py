"""The offline provider: a deterministic planner and coder that need no LLM.

The planner runs a coordinate search from the best candidate so far: each round it changes one
declared tunable or one compile option, cycling through the dimensions so that a few rounds
already cover several of them, and never proposes a configuration that was already tried (the
request's recent records plus its digest of older ones, `PlanRequest.earlier`). Once every single
change from the best has been tried, the search widens: two changes at once, then three, nearest
values first, until the whole declared space (tunables x playbook options) has been tried. So a
long campaign, or N slots proposing side by side, never runs out of distinct untried configurations
before the space does. The coder applies the plan as a real source change (the tunable `#define`
lines) plus compile flags.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from agents.playbook import PLAYBOOK
from kopt.candidates import candidate_id, unified_diff
from kopt.models import Candidate, CodeRequest, CodeResult, Plan, PlanRequest
from kopt.package import apply_tunables, read_tunables
from kopt.plan_history import config_key


def _nearest_first(values: list[int], current: int | None) -> list[int]:
    """`values` other than `current`, nearest in the declared order first (on a tie, the later one)."""
    others = [v for v in values if v != current]
    if current is not None and current in values:
        idx = values.index(current)
        others.sort(key=lambda v: (abs(values.index(v) - idx), -values.index(v)))
    return others


Change = tuple[str, str, object]  # (dimension kind "tunable" | "flag", name, new value)


def _dimension_changes(req: PlanRequest) -> list[list[tuple[Change, str]]]:
    """Each dimension of the declared space (one per tunable, one per playbook option) as its possible
    changes from the best, nearest values first, each with its words."""
    best_t, best_f = dict(req.best.tunables), list(req.best.flags)
    dims: list[list[tuple[Change, str]]] = []
    for tunable in req.package.spec.tunables_for(req.target):
        current = best_t.get(tunable.name)
        # Nearest values first: small steps are the likeliest to keep what already works.
        dims.append([(("tunable", tunable.name, v), f"{tunable.name} {current} -> {v}")
                     for v in _nearest_first(list(tunable.values), current)])
    for flag, why in PLAYBOOK.get(req.target, []):
        present = flag in best_f
        dims.append([(("flag", flag, not present), f"drop {flag}" if present else f"add {flag} ({why})")])
    return [d for d in dims if d]


def _configure(req: PlanRequest, changes: list[Change]) -> tuple[dict[str, int], list[str]]:
    """The best configuration with `changes` applied: (tunables, flags)."""
    tunables, flags = dict(req.best.tunables), list(req.best.flags)
    for kind, name, value in changes:
        if kind == "tunable":
            tunables[name] = value  # type: ignore[assignment]
        elif value:
            flags.append(name)
        else:
            flags = [f for f in flags if f != name]
    return tunables, flags


def _moves(req: PlanRequest) -> list[list[tuple[str, dict[str, int], list[str]]]]:
    """Single changes from the best configuration, grouped by dimension: one per tunable, and the
    playbook options together."""
    tunable_dims, flag_moves = [], []
    for dim in _dimension_changes(req):
        moves = [(words, *_configure(req, [change])) for change, words in dim]
        if dim[0][0][0] == "tunable":
            tunable_dims.append(moves)
        else:
            flag_moves += moves
    return [d for d in (*tunable_dims, flag_moves) if d]


def _wider(req: PlanRequest) -> Iterator[tuple[str, dict[str, int], list[str], int]]:
    """Configurations two or more changes away from the best: (words, tunables, flags, changes), fewer
    changes first, then the dimensions in declared order, nearest values first. Lazy: the caller stops
    at the first untried one."""
    dims = _dimension_changes(req)
    for width in range(2, len(dims) + 1):
        for chosen in itertools.combinations(dims, width):
            for combo in itertools.product(*chosen):
                tunables, flags = _configure(req, [change for change, _ in combo])
                yield ", ".join(words for _, words in combo), tunables, flags, width


def _baseline_key(req: PlanRequest) -> str:
    spec = req.package.spec
    source = req.package.baseline_sources[req.target]
    flags = spec.build[req.target].flags if req.target in spec.build else []
    return config_key(read_tunables(source, [t.name for t in spec.tunables_for(req.target)]), flags)


def _proposals(req: PlanRequest) -> Iterator[tuple[str, dict[str, int], list[str], str]]:
    """(words, tunables, flags, rationale) in the order the planner offers them: the coordinate moves,
    dimension by dimension from the round's own, then the wider ones."""
    best = f"from the best candidate {req.best.id} (speedup {req.best_speedup:.3f}x)"
    dims = _moves(req)
    for offset in range(len(dims)):
        for description, tunables, flags in dims[(req.round - 1 + offset) % len(dims)]:
            yield (description, tunables, flags,
                   f"coordinate search {best}: one change at a time, untried configurations only")
    for description, tunables, flags, width in _wider(req):
        yield (description, tunables, flags, f"widening search {best}: every single change from it has been "
               f"tried; {width} changes at once, untried configurations only")


def plan(req: PlanRequest) -> Plan:
    tried = {config_key(h.tunables, h.flags) for h in req.history}
    if req.earlier is not None:  # records older than the request's window
        tried.update(req.earlier.tried)
    tried.add(config_key(req.best.tunables, req.best.flags))
    tried.add(_baseline_key(req))  # measured in round 0
    for description, tunables, flags, rationale in _proposals(req):
        if config_key(tunables, flags) not in tried:
            return Plan(round=req.round, description=description, rationale=rationale, tunables=tunables,
                        flags=flags)
    return Plan(round=req.round, description="search space exhausted", rationale="every configuration of the "
                "declared space has been tried", tunables=dict(req.best.tunables), flags=list(req.best.flags),
                exhausted=True)


def code(req: CodeRequest) -> CodeResult:
    source = apply_tunables(req.base.source, req.plan.tunables)
    flags = list(req.plan.flags)
    candidate = Candidate(
        id=candidate_id(source, flags, req.toolchain),
        source=source,
        flags=flags,
        tunables=dict(req.plan.tunables),
        parent_id=req.base.id,
        origin=req.plan.description,
    )
    name = req.package.spec.sources[req.target]
    return CodeResult(candidate=candidate, diff=unified_diff(req.base.source, source, name))


def unchanged(best: Candidate) -> CodeResult:
    return CodeResult(candidate=best, diff="")
