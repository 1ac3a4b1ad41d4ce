"""Shape-specialized libraries (kopt.dispatch): the generated source builds with kopt's compile
command, each bucket's copy answers on its side of every edge, kernel.toml's [dispatch] is checked,
and a run whose candidates win different buckets keeps one library that dispatches."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid

import pytest
import torch

from frontend.report import build_report, render_markdown
from frontend.runs import prepare_request
from kopt import queues
from kopt.dispatch import bucket_labels, bucket_of, choose, edge_shapes, interior_shapes, specialized_source
from kopt.models import Dispatch, KernelSpec, Shape, ShapeSpeedup
from kopt.package import PackageError, load_spec, read_tunables
from kopt.run_models import OptimizeResult
from kopt.settings import Settings
from tests.conftest import REPO, compile_all, cpu_cluster

TRADEOFF = REPO / "tests" / "fixtures" / "tradeoff"

# Every copy writes its TAG to out[0]; the helper, the static counter and the second macro exist in
# every copy and must neither collide nor leak from one copy into the next.
TAGGED = """\
#include <stdint.h>

#include "kopt_abi.h"

#define TAG 0
#define SCALE 2.0f

static int calls = 0;
static float twice(float v) { return SCALE * v; }

KOPT_EXPORT int kopt_tagged(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (nargs != 2 || args[0].ndim != 1) return KOPT_ERR_ARGS;
  const float *x = (const float *)args[0].data;
  float *out = (float *)args[1].data;
  for (int64_t i = 0; i < args[0].shape[0]; ++i) out[i] = twice(x[i]);
  out[0] = (float)(TAG * 1000 + ++calls);
  return KOPT_OK;
}
"""


def tagged_spec() -> KernelSpec:
    return KernelSpec.model_validate({
        "name": "tagged", "entry": "kopt_tagged", "targets": ["cpu"], "dtypes": ["float32"],
        "sources": {"cpu": "kernel.cpp"}, "model": {"bytes": "2*N*elem"},
        "arguments": [{"name": "x", "role": "in", "shape": ["N"]}, {"name": "out", "role": "out", "shape": ["N"]}],
        "tunables": [{"name": "TAG", "target": "cpu", "values": [0, 1, 2, 3]}],
        "shapes": {"cpu": {"test": [{"dims": {"N": 3}}], "bench": [{"dims": {"N": 8}}]}},
        "dispatch": {"cpu": {"symbol": "N", "edges": [16, 256]}},
    })  # fmt: skip


def test_each_bucket_s_copy_answers_on_its_side_of_every_edge(tmp_path):
    from gpu_worker.abi import Kernel, Packed

    spec = tagged_spec()
    dispatch = spec.dispatch["cpu"]
    settings = [{"TAG": 1}, {"TAG": 2}, {"TAG": 1}]  # the first and last bucket share one copy
    source = specialized_source(spec, TAGGED, dispatch, settings)
    assert "namespace kopt_bucket1 {" in source and "namespace kopt_bucket2 {" not in source
    assert source.count("#include") == 2  # hoisted once, not repeated in the copies
    (tmp_path / "kernel.cpp").write_text(source)
    lib = compile_all("cpu", {"tagged": tmp_path / "kernel.cpp"}, tmp_path)["tagged"]
    kernel = Kernel(str(lib), "kopt_tagged", None)
    calls = {1: 0, 2: 0}
    for n in (1, 16, 17, 256, 257, 5000):
        tag = settings[bucket_of(dispatch, n)]["TAG"]
        calls[tag] += 1
        x, out = torch.arange(n, dtype=torch.float32), torch.full((n,), -1.0)
        assert kernel(Packed([x, out])) == 0
        assert out[0].item() == tag * 1000 + calls[tag], n  # each copy counts its own calls
        assert torch.equal(out[1:], 2 * x[1:])
    assert kernel(Packed([torch.zeros(4)])) == 1  # one argument: the last bucket's copy says KOPT_ERR_ARGS
    assert [s.dims["N"] for s in edge_shapes(spec, "cpu", dispatch)] == [16, 17, 256, 257]
    assert bucket_labels(dispatch) == ["N <= 16", "16 < N <= 256", "N > 256"]


def test_a_source_the_step_cannot_use_raises_package_error_which_the_workflow_reports():
    spec, dispatch = tagged_spec(), tagged_spec().dispatch["cpu"]
    with pytest.raises(PackageError, match="TAG"):  # an LLM-written best without the tunable's #define
        specialized_source(spec, TAGGED.replace("#define TAG 0", ""), dispatch, [{"TAG": 1}, {"TAG": 2}, {"TAG": 3}])
    bulky = TAGGED + "// padding\n" * 20_000  # ~240 KiB: three copies exceed what a candidate may carry
    with pytest.raises(PackageError, match="KiB"):
        specialized_source(spec, bulky, dispatch, [{"TAG": 1}, {"TAG": 2}, {"TAG": 3}])


# The red team's probes (2026-11-23): a source that behaves differently once it is a copy in a
# specialized library could be wrong only there, between the shapes the library is tested at.
SEES_THE_MACRO = TAGGED.replace("#define TAG 0", "#define TAG 0\n#ifdef kopt_tagged\n#define SEEN 1\n#else\n#define SEEN 0\n#endif").replace(
    "out[0] = (float)(TAG * 1000 + ++calls);", "out[0] = (float)(TAG * 1000 + ++calls + SEEN * 100000);")


def test_a_copy_cannot_tell_by_the_entry_name_that_it_is_a_copy(tmp_path):
    """The entry is renamed in the text, not by a macro: `#ifdef ENTRY` is false in every copy, as in
    the candidate that was measured (it was true when a macro did the renaming)."""
    from gpu_worker.abi import Kernel, Packed

    spec, dispatch = tagged_spec(), tagged_spec().dispatch["cpu"]
    source = specialized_source(spec, SEES_THE_MACRO, dispatch, [{"TAG": 1}, {"TAG": 2}, {"TAG": 3}])
    (tmp_path / "kernel.cpp").write_text(source)
    kernel = Kernel(str(compile_all("cpu", {"k": tmp_path / "kernel.cpp"}, tmp_path)["k"]), "kopt_tagged", None)
    for n, tag in ((5, 1), (100, 2), (1000, 3)):
        x, out = torch.ones(n), torch.zeros(n)
        assert kernel(Packed([x, out])) == 0 and out[0].item() == tag * 1000 + 1, n


@pytest.mark.parametrize("probe", ["__PRETTY_FUNCTION__", "__func__", "__COUNTER__", "__LINE__",
                                   "__builtin_FUNCTION()", "__attribute__((weak))", "kopt_bucket0"])
def test_a_source_that_could_observe_where_it_is_compiled_is_not_specialized(probe):
    spec, dispatch = tagged_spec(), tagged_spec().dispatch["cpu"]
    source = TAGGED.replace("static int calls = 0;", f"static int calls = 0;  // {probe}")
    with pytest.raises(PackageError, match="could tell it is not the candidate"):
        specialized_source(spec, source, dispatch, [{"TAG": 1}, {"TAG": 2}, {"TAG": 3}])


def test_interior_shapes_fall_strictly_inside_each_bucket_and_follow_the_seed():
    spec = tagged_spec()
    dispatch = spec.dispatch["cpu"]  # N <= 16, 16 < N <= 256, N > 256
    for seed in range(20):
        values = [s.dims["N"] for s in interior_shapes(spec, "cpu", dispatch, seed)]
        assert len(values) == 3 and 1 < values[0] < 16 and 17 < values[1] < 256 and 257 < values[2] < 4 * 257
        assert values == [s.dims["N"] for s in interior_shapes(spec, "cpu", dispatch, seed)]
    assert len({tuple(s.dims["N"] for s in interior_shapes(spec, "cpu", dispatch, k)) for k in range(20)}) > 5


def _speedups(values: dict[str, float]) -> list[ShapeSpeedup]:
    return [ShapeSpeedup(shape=k, dtype="float32", baseline_us=1.0, candidate_us=1 / v, speedup=v)
            for k, v in values.items()]


def test_choose_takes_per_bucket_the_fastest_option_and_needs_every_bucket_timed():
    dispatch = Dispatch(symbol="N", edges=[100])
    shapes = [Shape(dims={"N": n}) for n in (10, 50, 1000)]
    best = ({"M": 0}, _speedups({"N=10": 1.0, "N=50": 1.0, "N=1000": 1.2}))
    small = ({"M": 1}, _speedups({"N=10": 3.0, "N=50": 0.9, "N=1000": 0.5}))  # wins the geomean of N <= 100
    partial = ({"M": 2}, _speedups({"N=10": 9.0}))  # not measured at N=50: out of the running there
    assert choose(dispatch, shapes, [best, small, partial]) == [1, 0]
    assert choose(dispatch, shapes, [best, best]) == [0, 0]  # a tie goes to the earlier option
    assert choose(dispatch, [Shape(dims={"N": 10})], [best, small]) is None  # N > 100 has no timed shape


@pytest.mark.parametrize("dispatch, field, says", [
    ('symbol = "M"\nedges = [10]', "dispatch.cpu.symbol", "no argument has a dimension that is exactly 'M'"),
    ('symbol = "N"\nedges = [100, 10]', "dispatch.cpu.edges", "ascending integers >= 1"),
    ('symbol = "N"\nedges = []', "dispatch.cpu.edges", "at least 1 item"),
])  # fmt: skip
def test_kernel_toml_dispatch_errors_name_the_field(tmp_path, dispatch, field, says):
    pkg = _with_dispatch(tmp_path, dispatch)
    with pytest.raises(PackageError) as err:
        load_spec(pkg)
    assert f"field '{field}'" in str(err.value) and says in str(err.value) and "kernel.toml" in str(err.value)


def _with_dispatch(tmp_path, body: str):
    pkg = tmp_path / "tradeoff"
    shutil.copytree(TRADEOFF, pkg)
    with open(pkg / "kernel.toml", "a") as f:
        f.write(f"\n[dispatch.cpu]\n{body}\n")
    return pkg


def _run_offline(server, pkg, rounds: int = 1, **update):
    settings = Settings()
    # MODE's effects (~16x faster, ~1.5x slower) are far from every threshold: half a second of sampling
    # a side (the default is 2 s) decides them on a loaded machine too.
    req = prepare_request(pkg, "cpu", None, rounds, "offline", 0, settings).model_copy(
        update={"time_cap_s": 0.5, **update})

    async def run():
        async with cpu_cluster(server.address, settings) as client:
            return await client.execute_workflow(queues.WORKFLOW_NAME, req, id=f"dispatch-{uuid.uuid4()}",
                                                 task_queue=queues.WORKFLOW_QUEUE, result_type=OptimizeResult)

    return req, asyncio.run(run())


@pytest.mark.slow
@pytest.mark.serial  # which setting serves a bucket, and the best, follow measured speedups (decision 0024)
def test_a_setting_wrong_only_where_its_bucket_ends_is_caught_at_the_edge(temporal_server, kopt_home, tmp_path):
    """The candidate that would beat a dispatch tested only at the package's shapes: MODE 1 is wrong at
    N = 4095 alone, a size no search shape or derived edge shape hits, so the search measures it as
    correct; in the specialized library it serves N <= 4095, and the edge shapes catch it there."""
    pkg = _with_dispatch(tmp_path, 'symbol = "N"\nedges = [4095]')
    kernel = pkg / "kernel.cpp"
    text = kernel.read_text()
    assert text.count("  return KOPT_OK;") == 1
    kernel.write_text(text.replace("  return KOPT_OK;", "  if (MODE && n == 4095) out[n - 1] += 1.0f;\n  return KOPT_OK;"))
    req, result = _run_offline(temporal_server, pkg)
    (mode1,) = [r for r in result.rounds if r.tunables.get("MODE") == 1]
    assert mode1.correct  # the search never saw N = 4095
    sp = result.specialized
    # (in the parallel phase it once chose MODE 0 for both buckets, and once kept MODE 1 as the best: the
    # record of MODE 1 says what its profile measured)
    assert sp.settings == [{"MODE": 1}, {"MODE": 0}] and "N=4095" in sp.tested, (sp, mode1)
    assert not sp.correct and not sp.accepted and "N=4095" in sp.reason, sp.reason
    assert result.best.candidate_id == req.baseline.id


@pytest.mark.slow
@pytest.mark.serial  # judges measured speedups against thresholds (decision 0024)
def test_a_run_keeps_one_library_with_the_fastest_values_of_each_bucket(temporal_server, kopt_home, tmp_path):
    """tradeoff: MODE 1 is ~16x faster below N = 4096 and ~1.5x slower above, so the search alone keeps
    the baseline (the shape guard refuses MODE 1); with buckets at 4095 the run keeps MODE 1 for the small
    calls and MODE 0 for the large ones, in one library, correct at N = 4095 and 4096."""
    pkg = _with_dispatch(tmp_path, 'symbol = "N"\nedges = [4095]')
    req, result = _run_offline(temporal_server, pkg)
    (mode1,) = [r for r in result.rounds if r.tunables.get("MODE") == 1]
    assert mode1.regressions == ["N=8192 float32"] and not mode1.accepted
    sp = result.specialized
    assert sp is not None and sp.buckets == ["N <= 4095", "N > 4095"]
    assert sp.settings == [{"MODE": 1}, {"MODE": 0}]
    assert sp.picked_from == [mode1.candidate_id, req.baseline.id]
    assert sp.correct and sp.accepted and not sp.regressions, sp.reason
    # N = 1024 measured 3.7x to 5x on the 2-core CI VM (the harness's round trip compresses MODE 1's ~16x),
    # N = 8192 ~1x: a geomean of ~1.9 to 2.2 where the search alone kept the baseline (1x).
    assert result.best.candidate_id == sp.candidate_id and result.best.speedup_geomean > 1.5
    speed = {s.shape: s.speedup for s in result.best.per_shape}
    assert speed["N=1024"] > 3 and 0.9 < speed["N=8192"] < 1.1
    assert "namespace kopt_bucket1" in result.best.source
    edges = {s.label for s in edge_shapes(load_spec(pkg), "cpu", load_spec(pkg).dispatch["cpu"])}
    assert edges == {"N=4095", "N=4096"} and edges <= set(sp.tested)  # both copies checked where they switch
    report = build_report("r", "t", req, result, None)
    assert report.specialized.accepted
    written = json.loads(report.to_json())
    assert written["specialized"]["accepted"] and "source" not in written["best"]
    markdown = render_markdown(report, "kernel.cpp")
    assert "kept as the best" in markdown and f"## Best: `{sp.candidate_id}` (shape-specialized)" in markdown


ASTRA = ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"]


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_astra_sources_build_as_shape_specialized_libraries(tmp_path, target):
    """Every Astra kernel's source, in two copies with different values of each tunable, builds with
    kopt's compile command (g++ or nvcc): templates, kernels, constants and helpers in namespaces."""
    sources = {}
    for name in ASTRA:
        spec = load_spec(REPO / "kernels" / name)
        base = (REPO / "kernels" / name / spec.sources[target]).read_text()
        symbol = spec.arguments[0].shape[0]  # the token count: a plain first dimension in all three
        changed = {t.name: next(v for v in t.values if v != read_tunables(base, [t.name])[t.name])
                   for t in spec.tunables_for(target)}  # fmt: skip
        source = specialized_source(spec, base, Dispatch(symbol=symbol, edges=[64]), [changed, {}])
        sources[name] = tmp_path / f"{name}{'.cu' if target == 'cuda' else '.cpp'}"
        sources[name].write_text(source)
    compile_all(target, sources, tmp_path, ["-O2"])


