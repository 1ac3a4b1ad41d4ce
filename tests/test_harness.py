"""The isolated harness on the CPU target: contracts of its parts, a correct baseline passes and is
timed, known-wrong kernels are rejected, hangs time out, cancellation kills the child.

Harness children are forked by the zygote (torch imported once), so a job costs ~0.3 s here; the
cheat corpus (test_cheats.py) covers the full list of known cheats.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import random
import subprocess
from pathlib import Path

import pytest

from gpu_worker import device, fuzz, plan, protocol, runner, spawn, static_checks
from gpu_worker.abi import KernelFailure
from kopt.models import ArtifactRef, ExecRequest, KernelSpec, PackageRef, Shape
from kopt.package import load_spec
from tests.conftest import compile_all

# Profiles (A/A timings, the judge's clock and idle checks) and a scheduler reading run alone (`serial`);
# the correctness, hang and cancel paths run beside other tests, as they do in a worker.

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCALE2 = FIXTURES / "scale2"
SILU = ROOT / "kernels" / "silu_and_mul"
NO_ARTIFACT = ArtifactRef(sha256="0" * 64, size=0, uri="file:///dev/null")

# wrong kernel -> substring its rejection reason must contain (hang.cpp has a test of its own)
WRONG = {
    "never_writes": "never written",
    "off_by_one": "mismatch",
    "writes_input": "crashed: SIGSEGV",  # inputs are read-only memory to a CPU kernel (decision 0054)
    "segfault": "crashed: SIGSEGV",
    "exits": "exited with code 0 without answering",
    "answers_once": "second call on the same buffers",
    "floods_stdout": "wrote more than 64 MiB",
}


@pytest.fixture(scope="session")
def libs(tmp_path_factory) -> dict[str, Path]:
    """Every fixture library, compiled in parallel with the project's own g++ command line."""
    sources = {"scale2": SCALE2 / "kernel.cpp"}
    sources |= {name: FIXTURES / "wrong" / f"{name}.cpp" for name in [*WRONG, "hang"]}
    sources["silu_and_mul"] = SILU / "kernel.cpp"
    sources["chatty"] = FIXTURES / "chatty" / "kernel.cpp"
    return compile_all("cpu", sources, tmp_path_factory.mktemp("libs"))


@pytest.fixture(scope="session")
def scale2() -> KernelSpec:
    return load_spec(SCALE2)


def request(spec: KernelSpec, kind: str, dtypes: list[str], timeout_s: float = 120.0, **extra) -> ExecRequest:
    shapes = getattr(spec.shapes["cpu"], kind)
    return ExecRequest(
        package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}),
        target="cpu", candidate_id=f"{spec.name}-test", library=NO_ARTIFACT, shapes=shapes, dtypes=dtypes,
        seed=1234, timeout_s=timeout_s, time_cap_s=0.3, **extra,
    )  # fmt: skip


# ---------------------------------------------------------------- pure parts


def test_scale2_fixture_is_a_valid_package(scale2):
    assert scale2.entry == "kopt_scale2"
    assert [t.name for t in scale2.tunables_for("cpu")] == ["UNROLL"]
    assert [s.dims for s in scale2.shapes["cpu"].test] == [{"N": 1}, {"N": 17}, {"N": 4096}]


def test_edge_shapes_come_from_the_declared_ones():
    spec = load_spec(SILU)
    edges = plan.edge_shapes(spec, spec.shapes["cpu"].test, "cpu")
    # all ones, one symbol at a time 1 and then 2..8 (on the largest declared shape under the budget), primes
    small = [{"T": t, "D": 1000} for t in range(2, 7)] + [{"T": 7, "D": d} for d in range(2, 9)]
    assert edges == [{"T": 1, "D": 1}, {"T": 1, "D": 1000}, {"T": 7, "D": 1}, *small, {"T": 7, "D": 997}]
    assert all(plan.elements(spec, e) <= plan.EDGE_BUDGET["cpu"] for e in edges)
    groups = plan.test_plan(spec, "cpu", spec.shapes["cpu"].test, ["float16"], 2, True, False)
    assert [g.variant for g in groups[:3]] == ["", "x0.01", "x100"] and len(groups[0].cases) == 2
    planted = {f"planted:{k}" for k in plan.PLANTED_KINDS}
    fills = {f"fill:{f}" for f in plan.OUTPUT_FILLS}
    layouts = {f"layout:{lay}" for lay in plan.LAYOUTS + plan.EDGE_LAYOUTS if lay not in plan.LAYOUTS_3D}  # silu: 2-D
    fpenv = {plan.FPENV + m for m in plan.FP_ENVS if plan.FPENV_APPLIES}  # CPU, x86-64
    assert {g.variant for g in groups} == {"", "x0.01", "x100", "edge", "strided", "update", "repeat", "burst", *planted,
                                           *fills, *layouts, "dtype:float32", "dtype:bfloat16", "far:x",
                                           "far:out", *fpenv, plan.BATCHED}  # fmt: skip
    # The sequences, planted inputs, far rows and FTZ caller go to the largest declared shape under the edge budget.
    assert {g.label for g in groups if g.variant in ("update", "burst", "far:x", *planted, *fills, *fpenv,
                                                     plan.BATCHED)} == \
        {"T=7,D=1000"}
    assert plan.prime_at_most(4096) == 4093 and plan.next_prime(97) == 101


