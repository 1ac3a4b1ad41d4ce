"""The offline planner/coder: deterministic, never repeats a configuration, produces real changes."""

from __future__ import annotations

import math

from agents import offline
from kopt.artifacts import ArtifactStore
from kopt.candidates import candidate_id
from kopt.models import Candidate, CodeRequest, PackageRef, PlanRequest, RoundRecord
from kopt.package import load_spec, read_tunables
from kopt.plan_history import FAILURE_REASONS, PLAN_WINDOW, compact_history, config_key
from tests.conftest import REPO

SILU = REPO / "kernels" / "silu_and_mul"


def _setup(tmp_path, target="cuda"):
    spec = load_spec(SILU)
    source = (SILU / spec.sources[target]).read_text()
    flags = spec.build[target].flags
    pkg = PackageRef(spec=spec, files=ArtifactStore(tmp_path).put_tree(SILU), baseline_sources={target: source})
    tunables = read_tunables(source, [t.name for t in spec.tunables_for(target)])
    best = Candidate(id=candidate_id(source, flags, "tc"), source=source, flags=flags, tunables=tunables)
    return pkg, best


# The exhaustive tests walk the CPU space (128 configurations; CUDA's has 800).
WHOLE = "cpu"


def _space(pkg) -> int:
    """Configurations in the declared space: every tunable's values times each playbook option on or off."""
    return math.prod(len(t.values) for t in pkg.spec.tunables_for(WHOLE)) * 2 ** len(offline.PLAYBOOK[WHOLE])


def _changes(plan, best) -> int:
    return (sum(plan.tunables[k] != best.tunables[k] for k in plan.tunables)
            + len(set(plan.flags) ^ set(best.flags)))


def test_planner_is_deterministic_and_never_repeats(tmp_path):
    """Single changes from the best first (the coordinate moves), then wider ones, fewer changes first,
    until every configuration of the declared space has been proposed once."""
    pkg, best = _setup(tmp_path, WHOLE)
    history: list[RoundRecord] = []
    widths = []
    seen = {(tuple(sorted(best.tunables.items())), tuple(sorted(best.flags)))}
    for rnd in range(1, 5000):
        req = PlanRequest(package=pkg, target=WHOLE, round=rnd, best=best, best_speedup=1.0, history=history)
        plan = offline.plan(req)
        assert offline.plan(req) == plan  # same input, same plan
        if plan.exhausted:
            break
        key = (tuple(sorted(plan.tunables.items())), tuple(sorted(plan.flags)))
        assert key not in seen
        seen.add(key)
        widths.append(_changes(plan, best))
        history.append(RoundRecord(round=rnd, candidate_id=str(rnd), description=plan.description,
                                   tunables=plan.tunables, flags=plan.flags, compiled=True, correct=True))
    # Neighbours of the baseline first: every other value of each tunable, plus each playbook flag.
    spec = pkg.spec
    n_moves = sum(len(t.values) - 1 for t in spec.tunables_for(WHOLE)) + len(offline.PLAYBOOK[WHOLE])
    assert widths[:n_moves] == [1] * n_moves and widths == sorted(widths)
    assert plan.exhausted and len(history) == _space(pkg) - 1 and "declared space" in plan.rationale


def test_first_rounds_cover_different_dimensions(tmp_path):
    pkg, best = _setup(tmp_path)
    changed = []
    history: list[RoundRecord] = []
    for rnd in range(1, 5):
        plan = offline.plan(PlanRequest(package=pkg, target="cuda", round=rnd, best=best, best_speedup=1.0,
                                        history=history))
        diff_t = {k for k in plan.tunables if plan.tunables[k] != best.tunables[k]}
        changed.append(frozenset(diff_t) or "flags")
        history.append(RoundRecord(round=rnd, candidate_id=str(rnd), description=plan.description,
                                   tunables=plan.tunables, flags=plan.flags, compiled=True, correct=True))
    assert len(set(changed)) == 4


