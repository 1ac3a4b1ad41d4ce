"""The optimization run's decision rules (workflows/rules.py), without a server or a kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kopt.models import EVALUATING, ABResult, ProfileResult, RoundRecord, ShapeAB, ShapeSpeedup, ShapeTiming
from kopt.run_models import Budgets, Usage
from workflows import rules

RULES = Path(rules.__file__)


def test_the_rules_import_nothing_of_temporal_and_touch_no_clock():
    names = set()
    for node in ast.walk(ast.parse(RULES.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names <= {"__future__", "math", "dataclasses", "typing", "kopt"}, names


@pytest.mark.parametrize(("measured", "best"), [
    ([], None),
    ([(0, 1.2, False)], None),  # the only one slower than the baseline somewhere
    ([(0, 1.1, True), (1, 1.3, True)], 1),
    ([(0, 1.3, True), (1, 1.3, True)], 0),  # a tie: the earlier slot
    ([(0, 1.5, False), (1, 1.2, True)], 1),  # the fastest is not eligible
])  # fmt: skip
def test_the_round_best_is_the_fastest_eligible_slot(measured, best):
    assert rules.round_best(measured) == best


@pytest.mark.parametrize(("speedup", "best", "significant", "accepted"), [
    (1.06, 1.0, True, True),
    (1.05, 1.0, True, False),  # exactly min_gain: not more than it
    (1.04, 1.0, True, False),
    (1.20, 1.0, False, False),  # inside the A/B's noise
    (2.11, 2.0, True, True),  # min_gain is relative to the best, not the baseline
    (2.09, 2.0, True, False),
])  # fmt: skip
def test_min_gain_and_significance_decide_a_new_best(speedup, best, significant, accepted):
    assert rules.beats_best(speedup, best, 0.05, significant) is accepted
    why = rules.why_not_best(speedup, best, 0.05, significant)
    assert (why is None) is accepted  # every refusal says its rule
    if why is not None:
        assert why.startswith("not the new best: ")
        assert ("minimum gain (5%, --min-gain)" in why) is (speedup <= best * 1.05), why
        assert ("noise floor" in why) is (speedup > best * 1.05 and not significant), why


@pytest.mark.parametrize(("speedup", "ratios", "kept"), [
    (1.10, [1.0, 1.0], True),  # better overall by more than min_gain
    (1.00, [1.08, 0.99], True),  # a bucket better by min_gain, none worse by it, overall no lower
    (1.00, [1.08, 0.94], False),  # one bucket loses more than min_gain
    (0.99, [1.08, 1.0], False),  # overall lower than the best
    (1.00, [1.04, 1.0], False),  # no bucket gains min_gain
    (1.00, [], False),
])  # fmt: skip
def test_the_bucket_rule_of_a_specialized_library(speedup, ratios, kept):
    assert rules.bucket_gain(speedup, 1.0, ratios, 0.05) is kept


def test_stop_reasons_are_kinds_with_texts_in_order():
    none = Budgets()
    assert rules.stop_reason(none, Usage(), 10.0, None, 0) is None
    assert rules.stop_reason(none, Usage(), None, None, 0, llm_stop="planner: HTTP 401") == \
        rules.Stop("llm", "planner: HTTP 401")  # fmt: skip
    spent = Usage(cost_usd=2.0, prompt_tokens=900, completion_tokens=200, device_seconds=50.0)
    cost = rules.stop_reason(Budgets(max_cost_usd=1.5, max_tokens=10), spent, None, None, 0)
    assert cost == rules.Stop("budget", "cost budget reached ($2.0000 >= $1.5)")  # the first check that holds
    assert rules.stop_reason(Budgets(max_tokens=1000), spent, None, None, 0).text == \
        "token budget reached (1100 >= 1000)"  # fmt: skip
    assert rules.stop_reason(Budgets(max_gpu_seconds=50), spent, None, None, 0).kind == "budget"
    wall = rules.stop_reason(Budgets(max_wall_time_s=100), Usage(), 157.2, None, 0)
    assert wall == rules.Stop("budget", "wall-time budget reached (157 s >= 100.0 s)")
    assert rules.stop_reason(Budgets(max_wall_time_s=100), Usage(), 99.9, None, 0) is None
    assert rules.stop_reason(Budgets(max_wall_time_s=100), Usage(), None, None, 0) is None  # not started yet
    assert rules.stop_reason(none, Usage(), None, 3, 3) == rules.Stop("patience", "no improvement in the last 3 rounds")
    assert rules.stop_reason(none, Usage(), None, 3, 2) is None


def _profile(verdict: str | None, medians: dict[str, float]) -> ProfileResult:
    timings = [ShapeTiming(shape=s, dtype="float16", median_us=m, p10_us=m, p90_us=m, samples=10, gbytes_per_s=1.0)
               for s, m in medians.items()]  # fmt: skip
    ab = None
    if verdict is not None:
        ab = ABResult(per_shape=[ShapeAB(shape=s, dtype="float16", mode="cold", baseline_us=2 * m, candidate_us=m,
                                         speedup=2.0, ci_low=1.9, ci_high=2.1, baseline_samples=10,
                                         candidate_samples=10) for s, m in medians.items()],
                      speedup_geomean=2.0, ci_low=1.9, ci_high=2.1, verdict=verdict, noise_floor=0.03)  # fmt: skip
    return ProfileResult(candidate_id="c", ok=True, timings=timings, ab=ab)


def test_speedups_come_from_the_ab_when_there_is_one_else_from_medians():
    base = _profile(None, {"T=1": 10.0, "T=2": 20.0})
    cand = _profile(None, {"T=1": 5.0, "T=2": 40.0, "T=3": 1.0})
    by_median = rules.speedups(base, cand)
    assert [(s.shape, s.speedup) for s in by_median] == [("T=1", 2.0), ("T=2", 0.5)]  # T=3: no baseline
    ab = rules.speedups(base, _profile("faster", {"T=1": 5.0}), floored=True)
    assert [(s.speedup, s.noise_floor, s.ci_low) for s in ab] == [(2.0, 0.03, 1.9)]
    assert rules.speedups(base, _profile("faster", {"T=1": 5.0}))[0].noise_floor == 0.0
    assert rules.significant(_profile("faster", {"T=1": 5.0}))
    assert not rules.significant(_profile("same", {"T=1": 5.0}))
    assert rules.significant(_profile(None, {"T=1": 5.0}))  # no A/B (CPU timing alone): medians decide
    assert rules.geomean([2.0, 8.0]) == pytest.approx(4.0) and rules.geomean([]) == 0.0


def test_a_round_record_says_its_status_and_older_records_are_read_from_their_failure_text():
    base = dict(round=1, candidate_id="c", description="d", tunables={}, flags=[], compiled=True, correct=False)
    assert RoundRecord(**base, failure="wrong result: x", status="wrong result").kind == "wrong result"
    # Written before the field: the words before the first colon were the status.
    assert RoundRecord(**base, failure="compile error: a.cpp:3: error").kind == "compile error"
    assert RoundRecord(**base, failure="profile failed: timed out").kind == "profile failed"
    assert RoundRecord(**base, failure=EVALUATING).kind == "evaluating"
    assert RoundRecord(**{**base, "compiled": False}, failure="planner: unusable reply").kind == "no candidate"
    assert RoundRecord(**{**base, "correct": True}, speedup_geomean=1.2).kind == "measured"
    # The field wins over the text: an agent's failure that happens to start like a status word.
    odd = RoundRecord(**{**base, "compiled": False}, failure="compile error: the coder's reply", status="no candidate")
    assert odd.kind == "no candidate"


def _versus(speedup: float, verdict: str) -> ProfileResult:
    ab = ABResult(per_shape=[], speedup_geomean=speedup, ci_low=speedup * 0.99, ci_high=speedup * 1.01,
                  verdict=verdict, noise_floor=0.01)  # fmt: skip
    return ProfileResult(candidate_id="c", ok=True, ab=ab)


@pytest.mark.parametrize(("versus", "significant", "says"), [
    (_versus(1.10, "faster"), True, None),
    (_versus(1.05, "faster"), True, "not above it by the minimum gain (5%, --min-gain)"),  # exactly min_gain
    (_versus(0.97, "slower"), True, "0.970x the best's speed head to head"),
    (_versus(1.08, "same"), True, "does not clear the noise floor"),  # faster, inside the A/B's noise
    (_versus(1.10, "faster"), False, "against the baseline does not clear the noise floor"),
    (ProfileResult(candidate_id="c", ok=False, reason="T=1 float32: crashed"), True, "failed (T=1 float32: crashed)"),
    (None, True, "failed (no A/B against the best)"),
])  # fmt: skip
def test_a_best_is_replaced_only_by_beating_it_head_to_head(versus, significant, says):
    why = rules.why_not_better_head_to_head(versus, 0.05, significant)
    assert why == says if says is None else (why is not None and says in why), why


def _shape(shape: str, dtype: str, speedup: float, ci: tuple[float, float]) -> ShapeSpeedup:
    return ShapeSpeedup(shape=shape, dtype=dtype, baseline_us=100.0, candidate_us=100.0 / speedup, speedup=speedup,
                        ci_low=ci[0], ci_high=ci[1])  # fmt: skip


def test_a_held_out_regression_the_search_shapes_foretold_is_not_an_overfit():
    """#29: the best was 0.965x at float16 on the search shapes (kept inside the noise floor); a held-out
    float16 shape slower than the baseline is no news about held-out shapes. A float32 one is."""
    search = [_shape("T=4096,D=1024", "float16", 0.965, (0.95, 0.98)),
              _shape("T=4096,D=1024", "float32", 1.40, (1.35, 1.45))]  # fmt: skip
    slow16 = _shape("T=51,D=1375", "float16", 0.90, (0.88, 0.92))
    slow32 = _shape("T=51,D=1375", "float32", 0.90, (0.88, 0.92))
    fine = _shape("T=7,D=99", "float32", 1.2, (1.1, 1.3))
    assert rules.held_out_overfit([slow16, fine], True, search) == (False, [], ["T=51,D=1375 float16"])
    assert rules.held_out_overfit([slow16, slow32], True, search) == (
        True, ["T=51,D=1375 float32"], ["T=51,D=1375 float16"])
    # Slower over all the held-out shapes with no one shape beyond the limit: an overfit, as before.
    assert rules.held_out_overfit([fine], True, search[1:]) == (True, [], [])
    assert rules.held_out_overfit([fine], False, search) == (False, [], [])


def test_a_step_starts_only_where_the_budget_has_room_for_it():
    wall, gpu = Budgets(max_wall_time_s=100), Budgets(max_gpu_seconds=50)
    used = Usage(device_seconds=40)
    assert rules.no_room(wall, used, 80, 15, 5, "round 4") is None
    why = rules.no_room(wall, used, 90, 15, 5, "round 4")
    assert why.startswith("wall-time budget: round 4 (~15 s, as the last took) would end past it (10 s of 100 s")
    assert rules.no_room(gpu, used, 90, 15, 5, "the held-out step") is None
    assert rules.no_room(gpu, used, 90, 15, 11, "the held-out step").startswith("device-time budget: the held-out step")
    # Nothing known of the step (the first round), or no budget: no reason to stop.
    assert rules.no_room(wall, used, 99, None, None, "round 1") is None
    assert rules.no_room(Budgets(), used, 1e9, 1e9, 1e9, "round 9") is None


@pytest.mark.parametrize("speedup, best, refused", [
    (1.05, 1.10, True),  # below the best against the baseline: no head-to-head
    (1.10, 1.10, True),  # level with it
    (1.105, 1.10, True),  # above it by less than half the minimum gain (1 % of 2 %)
    (1.115, 1.10, False),  # above it by more, if by less than min-gain: the head-to-head decides
])  # fmt: skip
def test_an_asynchronous_slots_candidate_gets_a_head_to_head_only_above_the_best(speedup, best, refused):
    why = rules.why_no_head_to_head(speedup, best, 0.02)
    assert (why is not None) == refused
    if refused:
        assert why.startswith("not the new best") and f"{speedup:.3f}x" in why and "no head-to-head" in why
        assert "half the minimum gain (1%" in why