def test_frames_authenticate_and_detect_tampering():
    key = protocol.new_key()
    good = protocol.frame(key, 0, "progress", "step one") + protocol.frame(key, 1, "result", '{"x": 1}')
    reader = protocol.FrameReader(key=key)
    reader.feed(good[:7])
    reader.feed(good[7:])
    reader.close()
    assert (reader.tampered, reader.last_step, reader.result) == (None, "step one", '{"x": 1}')
    for bad in (
        b'{"candidate_id": "x", "correct": true}\n',  # plain fake JSON
        protocol.frame(protocol.new_key(), 0, "result", "{}"),  # another key
        protocol.frame(key, 0, "progress", "a") + protocol.frame(key, 0, "progress", "a"),  # replayed frame
    ):
        reader = protocol.FrameReader(key=key)
        reader.feed(bad)
        reader.close()
        assert reader.tampered and reader.result is None


def test_machine_code_placed_in_text_as_data_is_refused():
    # The red team's bypass: raw `syscall; ret` bytes in .text, called through a function pointer.
    code = """
    __attribute__((section(".text#"))) static const unsigned char blob[] = {0x48, 0x89, 0xf8, 0x0f, 0x05, 0xc3};
    [[gnu::section(".text")]] static const unsigned char blob2[] = {0xc3};
    KOPT_EXPORT int k(const kopt_tensor *a, int32_t n, void *s) { return ((long (*)(long))blob)(2) > 0; }
    """
    found = static_checks.check_source(code, "cpu")
    assert sum("section of its choice" in v for v in found) == 2, found


def test_static_checks_on_snippets():
    code = """
    #include <thread>
    #include "kopt_abi.h"
    // cudaStreamCreate in a comment is fine
    const char *s = "system(";
    void f(cudaStream_t st) {
      k<<<1, 2>>>(p);
      k<<<1, 2, 0, st>>>(p);
      cudaStream_t mine; cudaStreamCreate(&mine);
      std::thread t([]{}); t.join(); obj.clone(); std::remove(a, b, c);
      system("ls"); void *h = dlopen("libcublas.so", 0);
    }
    """
    found = static_checks.check_source(code, "cuda")
    text = "\n".join(found)
    for what in ("includes <thread>", "without the given stream", "creates a CUDA stream", "creates a thread",
                 "starts a process", "loads code at run time"):  # fmt: skip
        assert what in text, text
    assert sum("without the given stream" in v for v in found) == 1  # the launch with a stream is fine
    assert not any("comment" in v or "clone" in v or "remove" in v for v in found), found


def test_library_symbols_of_the_baselines_are_clean(libs):
    for name in ("scale2", "silu_and_mul"):
        assert static_checks.check_library(libs[name], "cpu") == ([], [])
    violations, _ = static_checks.check_library(libs["exits"], "cpu")
    assert any("exit" in v for v in violations)


def test_bootstrap_interval_covers_the_true_ratio():
    import random

    from gpu_worker import stats

    rng = random.Random(1)
    base = [10.0 * rng.lognormvariate(0, 0.05) for _ in range(400)]
    cand = [8.0 * rng.lognormvariate(0, 0.05) for _ in range(400)]
    r = stats.ratio_of_medians(base, cand)
    assert r.low < 1.25 < r.high and r.low > 1.2
    same = stats.ratio_of_medians(base, base, seed=3)
    g, lo, hi = stats.geomean_interval([r, same])
    assert lo < g < hi and abs(g - (1.25**0.5)) < 0.02
    assert stats.verdict(r.low, r.high, 0.01) == "faster" and stats.verdict(0.98, 1.03, 0.0) == "same"