def test_coder_writes_the_source_change(tmp_path):
    pkg, best = _setup(tmp_path)
    plan = offline.plan(PlanRequest(package=pkg, target="cuda", round=1, best=best, best_speedup=1.0, history=[]))
    result = offline.code(CodeRequest(package=pkg, target="cuda", toolchain="tc", plan=plan, base=best))
    cand = result.candidate
    assert cand.parent_id == best.id and cand.id != best.id
    assert read_tunables(cand.source, list(plan.tunables)) == plan.tunables
    assert cand.id == candidate_id(cand.source, cand.flags, "tc")
    changed = [k for k in plan.tunables if plan.tunables[k] != best.tunables[k]]
    assert len(changed) == 1
    assert f"-#define {changed[0]} {best.tunables[changed[0]]}" in result.diff
    assert f"+#define {changed[0]} {plan.tunables[changed[0]]}" in result.diff


def test_planner_never_proposes_the_baseline_again(tmp_path):
    pkg, base = _setup(tmp_path, WHOLE)
    moved = base.model_copy(update={"tunables": {**base.tunables, "UNROLL": 4}, "id": "moved"})
    history: list[RoundRecord] = []
    for rnd in range(1, 5000):
        plan = offline.plan(PlanRequest(package=pkg, target=WHOLE, round=rnd, best=moved, best_speedup=1.2,
                                        history=history))
        if plan.exhausted:
            break
        assert (plan.tunables, sorted(plan.flags)) != (base.tunables, sorted(base.flags))
        history.append(RoundRecord(round=rnd, candidate_id=str(rnd), description=plan.description,
                                   tunables=plan.tunables, flags=plan.flags, compiled=True, correct=True))
    assert plan.exhausted and len(history) == _space(pkg) - 2  # all but the best and the baseline


def test_planner_never_repeats_with_a_compact_history(tmp_path):
    """As the workflow sends it: the last few records in full, every older one only in the digest."""
    pkg, best = _setup(tmp_path, WHOLE)
    records: list[RoundRecord] = []
    seen = {config_key(best.tunables, best.flags)}
    for rnd in range(1, 5000):
        recent, earlier = compact_history(records, window=3)
        assert len(recent) == min(len(records), 3)
        req = PlanRequest(package=pkg, target=WHOLE, round=rnd, best=best, best_speedup=1.0, history=recent,
                          earlier=earlier)
        plan = offline.plan(req)
        if plan.exhausted:
            break
        key = config_key(plan.tunables, plan.flags)
        assert key not in seen
        seen.add(key)
        records.append(RoundRecord(round=rnd, candidate_id=str(rnd), description=plan.description,
                                   tunables=plan.tunables, flags=plan.flags, compiled=True, correct=True,
                                   speedup_geomean=1.0))
    assert plan.exhausted and len(records) == _space(pkg) - 1
    # Without the digest the planner would repeat an old configuration: the digest is what prevents it.
    stripped = offline.plan(PlanRequest(package=pkg, target=WHOLE, round=len(records) + 1, best=best,
                                        best_speedup=1.0, history=records[-3:]))
    assert not stripped.exhausted and config_key(stripped.tunables, stripped.flags) in earlier.tried


def test_digest_is_bounded_by_distinct_configurations():
    def record(rnd, knob, **kw):
        return RoundRecord(round=rnd, candidate_id=f"c{rnd}", description=f"KNOB -> {knob}", tunables={"KNOB": knob},
                           flags=["-O3", "-march=native"], compiled=True, correct=True, **kw)

    records = [record(1, 1, speedup_geomean=1.2, accepted=True)]
    records += [record(r, 2 + r % 3, failure=f"compile error: kernel.cpp:{r % 20}: error: boom") for r in range(2, 501)]
    recent, earlier = compact_history(records, window=PLAN_WINDOW)
    assert [r.round for r in recent] == list(range(501 - PLAN_WINDOW, 501))
    assert earlier.records == earlier.last_round == 500 - PLAN_WINDOW
    assert earlier.tried == {"KNOB=1|-O3 -march=native": "1.200x best", "KNOB=3|-O3 -march=native": "compile error",
                             "KNOB=4|-O3 -march=native": "compile error", "KNOB=2|-O3 -march=native": "compile error"}
    assert len(earlier.failures) == FAILURE_REASONS + 1 and sum(earlier.failures.values()) == earlier.records - 1
    assert earlier.top == ["round 1: KNOB -> 1 | KNOB=1|-O3 -march=native | 1.200x best"]
    assert config_key({"B": 2, "A": 1}, ["-b", "-a"]) == config_key({"A": 1, "B": 2}, ["-a", "-b"]) == "A=1,B=2|-a -b"
    assert compact_history(records[:PLAN_WINDOW]) == (records[:PLAN_WINDOW], None)