@pytest.mark.slow
@pytest.mark.serial  # judges measured bucket gains against thresholds (decision 0024)
def test_a_bucket_win_the_weighted_objective_hides_is_kept(temporal_server, kopt_home, tmp_path):
    """A workload whose time is mostly large calls: MODE 1 for N <= 4095 makes the small calls ~16x
    faster, which moves the workload-weighted objective by ~1.3x, under a min_gain of 50 %. The bucket
    rule keeps it: one bucket faster by more than min_gain, none slower by as much, objective no lower."""
    pkg = _with_dispatch(tmp_path, 'symbol = "N"\nedges = [4095]')
    workload = [Shape(dims={"N": 1024}, weight=0.72), Shape(dims={"N": 8192}, weight=0.28)]
    req, result = _run_offline(temporal_server, pkg, workload=workload, min_gain=0.5)
    sp = result.specialized
    assert sp.settings == [{"MODE": 1}, {"MODE": 0}] and sp.correct, sp.reason
    assert 1.0 <= sp.speedup_geomean < 1 + req.min_gain  # the objective alone would refuse it
    # The small calls' bucket gains far more than min_gain (MODE 1 is ~16x faster there; the harness's
    # round trip compresses the ratio at N = 1024: 3.9x to 5x measured on the 2-core CI VM).
    assert sp.bucket_gains[0] > 2 * (1 + req.min_gain) and sp.bucket_gains[1] * (1 + req.min_gain) >= 1
    assert sp.accepted and result.best.candidate_id == sp.candidate_id, sp.reason