def test_pairs_that_drift_during_the_run_widen_the_interval():
    """A/A pairs whose difference wanders (first half +3 %, second half -3 %: the machine's state
    changed between them) must not give the tight interval their within-pair spread suggests."""
    import random

    from gpu_worker import stats

    rng = random.Random(2)
    blocks = [10] * 64
    base, cand = [], []
    for k in range(64):
        shift = 1.03 if k < 32 else 0.97
        base += [10.0 * rng.lognormvariate(0, 0.002) for _ in range(10)]
        cand += [10.0 / shift * rng.lognormvariate(0, 0.002) for _ in range(10)]
    drift = stats.paired_blocks(base, tuple(blocks), cand, tuple(blocks))
    assert drift.low < 0.98 and drift.high > 1.02  # the stretches disagree: wide
    steady = stats.paired_blocks(base[:320], tuple(blocks[:32]), cand[:320], tuple(blocks[:32]))
    assert 1.025 < steady.low < steady.high < 1.035  # one stretch alone: tight around its 3 %
    assert stats.MIN_NOISE_FLOOR["cpu"] >= 0.01 and stats.verdict(1.005, 1.02, stats.MIN_NOISE_FLOOR["cpu"]) == "same"


def test_a_pair_disturbed_as_a_whole_decides_neither_the_point_nor_the_width():
    """Under load a whole block can be preempted: its median is off by a large factor (a log ratio
    of 8 was seen). Two such pairs among 60 steady ones (a real 10 % speedup) must leave the
    verdict and a narrow interval; a plain mean of the pairs moved the point by 7 % and widened its
    error ~90-fold."""
    import random

    from gpu_worker import stats

    rng = random.Random(5)
    blocks = tuple([10] * 60)
    base = [11.0 * rng.lognormvariate(0, 0.01) for _ in range(600)]
    cand = [10.0 * rng.lognormvariate(0, 0.01) for _ in range(600)]
    base[100:110] = [x * 3000 for x in base[100:110]]  # pair 10: the baseline's block stalled
    cand[400:410] = [x * 50 for x in cand[400:410]]  # pair 40: the candidate's
    r = stats.paired_blocks(base, blocks, cand, blocks)
    assert 1.09 < r.low < r.speedup < r.high < 1.11 and abs(r.speedup - 1.1) < 0.005
    assert stats.verdict(r.low, r.high, stats.MIN_NOISE_FLOOR["cpu"]) == "faster"
    plain = stats.trimmed([math.log(a / b) for a, b in zip(base[::10], cand[::10])], trim=0.0)
    assert plain[0] > math.log(1.15) and plain[1] > 0.1  # the plain mean: off by 7 %, its error ~90x wider


# ---------------------------------------------------------------- harness runs


def test_baseline_passes(libs, scale2):
    source = (SCALE2 / "kernel.cpp").read_text()
    req = request(scale2, "test", ["float32", "float16"], source=source)
    result = asyncio.run(runner.run_test(req, libs["scale2"], SCALE2, scale2, baseline=libs["scale2"]))
    assert result.correct, result.reason
    # 3 shapes x 2 dtypes declared; variants: x0.01 and x100 of each, edge shapes x 2 dtypes (one prime and
    # N = 2..8), the update and burst sequences at one shape x 2 dtypes, every planted input class at one shape
    # in one dtype (plan.EVERY_DTYPE's in both), the job's fuzzed shapes x 2 dtypes, its residue shapes in one
    # dtype each, and the one float dtype not declared
    assert len(result.checks) == 3 * 2
    counts = collections.Counter(c.variant.split(":")[0] for c in result.variant_checks)
    fuzzed = {c.shape for c in result.variant_checks if c.variant == "fuzz"}
    planted = len(plan.PLANTED_KINDS) + len(plan.EVERY_DTYPE)
    assert 1 <= counts.pop("residue") <= 2 * fuzz.RESIDUES  # (less a shape another draw already made)
    assert counts == {"x0.01": 6, "x100": 6, "edge": 16, "update": 2, "repeat": 1, "burst": 2, "fill": 2,
                      "planted": planted, "fuzz": 2 * len(fuzzed), "dtype": 1, "rank": 1,
                      **({"fpenv": len(plan.FP_ENVS)} if plan.FPENV_APPLIES else {})}, counts
    one_dtype = [c.dtype for c in result.variant_checks if c.variant.startswith(("fill", "planted", "repeat"))
                 and c.variant.removeprefix("planted:") not in plan.EVERY_DTYPE]
    assert set(one_dtype) == {"float32", "float16"}  # one dtype a group, the dtypes in turn
    assert len(fuzzed) >= 3 and "N=65536" in fuzzed and "N=0" not in fuzzed  # no [ranges]: N in [1, 65536]
    (undeclared,) = [c for c in result.variant_checks if c.variant == "dtype:bfloat16"]
    assert undeclared.skipped and "KOPT_ERR_DTYPE" in undeclared.message, undeclared  # both refuse bfloat16
    # Both refuse bfloat16 and take a batch of calls as one wrong call (scale2 never reads ndim): not applicable.
    (batched,) = [c for c in result.variant_checks if c.variant == plan.BATCHED]
    assert batched.skipped and "the baseline fails it too" in batched.message, batched
    checks = [c for c in result.checks + result.variant_checks if c not in (undeclared, batched)]
    assert all(c.ok and not c.skipped and c.max_abs_err == 0.0 for c in checks)  # 2*x is exact
    assert all(c.baseline_max_abs_err == 0.0 and c.error_bound is not None for c in checks)
    assert result.candidate_id == "scale2-test" and not result.static_violations
    assert result.device and result.seconds > 0


