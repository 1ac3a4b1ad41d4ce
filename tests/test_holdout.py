"""Held-out validation: after the last round the best is tested and timed on shapes the search never
saw, and a best that wins on the search shapes but loses on the held-out ones is flagged as overfit
(tests/fixtures/tradeoff searched at N=1024 only: MODE 1 wins there and is slower at N=8192)."""

from __future__ import annotations

import asyncio
import shutil
import uuid

import pytest

from frontend.history import load_run
from frontend.report import build_report, render_markdown
from frontend.runs import prepare_request
from kopt import queues
from kopt.holdout import holdout_shapes
from kopt.models import Shape
from kopt.package import load_spec
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO, cpu_cluster

TRADEOFF = REPO / "tests" / "fixtures" / "tradeoff"
SILU = REPO / "kernels" / "silu_and_mul"


def test_derived_shapes_are_new_fit_and_follow_the_seed():
    spec = load_spec(SILU)
    sets = spec.shapes["cpu"]
    sets.holdout = []  # as if the package declared no holdout list for the CPU (its CUDA list stays)
    known = {tuple(sorted(s.dims.items())) for s in [*sets.test, *sets.bench]}
    largest = max(s.dims["T"] * s.dims["D"] for s in sets.bench)
    drawn = {seed: holdout_shapes(spec, "cpu", seed, 3) for seed in range(20)}
    for shapes in drawn.values():
        assert len(shapes) == 3 and len({tuple(sorted(s.dims.items())) for s in shapes}) == 3
        for s in shapes:
            assert set(s.dims) == {"T", "D"} and tuple(sorted(s.dims.items())) not in known
            assert 1 <= s.dims["T"] * s.dims["D"] <= largest
    assert holdout_shapes(spec, "cpu", 7, 3) == drawn[7]  # the seed decides
    assert len({tuple(tuple(sorted(s.dims.items())) for s in v) for v in drawn.values()}) > 15
    assert holdout_shapes(spec, "cpu", 7, 0) == []
    assert [s.label for s in holdout_shapes(spec, "cuda", 7, 2)] == ["T=1,D=11008", "T=777,D=3420"]  # declared


def test_declared_holdout_shapes_are_used_as_declared(tmp_path):
    pkg = tmp_path / "tradeoff"
    shutil.copytree(TRADEOFF, pkg)
    toml = pkg / "kernel.toml"
    toml.write_text(toml.read_text().replace("bench = [{ N = 1024 }, { N = 8192 }]",
                                             "bench = [{ N = 1024 }]\nholdout = [{ N = 8192 }, { N = 3000 }]"))
    spec = load_spec(pkg)
    assert holdout_shapes(spec, "cpu", 1, 2) == [Shape(dims={"N": 8192}), Shape(dims={"N": 3000})]
    toml.write_text(toml.read_text().replace("{ N = 3000 }", "{ M = 3000 }"))
    with pytest.raises(ValueError, match=r"field 'shapes.cpu.holdout.1': missing symbols \['N'\]"):
        load_spec(pkg)


