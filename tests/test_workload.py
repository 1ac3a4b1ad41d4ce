"""Workloads: weighted shapes from TOML families or a CSV, a workload CSV from a real torch profiler
trace, the workload-weighted objective in the judge, and a run whose decision it changes (the
tradeoff fixture: MODE 1 wins the geomean of N=1024 and N=8192, and loses their summed time)."""

from __future__ import annotations

import asyncio
import re
import shutil
import uuid

import pytest
import torch

from frontend.runs import prepare_request
from gpu_worker import stats
from kopt import queues
from kopt.holdout import split_workload
from kopt.package import load_spec
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from kopt.workload import WorkloadError, load_workload, shapes_from_trace, write_csv
from tests.conftest import REPO, cpu_cluster

SILU = REPO / "kernels" / "silu_and_mul"
TRADEOFF = REPO / "tests" / "fixtures" / "tradeoff"


def test_toml_families_and_shapes_become_normalised_weights(tmp_path):
    f = tmp_path / "w.toml"
    f.write_text("""
[[shape]]          # decode: 1-64 tokens
weight = 60
T = { from = 1, to = 64, points = 4 }
D = 11008

[[shape]]
weight = 40
T = 777
D = 3420

[[shape]]          # the same shape again: weights add up
weight = 20
T = 777
D = 3420
""")
    shapes = load_workload(f, load_spec(SILU))
    weights = {s.label: s.weight for s in shapes}
    assert set(weights) == {"D=11008,T=1", "D=11008,T=4", "D=11008,T=16", "D=11008,T=64", "D=3420,T=777"}
    assert weights["D=3420,T=777"] == pytest.approx(60 / 120) and weights["D=11008,T=4"] == pytest.approx(15 / 120)
    assert sum(weights.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("text, suffix, message", [
    ("[[shape]]\nweight = 1\nT = 3\n", ".toml", r"shape 1: missing symbols \['D'\]"),
    ("[[shape]]\nweight = 1\nT = 3\nD = 8\nQ = 2\n", ".toml", r"shape 1: unknown symbols \['Q'\]"),
    ("[[shape]]\nweight = 0\nT = 3\nD = 8\n", ".toml", "shape 1: 'weight' must be a positive number"),
    ("[[shape]]\nweight = 1\nT = { from = 9, to = 2 }\nD = 8\n", ".toml", "shape 1: T: a range needs"),
    ("T,D\n1,8\n", ".csv", "the header needs a 'count'"),
    ("T,D,count\n1,x,3\n", ".csv", "row 2: every value must be a number"),
])  # fmt: skip
def test_workload_mistakes_name_file_and_entry(tmp_path, text, suffix, message):
    f = tmp_path / f"w{suffix}"
    f.write_text(text)
    with pytest.raises(WorkloadError, match=f"{f.name}: {message}"):
        load_workload(f, load_spec(SILU))


def test_a_workload_csv_from_a_real_profiler_trace(tmp_path):
    """A custom op called at the shapes a model would use, recorded by torch.profiler with shapes;
    its calls are counted by shape, the symbols solved from the dims (x is [T, 2*D])."""
    lib = torch.library.Library("kopttest", "FRAGMENT")
    lib.define("silu_and_mul(Tensor x, Tensor(a!) out) -> ()")

    def impl(x, out):
        d = x.shape[-1] // 2
        out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])

    lib.impl("silu_and_mul", impl, "CPU")
    calls = [(1, 64)] * 5 + [(7, 64)] * 2 + [(3, 96)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for t, d in calls:
            torch.ops.kopttest.silu_and_mul(torch.randn(t, 2 * d), torch.empty(t, d))
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    spec = load_spec(SILU)
    counts = shapes_from_trace(trace, "kopttest::silu_and_mul", spec)
    assert dict(counts) == {(("D", 64), ("T", 1)): 5, (("D", 64), ("T", 7)): 2, (("D", 96), ("T", 3)): 1}
    out = write_csv(counts, spec, tmp_path / "w.csv")
    shapes = load_workload(out, spec)
    assert [(s.label, round(s.weight, 3)) for s in shapes] == [("D=64,T=1", 0.625), ("D=64,T=7", 0.25),
                                                              ("D=96,T=3", 0.125)]  # fmt: skip
    with pytest.raises(WorkloadError, match="no calls of 'kopttest::nope'"):
        shapes_from_trace(trace, "kopttest::nope", spec)


def test_the_weighted_objective_counts_time_not_ratios():
    """A 2x win on a 10 us shape and a 2x loss on a 1000 us one, equally weighted: the geomean says
    1.0, the time the workload spends says 0.53."""
    win = stats.Ratio.from_interval(2.0, 1.98, 2.02, seed=1)
    loss = stats.Ratio.from_interval(0.5, 0.495, 0.505, seed=2)
    point, low, high = stats.weighted_time_interval([win, loss], [10.0, 1000.0], [0.5, 0.5])
    assert point == pytest.approx((10 + 1000) / (5 + 2000)) and low < point < high and high < 0.52
    assert stats.geomean_interval([win, loss])[0] == pytest.approx(1.0)
    # Weighted to the small shape instead, the win counts.
    assert stats.weighted_time_interval([win, loss], [10.0, 1000.0], [0.999, 0.001])[0] > 1.3


def test_held_out_shapes_of_a_workload_stay_out_of_the_search(tmp_path):
    f = tmp_path / "w.csv"
    f.write_text("T,D,count\n" + "".join(f"{t},128,{t}\n" for t in (1, 2, 4, 8, 16, 32, 64)))
    shapes = load_workload(f, load_spec(SILU))
    search, held = split_workload(shapes, seed=3, count=2)
    assert len(held) == 2 and len(search) == 5 and not {s.label for s in held} & {s.label for s in search}
    assert split_workload(shapes, seed=3, count=2) == (search, held)
    assert split_workload(shapes[:2], seed=3, count=2) == (shapes[:2], [])  # too few to spare any


@pytest.mark.slow
def test_the_workload_objective_decides_the_best(temporal_server, kopt_home, tmp_path):
    pkg = tmp_path / "tradeoff"
    shutil.copytree(TRADEOFF, pkg)
    wl = tmp_path / "w.csv"
    wl.write_text("N,count\n1024,1\n8192,1\n")
    settings = Settings()
    req = prepare_request(pkg, "cpu", None, 1, "offline", 0, settings)
    req = req.model_copy(update={"workload": load_workload(wl, req.package.spec), "time_cap_s": 0.5})

    async def run():
        async with cpu_cluster(temporal_server.address, settings) as client:
            return await client.execute_workflow(queues.WORKFLOW_NAME, req, id=f"wl-{uuid.uuid4()}",
                                                 task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)

    result = asyncio.run(run())
    mode1 = next(r for r in result.rounds if r.tunables.get("MODE") == 1)
    per = {s.shape: s.speedup for s in mode1.per_shape}
    assert per["N=1024"] > 2 and per["N=8192"] < 0.8  # a geomean win ...
    assert (per["N=1024"] * per["N=8192"]) ** 0.5 > 1.1
    assert mode1.speedup_geomean < 0.8 and not mode1.accepted  # ... that the workload's time refuses
    assert result.best.candidate_id == req.baseline.id


def _run_request(tmp_path, kernel_dir, *options: str):
    from frontend.cli import _parser
    from frontend.runs import apply_run_options

    settings = Settings(home=tmp_path / "home", temporal_address="127.0.0.1:1")  # workers elsewhere: no GPU query
    args = _parser().parse_args(["optimize", str(kernel_dir), "--target", "cuda", *options])
    req = prepare_request(args.kernel_dir, args.target, "h100", 1, "offline", 0, settings)
    return apply_run_options(req, args, settings)


@pytest.mark.parametrize("kernel", ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"])
def test_a_cuda_run_of_an_astra_package_optimizes_the_workload_it_serves(tmp_path, kernel):
    from frontend.runs import objective_line

    pkg = REPO / "kernels" / kernel
    req = _run_request(tmp_path, pkg)
    search, held = split_workload(load_workload(pkg / "serving.toml", req.package.spec), 0, 2)
    assert req.workload == search and req.holdout_shapes == held
    assert any(min(s.dims.values()) == 1 for s in req.workload + held)  # a decode step of one token
    assert objective_line(req).startswith(f"workload-weighted time over {len(search)} shapes, 2 more held out")
    bench = _run_request(tmp_path, pkg, "--workload", "bench")  # the bench shapes' geomean, on request
    assert bench.workload == [] and objective_line(bench).startswith("geomean speedup over the ")
    cpu = prepare_request(pkg, "cpu", None, 1, "offline", 0, Settings(home=tmp_path / "home"))
    assert "cpu" not in cpu.package.spec.workloads  # a CPU run keeps the bench shapes


WORKLOAD_MISTAKES = {'cuda = "nope.toml"': "field 'workloads.cuda': workload file ",
                     'cuda = "../kernel.toml"': "'../kernel.toml' is outside the package folder",
                     'rocm = "serving.toml"': "workloads"}  # fmt: skip


def test_a_packages_workload_mistake_names_the_field(tmp_path):
    from kopt.package import PackageError

    declared = (SILU / "kernel.toml").read_text()
    for i, (entry, message) in enumerate(WORKLOAD_MISTAKES.items()):
        pkg = shutil.copytree(SILU, tmp_path / f"silu-{i}")
        (pkg / "kernel.toml").write_text(declared.replace('cuda = "serving.toml"', entry))
        with pytest.raises(PackageError, match=re.escape(message)):
            load_spec(pkg)


def test_an_invalid_entry_in_a_packages_workload_stops_the_run_that_takes_it(tmp_path):
    from kopt.errors import UsageError

    pkg = tmp_path / "silu"
    shutil.copytree(SILU, pkg)
    (pkg / "serving.toml").write_text("[[shape]]\nweight = 1\nT = 4\n")  # D missing
    with pytest.raises(UsageError, match=re.escape("missing symbols ['D'] (the package's shape symbols are "
                                                   "['D', 'T']) (kernel.toml [workloads] names it)")):
        _run_request(tmp_path, pkg)
    assert _run_request(tmp_path, pkg, "--workload", "bench").workload == []