def test_without_the_jail_the_kernel_hosts_end_with_the_judge(libs, scale2, monkeypatch):
    """KOPT_SANDBOX=off (no PID namespace to take them down): the judge closes its kernel hosts and
    waits for them, so none is left over (which the parent would report as a fork of the kernel)."""
    monkeypatch.setenv("KOPT_SANDBOX", "off")
    monkeypatch.setenv("KOPT_ALLOW_UNSANDBOXED", "1")
    req = request(scale2, "test", ["float32"])
    result = asyncio.run(runner.run_test(req, libs["scale2"], SCALE2, scale2, baseline=libs["scale2"]))
    assert result.correct, result.reason


@pytest.mark.serial
def test_baseline_profile_and_ab_against_itself(libs, scale2):
    req = request(scale2, "bench", ["float32", "float16"])
    result = asyncio.run(runner.run_profile(req, libs["scale2"], SCALE2, scale2, baseline=libs["scale2"]))
    assert result.ok, result.reason
    assert result.copy_bandwidth_gbs and result.copy_bandwidth_gbs > 0
    assert result.peak_bandwidth_gbs == pytest.approx(device.CPU_SANITY_FACTOR * result.copy_bandwidth_gbs)
    assert [(t.shape, t.dtype) for t in result.timings] == [("N=65536", "float32"), ("N=65536", "float16")]
    for t in result.timings:
        assert 0 < t.p10_us <= t.median_us <= t.p90_us
        assert t.samples >= 20 and t.mode == "hot-cpu"
        assert t.gbytes_per_s > 0 and t.pct_sol is not None and t.pct_sol > 0
    ab = result.ab
    assert ab is not None and len(ab.per_shape) == 2
    for s in ab.per_shape:
        assert s.ci_low <= s.speedup <= s.ci_high and 0.5 < s.speedup < 2.0
    assert ab.ci_low <= ab.speedup_geomean <= ab.ci_high and ab.verdict in ("faster", "slower", "same")


@pytest.mark.serial
def test_impossible_bandwidth_is_a_measurement_fault(libs, scale2):
    inflated = scale2.model_copy(update={"model": scale2.model.model_copy(update={"bytes": "2*N*elem*1000000"})})
    req = request(inflated, "bench", ["float32"])
    result = asyncio.run(runner.run_profile(req, libs["scale2"], SCALE2, inflated))
    assert not result.ok and "measurement fault" in result.reason, result.reason


def test_wrong_kernels_are_rejected(libs, scale2):
    async def all_wrong():
        req = request(scale2, "test", ["float32"])
        return await asyncio.gather(*(runner.run_harness("test", req, libs[n], SCALE2, scale2) for n in WRONG))

    for name, result in zip(WRONG, asyncio.run(all_wrong())):
        assert not result.correct, name
        assert WRONG[name] in result.reason, (name, result.reason)
        assert result.reason.startswith(("N=1 float32", "crashed", "kernel process", "killed")), result.reason


def test_output_printed_by_the_kernel_does_not_matter(libs, scale2):
    req = request(scale2, "test", ["float32"])
    result = asyncio.run(runner.run_harness("test", req, libs["chatty"], SCALE2, scale2))
    assert result.correct, result.reason
    # Judged alone, a kernel that never reads ndim takes a batched call wrongly: a note, not a failure.
    assert any(plan.BATCHED in n and "one rank above the declared one" in n for n in result.notes), result.notes