@pytest.mark.slow
# Its verdict is an A/B interval ("slower" at N=8192): beside the parallel phase's busy workers it came out
# "same" in fresh-clone runs, so the serial phase runs it on a quiet machine.
@pytest.mark.serial
def test_a_best_that_loses_on_held_out_shapes_is_flagged_overfit(temporal_server, kopt_home, tmp_path):
    pkg = tmp_path / "tradeoff"
    shutil.copytree(TRADEOFF, pkg)
    toml = pkg / "kernel.toml"
    toml.write_text(toml.read_text().replace("bench = [{ N = 1024 }, { N = 8192 }]",
                                             "bench = [{ N = 1024 }]\nholdout = [{ N = 8192 }]"))
    settings = Settings()
    req = prepare_request(pkg, "cpu", None, 1, "offline", 0, settings)
    req = req.model_copy(update={"holdout_shapes": holdout_shapes(req.package.spec, "cpu", 0, 2),
                                 "time_cap_s": 0.5})

    async def run():
        async with cpu_cluster(temporal_server.address, settings) as client:
            wf = f"holdout-{uuid.uuid4()}"
            result = await client.execute_workflow(queues.WORKFLOW_NAME, req, id=wf, task_queue=queues.WORKFLOW_QUEUE,
                                                   result_type=OptimizeResult)  # fmt: skip
            return result, await load_run(client, wf)

    result, view = asyncio.run(run())
    assert result.best.tunables == {"MODE": 1} and result.best.speedup_geomean > 2, [(r.description, r.speedup_geomean, r.failure) for r in result.rounds]
    h = result.holdout
    assert h is not None and h.candidate_id == result.best.candidate_id and h.shapes == ["N=8192"]
    assert h.correct and h.verdict == "slower" and h.overfit and h.regressions == ["N=8192 float32"]
    assert h.speedup_geomean < 0.8 and h.search_speedup == result.best.speedup_geomean
    # The search never timed the held-out shape; the history's rounds leave the held-out calls out.
    assert all(s.shape != "N=8192" for r in result.rounds for s in r.per_shape)
    assert [r.round for r in view.rounds] == [0, 1]
    report = build_report("r", "t", req, result, None)
    assert report.holdout.overfit
    text = render_markdown(report, "kernel.cpp")
    assert "## Held-out shapes (N=8192)" in text and "OVERFIT" in text and "slower than the baseline at N=8192" in text


def test_the_report_tells_a_foretold_held_out_regression_from_an_overfit():
    from frontend.report import holdout_lines
    from kopt.run_models import HoldoutResult

    h = HoldoutResult(candidate_id="c", shapes=["T=51,D=1375"], correct=True, regressions=["T=51,D=1375 float16"],
                      foretold=["T=51,D=1375 float16"], speedup_geomean=0.95, verdict="slower")  # fmt: skip
    text = "\n".join(holdout_lines(h))
    assert "OVERFIT" not in text and "Slower than the baseline at T=51,D=1375 float16" in text
    h = h.model_copy(update={"overfit": True, "regressions": ["T=51,D=1375 float16", "T=51,D=1375 float32"]})
    text = "\n".join(holdout_lines(h))
    assert "**OVERFIT: the best wins on the search shapes but is slower than the baseline at T=51,D=1375 float32.**" \
        in text and "Slower than the baseline at T=51,D=1375 float16, in a dtype" in text


def test_the_sol_chart_takes_the_baselines_figure_from_the_same_ab_as_the_best():
    """#29 item 6: the %SOL chart showed the best below the baseline where the speedup chart showed it above:
    the baseline's %SOL came from round 0's profile, the best's from its own A/B. Now both from the A/B."""
    from frontend.report import baseline_sol
    from kopt.models import ShapeSpeedup, ShapeTiming

    round_zero = [ShapeTiming(shape="T=4", dtype="float16", mode="hot-cpu", median_us=80.0, p10_us=79.0, p90_us=81.0,
                              samples=10, gbytes_per_s=1.0, pct_sol=50.0),
                  ShapeTiming(shape="T=8", dtype="float16", mode="hot-cpu", median_us=80.0, p10_us=79.0, p90_us=81.0,
                              samples=10, gbytes_per_s=1.0, pct_sol=40.0)]  # fmt: skip
    best = [ShapeSpeedup(shape="T=4", dtype="float16", baseline_us=110.0, candidate_us=100.0, speedup=1.1,
                         pct_sol=44.0)]  # fmt: skip
    sol = baseline_sol(best, round_zero)
    assert sol["T=4 float16"] == pytest.approx(40.0) and sol["T=4 float16"] < best[0].pct_sol
    assert sol["T=8 float16"] == 40.0  # no A/B there: round 0's figure