def test_static_checks_reject_before_running(libs, scale2):
    source = (FIXTURES / "wrong" / "exits.cpp").read_text()
    result = asyncio.run(runner.run_test(request(scale2, "test", ["float32"], source=source), libs["exits"], SCALE2,
                                         scale2))  # fmt: skip
    assert not result.correct and result.reason.startswith("static check: ") and result.failed_party == "candidate"
    assert any("exit" in v for v in result.static_violations)


@pytest.mark.serial
def test_answer_once_kernel_fails_the_timed_recheck(libs, scale2):
    req = request(scale2, "bench", ["float32"])
    result = asyncio.run(runner.run_profile(req, libs["answers_once"], SCALE2, scale2))
    assert not result.ok
    assert "timed output re-check failed" in result.reason and "never written" in result.reason


def test_hang_times_out_with_heartbeats(libs, scale2, monkeypatch):
    monkeypatch.setattr(spawn, "HEARTBEAT_S", 0.5)
    beats: list[str] = []
    req = request(scale2, "test", ["float32"], timeout_s=4.0)
    result = asyncio.run(runner.run_harness("test", req, libs["hang"], SCALE2, scale2, heartbeat=beats.append))
    assert not result.correct
    assert result.reason == "timed out after 4 s (during test N=1 float32 trial 0)", result.reason
    assert len(beats) >= 4 and "running for" in beats[-1] and "test N=1 float32 trial 0" in beats[-1]


def test_cancel_kills_the_child(libs, scale2, monkeypatch):
    spawned = []
    real_start = spawn._ZygoteChild.start.__func__

    async def recording_start(cls, *args):
        child = await real_start(cls, *args)
        spawned.append(child.pid)
        return child

    monkeypatch.setattr(spawn._ZygoteChild, "start", classmethod(recording_start))
    req = request(scale2, "test", ["float32"], timeout_s=60.0)

    async def cancel_soon():
        task = asyncio.create_task(runner.run_harness("test", req, libs["hang"], SCALE2, scale2))
        await asyncio.sleep(1.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # let the zygote reap it

    asyncio.run(cancel_soon())
    assert len(spawned) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(spawned[0], 0)


def test_exec_path_without_the_zygote(libs, scale2, monkeypatch):
    monkeypatch.setenv("KOPT_HARNESS_ZYGOTE", "0")
    req = request(scale2, "test", ["float16"], edge_shapes=False)
    req.shapes = [Shape(dims={"N": 17})]
    result = asyncio.run(runner.run_harness("test", req, libs["scale2"], SCALE2, scale2))
    assert result.correct, result.reason
    bad = asyncio.run(runner.run_harness("test", req, libs["segfault"], SCALE2, scale2))
    assert "crashed: SIGSEGV" in bad.reason


def test_silu_and_mul_cpu_baseline_passes(libs):
    spec = load_spec(SILU)
    req = request(spec, "test", ["float16", "bfloat16"])
    result = asyncio.run(runner.run_test(req, libs["silu_and_mul"], SILU, spec))
    assert result.correct, result.reason
    assert len(result.checks) == len(spec.shapes["cpu"].test) * 2
    assert all(c.variant == "" for c in result.checks) and result.variant_checks


@pytest.mark.parametrize(
    "name, cls",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ],
)
def test_gpu_class_from_name(name, cls):
    assert device.gpu_class_from_name(name) == cls


def test_peak_bandwidth_table():
    assert device.peak_bandwidth_gbs("cuda", "NVIDIA H100 80GB HBM3", 3000.0)[0] == 3350.0
    assert device.peak_bandwidth_gbs("cuda", "NVIDIA H200", 4250.0)[0] == 4800.0
    assert device.peak_bandwidth_gbs("cuda", "NVIDIA RTX PRO 6000", 1500.0)[0] == pytest.approx(1800.0)


def test_local_gpus_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert device.local_gpus() == []
    assert device.cpu_name()


def test_sanitizer_covers_one_shape_per_class():
    """Every declared test shape, plus the smallest bench shape above them all (size-dispatched
    paths such as cache hints above the L2 size), one trial each, without the baseline."""
    from gpu_worker import sanitizer

    spec = load_spec(SILU)
    req = ExecRequest(package=PackageRef(spec=spec, files=NO_ARTIFACT, baseline_sources={}), target="cuda",
                      candidate_id="c", library=NO_ARTIFACT, shapes=spec.shapes["cuda"].test, dtypes=["bfloat16"])  # fmt: skip
    job = runner._job("test", req, SILU / "kernel.cu", SILU, spec, SILU / "kernel.cu")
    sj = sanitizer.sanitizer_job(job)
    labels = [s.label for s in sj.shapes]
    assert labels == [s.label for s in spec.shapes["cuda"].test] + ["T=4096,D=14336"], labels
    assert (sj.trials, sj.baseline_library, sj.sandbox) == (1, None, False)
    assert [s.label for s in sanitizer.sanitizer_job(job, "racecheck").shapes] == labels[:-1]


@pytest.mark.serial
def test_cpu_readings_wait_for_a_host_to_block():
    """A host's CPU time is read once it blocks (remote.wait_blocked): a reading taken while it is
    still on its way back from a reply would charge that slice to the next block, another kernel's
    perhaps (an honest candidate failed the idle check in CI so). A process that spins is reported
    as not blocked until it stops, one blocked on a read as blocked."""
    from gpu_worker import remote

    spin = "import sys, time\nprint(flush=True)\nt = time.time()\nwhile time.time() - t < 0.6: pass\nsys.stdin.read()"
    proc = subprocess.Popen(["python3", "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # it spins from here
        assert remote.running_threads(proc.pid) == 1
        assert not remote.wait_blocked([proc.pid], 0.05)
        assert remote.wait_blocked([proc.pid], 5.0)
        assert remote.running_threads(proc.pid) == 0
    finally:
        proc.kill()
        proc.wait()
    assert remote.running_threads(proc.pid) == 0 and remote.wait_blocked([proc.pid], 0.01)  # gone


class _Host:
    """What the clock checks read of a kernel host: its role and serial, and close()."""

    def __init__(self, role: str, serial: int) -> None:
        self.role, self.serial, self.closed = role, serial, False

    def close(self) -> None:
        self.closed = True


def _clock(hosts, host, rts, readings, noop: float) -> str | None:
    hosts.rts[host.serial] = collections.deque([noop])
    return hosts.check_clock(host, "cold", rts, readings)


def test_the_shape_clock_check_compares_raw_round_trips_not_each_hosts_no_op():
    """CUDA cold mode (remote.Hosts, data shaped like an H100's): the device's context switch inside
    each round trip is ~45 or ~230 us, and which one shifts during a shape, so each host's no-op
    median can sit in a different mode. Honest hosts through the same switches pass whatever their
    no-ops say (the median-gap rule failed them by ~185 us); a host that reports 60 us less than its
    calls took, in every block, fails."""
    from gpu_worker import remote

    rng = random.Random(3)
    reading = 100.0

    def block(forged_us: float = 0.0):
        rts = [reading + (230.0 if rng.random() < 0.5 else 45.0) + rng.uniform(-10, 10) for _ in range(20)]
        return rts, [reading - forged_us] * 20

    for forged_us, noops, fails in ((0.0, (230.0, 45.0), False), (0.0, (45.0, 230.0), False),
                                    (60.0, (45.0, 45.0), True), (60.0, (230.0, 230.0), True)):  # fmt: skip
        hosts = remote.Hosts()
        base, cand = _Host("baseline", 1), _Host("candidate", 2)

        def timed() -> str:
            for _ in range(10):
                assert _clock(hosts, base, *block(), noops[0]) is None
                assert _clock(hosts, cand, *block(forged_us), noops[1]) is None  # within the block's gross bound
            return "readings"

        if fails:
            with pytest.raises(KernelFailure, match="forged clock.*in each of 3 timings"):
                hosts.clock_checked_shape(timed, cand, base)
            assert cand.closed
        else:
            assert hosts.clock_checked_shape(timed, cand, base) == "readings"
            assert not cand.closed


def test_a_shape_whose_clock_check_fails_by_chance_is_timed_again_and_a_forger_fails_every_timing():
    """remote.Hosts.clock_checked_shape: on an H100 and an H200 an honest copy of the baseline failed
    the shape check now and then at T=16384,H=8192 (60.7 us over the baseline's against 58.1 allowed),
    its calls having met more of the slow context switches than the baseline's. The timing that
    failed is dropped and the shape timed again: a host unlucky once passes, its result is the timing
    that passed; a host that forges its events beyond the slack in every timing fails after three, and
    one that forges only in the timings it fails gains nothing (the kept timing passed by itself)."""
    from gpu_worker import remote

    reading = 100.0

    def run(slow_share: list[float], forged_us: list[float]):
        hosts = remote.Hosts()
        base, cand = _Host("baseline", 1), _Host("candidate", 2)
        attempts = []

        def timed() -> int:
            k = len(attempts)
            attempts.append(k)
            for i in range(10):
                rts = [reading + (230.0 if j < 10 * 0.3 else 45.0) for j in range(10)]
                assert _clock(hosts, base, rts, [reading] * 10, 45.0) is None
                slow = round(10 * slow_share[k])
                rts = [reading + (230.0 if j < slow else 45.0) for j in range(10)]
                assert _clock(hosts, cand, rts, [reading - forged_us[k]] * 10, 45.0) is None
            return k

        try:
            return hosts.clock_checked_shape(timed, cand, base), attempts, hosts, cand
        except KernelFailure as e:
            return str(e), attempts, hosts, cand

    kept, attempts, hosts, cand = run([0.9, 0.3, 0.3], [0.0, 0.0, 0.0])  # unlucky once, then like the baseline
    assert (kept, attempts, cand.closed) == (1, [0, 1], False)
    assert hosts.retaken == {"candidate shape": 1}
    assert any("1 shape(s) timed again" in line for line in hosts.summary())
    why, attempts, _, cand = run([0.3, 0.3, 0.3], [60.0, 60.0, 60.0])  # forges every call by 60 us
    assert (attempts, cand.closed) == ([0, 1, 2], True) and "in each of 3 timings" in why
    kept, attempts, _, cand = run([0.3, 0.3, 0.3], [200.0, 200.0, 0.0])  # forges, then stops
    assert (kept, cand.closed) == (2, False)  # the kept timing is the honest one


def test_a_block_the_clock_disagrees_with_is_taken_again_and_only_repeated_disagreement_fails():
    """timing.checked: a block whose median gap misses the gross bound (a stall of the whole block, seen
    once in an A/A of silu_and_mul on an H100) is taken again; BLOCK_RETAKES misses in a row fail, and
    a retaken block's readings never reach the sample."""
    from gpu_worker import remote, timing

    honest = ([300.0] * 8, [100.0] * 8, None)
    stalled = ([3300.0] * 8, [100.0] * 8, None)
    for stalls, fails in ((1, False), (remote.BLOCK_RETAKES, False), (remote.BLOCK_RETAKES + 1, True)):
        hosts, host = remote.Hosts(), _Host("candidate", 1)
        hosts.rts[1] = collections.deque([200.0])
        taken = []

        def block(n, taken=taken, stalls=stalls):
            taken.append(n)
            return stalled if len(taken) <= stalls else honest

        if fails:
            with pytest.raises(KernelFailure, match="median over a block"):
                timing.checked(block, 8, host, hosts, "cold")
            assert host.closed and len(taken) == 1 + remote.BLOCK_RETAKES
        else:
            assert timing.checked(block, 8, host, hosts, "cold") == honest[1]
            assert hosts.retaken == {"candidate cold": stalls} and len(taken) == stalls + 1
            assert any("taken again (the judge's clock" in line for line in hosts.summary())


def test_a_block_a_host_was_charged_cpu_in_is_taken_again_and_only_repeated_excess_fails():
    """timing.checked with the idle check: an honest host is now and then charged CPU beyond its
    calls (interrupts, accounted to whatever runs: CI once failed the honest baseline so, 0.5 ms over
    a block), a host that works outside its calls is so in every block. A block over the allowance is
    taken again, its readings dropped; BLOCK_RETAKES in a row fail the host that used the CPU (here
    the idle one, not the caller), and the verdict names it. Both targets: CPU blocks carry no round
    trips to check, CUDA ones go on to the clock check once the idle check passes."""
    from gpu_worker import remote, timing

    for rts in (None, [300.0] * 8):
        for excess, fails in ((1, False), (remote.BLOCK_RETAKES, False), (remote.BLOCK_RETAKES + 1, True)):
            hosts, caller, other = remote.Hosts(), _Host("baseline", 1), _Host("candidate", 2)
            hosts.rts[1] = collections.deque([200.0])
            taken = []
            busy = (other, "candidate: used 1.79 ms of CPU ...: it works during the baseline's calls")

            def block(n, taken=taken, excess=excess, rts=rts, busy=busy):
                taken.append(n)
                return rts, [float(len(taken))] * n, busy if len(taken) <= excess else None

            if fails:
                with pytest.raises(KernelFailure, match="during the baseline's calls"):
                    timing.checked(block, 8, caller, hosts, "cold" if rts else "cpu")
                assert other.closed and not caller.closed and len(taken) == 1 + remote.BLOCK_RETAKES
            else:
                got = timing.checked(block, 8, caller, hosts, "cold" if rts else "cpu")
                assert got == [float(excess + 1)] * 8  # the last block's readings, none of a retaken one
                assert hosts.retaken == {"candidate idle": excess} and not other.closed
                assert any("taken again (a host used CPU outside the calls" in line for line in hosts.summary())


def test_sanitizer_summaries_of_both_tools_are_read():
    """memcheck's and racecheck's own summary lines (racecheck's has no "ERROR SUMMARY": it was read
    as "did not complete (no summary)" on every kernel with shared memory)."""
    from gpu_worker.sanitizer import findings

    assert findings("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n") == (0, [])
    race = ("========= COMPUTE-SANITIZER\n"
            "========= Error: Race reported between Write access at kernel+0x1a0\n"
            "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")  # fmt: skip
    assert findings(race) == (1, ["Error: Race reported between Write access at kernel+0x1a0"])
    assert findings("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")[0] == 0
    assert findings("========= COMPUTE-SANITIZER\n")[0] is None


def test_a_sanitizer_verdict_comes_from_its_log_alone():
    """The tool wraps the kernel host, whose exit status the judge does not report, so its log decides:
    any error counted fails, a finding line fails where the log has no summary (the host cut short),
    racecheck's unconfirmed warnings under a summary of 0 errors pass, and a log with neither a summary
    nor a finding is "did not complete", never clean."""
    from gpu_worker.sanitizer import outcome

    head = "========= COMPUTE-SANITIZER\n"
    assert outcome("memcheck", head + "========= ERROR SUMMARY: 0 errors\n", False, 5) == (
        True, "memcheck: clean (5 shape classes)")  # fmt: skip
    ok, why = outcome("memcheck", head + "========= Invalid __global__ write of size 4 bytes\n"
                      "========= ERROR SUMMARY: 1 error\n", False, 5)  # fmt: skip
    assert ok is False and why == "compute-sanitizer memcheck: 1 error(s): Invalid __global__ write of size 4 bytes"
    ok, why = outcome("memcheck", head + "========= Warp Illegal Instruction\n========= ERROR SUMMARY: 1 error\n",
                      False, 5)  # fmt: skip
    assert ok is False and why.endswith("1 error(s): Warp Illegal Instruction"), why
    ok, why = outcome("memcheck", head + "========= Invalid __global__ read of size 2 bytes\n", True, 5)
    assert ok is False and "some error(s): Invalid __global__ read" in why
    race_warning = head + "========= Warning: Race reported between Write access\n" \
        "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n"
    assert outcome("racecheck", race_warning, False, 4)[0] is True
    ok, why = outcome("memcheck", head, False, 5)
    assert ok is None and why.startswith("memcheck: did not complete (no summary")
    assert outcome("memcheck", head, True, 5) == (None, "memcheck: did not complete (timed out)")


def test_a_tool_runs_the_kernel_hosts_and_writes_its_log_in_the_jails_scratch(libs, scale2):
    """spawn.spawn_under_tool, as compute-sanitizer and ncu use it, with a shell standing in for the
    tool: it writes its log where the jail lets it (the scratch, under the one neutral name), then runs
    the kernel host it was put in front of; the caller gets the log's text and the folder is gone."""
    from gpu_worker.protocol import new_key

    req = request(scale2, "test", ["float16"], edge_shapes=False)
    req.shapes = [Shape(dims={"N": 17})]
    job = runner._job("test", req, libs["scale2"], SCALE2, scale2, None).model_copy(
        update={"sandbox": False, "fuzz_budget": 0, "sequences": False, "large_shapes": False})
    seen: list[Path] = []

    def tool_job(log: Path):
        seen.append(log)
        script = 'echo "tool in front of: $(basename "$1")" >> "$0"; exec "$@"'
        return job.model_copy(update={"host_prefix": ["/bin/sh", "-c", script, str(log)]})

    out, log = asyncio.run(spawn.spawn_under_tool(tool_job, new_key(), 120, None))
    assert not out.timed_out and out.frames.result is not None, (out.log, log)
    from kopt.models import TestResult

    assert TestResult.model_validate_json(out.frames.result).correct, out.frames.result
    assert seen[0].name == spawn.TOOL_LOG and seen[0].parent.name == "scratch"
    assert log.startswith("tool in front of: python"), log  # the kernel host's interpreter came next
    assert not seen[0].parent.parent.exists()
