"""Profile mode: time the candidate per shape and dtype, interleaved with the baseline when loaded.

Per shape: rotating input sets (fresh addresses every call), warm-up, a mode (cold L2; CUDA graph
for calls under ~20 us; hot caches on CPU), adaptive sampling in A/B blocks, random re-checks of
timed outputs during sampling and of every set at the end, a device-wide wall-clock cross-check
for work hidden on other streams, then %SOL and the impossible-result checks.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass

import torch

from gpu_worker import device as devinfo
from gpu_worker import stats, timing
from gpu_worker.abi import KernelFailure, error_message
from gpu_worker.cases import Case, Refresher, generate, reference, shapes_of
from gpu_worker.checks import check_inputs, check_outputs, errors_by_output, output_tolerances
from gpu_worker.context import Context, derive_seed
from gpu_worker.nvml import Monitor
from gpu_worker.plan import CaseSpec, plantable
from gpu_worker.protocol import TIME_CAP_S
from gpu_worker.remote import CaptureFailed, RemoteKernel
from kopt import expr
from kopt.models import ELEMENT_SIZE, ABResult, Partial, ProfileResult, Shape, ShapeAB, ShapeTiming

PROFILE_SETS = 3  # rotating input sets per timed shape in cold and CPU modes
PROFILE_SET_BUDGET = 8 << 30  # bytes per kernel of rotating sets on CUDA; huge shapes rotate fewer (min 2)
GRAPH_UNIQUE = 4  # distinct input sets behind the slots of a graph
GRAPH_MAX_CALLS = 4096
GRAPH_MIN_CALLS = 16
GRAPH_L2_FACTOR = 3  # a graph's slots together hold this many L2s of data
RANDOM_CHECKS = 8  # re-checks of a timed output at random block ends, per kernel and shape
FINAL_CHECKS = 32  # graph slots re-checked after a poisoned replay
PERTURB = 8  # elements of a non-float input changed before each timed call in cold and CPU modes (Perturber)
SCALE_SPAN = 1.5  # float inputs of a timed call: a unique set times a factor in [1/1.5, 1.5] (Perturber)
PERTURB_POOL = 4096  # rows of precomputed random positions, walked through call by call
COPY_FLAG = 1.05  # above this fraction of the measured copy bandwidth: flagged for a second look
HIDDEN_WORK_S = 5e-3  # device time the wall-clock cross-check aims for
# ... which allows the judge's clock twice the events or this much over them, whichever is more (H100,
# silu_and_mul: honest bursts of 40-230 calls took 1.3-1.6x their events by the judge's clock).
HIDDEN_WORK_SLACK_S = 2e-3


class Perturber:
    """Makes the inputs of every timed call new in every element, outside the timed region and in a
    way the kernel cannot predict, so no timed call can be answered from an earlier one: not by a
    replay (keyed on pointers, on a sample of the values, on a call count), and not by recomputing
    only what changed since the last call on the same buffers (which 8 changed elements allowed).

    Each floating-point input is one of the unique input sets times a factor drawn per call and per
    argument (log-uniform in [1/SCALE_SPAN, SCALE_SPAN]), written straight into the kernel's buffer:
    one read and one write per element, every nonzero element moves, signs and special values stay,
    and arguments scaled apart keep scale-invariant kernels (a norm) from reusing an old result. The
    judge's copy (slot.pristine) is rebuilt from the same recipe only when a re-check needs it.
    Integer inputs, and float inputs declared `scale = false`, get PERTURB elements replaced from
    another set."""

    def __init__(self, ctx: Context, uniques: list[tuple[dict, dict]]) -> None:
        self.uniques = uniques
        self.calls = 0
        seed = random.SystemRandom().getrandbits(63)
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.pools, self.scaled = {}, scalable(ctx)
        for arg in ctx.job.spec.arguments:
            if arg.role == "out" or arg.name in self.scaled:
                continue
            first = uniques[0][0][arg.name]
            if first.numel():
                self.pools[arg.name] = torch.randint(first.numel(), (PERTURB_POOL, PERTURB), generator=gen).to(ctx.device)

    def apply(self, slot: Case, unique: int) -> None:
        base = unique % len(self.uniques)
        row = self.calls % PERTURB_POOL
        self.calls += 1
        recipe = slot.__dict__.setdefault("recipe", {})  # name -> (unique set, factor) of its "in" buffers
        for arg in slot.args:
            name = arg.name
            if name in self.scaled:
                factor = math.exp(self.rng.uniform(-1.0, 1.0) * math.log(SCALE_SPAN))
                source = self.uniques[base][0][name]
                if arg.role == "in":
                    torch.mul(source, factor, out=slot.tensors[name])
                    recipe[name] = (base, factor)
                else:  # inout: refresh() restores the buffer from the pristine copy
                    torch.mul(source, factor, out=slot.pristine[name])
            elif name in self.pools:
                idx = self.pools[name][row]
                values = self.uniques[(base + 1) % len(self.uniques)][0][name].view(-1)[idx]
                slot.pristine[name].view(-1)[idx] = values
                if arg.role == "in":
                    slot.tensors[name].view(-1)[idx] = values

    def materialize(self, slot: Case) -> None:
        """Bring the judge's copy of the slot's inputs up to date (the same operation, bit for bit)."""
        recipe = slot.__dict__.get("recipe", {})
        for name, (base, factor) in recipe.items():
            torch.mul(self.uniques[base][0][name], factor, out=slot.pristine[name])
        recipe.clear()


class Rotation:
    """One kernel's slots over the unique input sets; calls rotate through the slots.

    `perturb` (cold and CPU modes): every slot has its own copy of its inputs, made new before each
    call (Perturber); a check of a slot then compares with the reference computed for its inputs as
    they are."""

    def __init__(self, ctx: Context, kernel: RemoteKernel, uniques: list[tuple[dict, dict]], cs: CaseSpec, slots: int,
                 share: Rotation | None = None, perturb: bool = False):  # fmt: skip
        self.ctx, self.kernel = ctx, kernel
        self.uniques = uniques  # (pristine, refs) per unique input set
        dev = ctx.device.type
        args = ctx.job.spec.arguments
        self.shapes = shapes_of(args, cs.dim_map)

        def inputs(k: int) -> dict:
            pristine = uniques[k % len(uniques)][0]
            return {n: t.clone() for n, t in pristine.items()} if perturb else pristine

        # `share`: time on the same buffers as another kernel (A/B), so that where the allocator put
        # each side's buffers cannot tilt the ratio; every call re-poisons its slot first anyway.
        # Guard zones as in the test step: a kernel cannot tell timing from testing by its buffers.
        self.slots = share.slots if share is not None else [Case(args, inputs(k), cs, dev) for k in range(slots)]
        self.writers: list[str | None] = share.writers if share is not None else [None] * len(self.slots)
        self.perturber = share.perturber if share is not None else (Perturber(ctx, uniques) if perturb else None)
        self.order = itertools.cycle(range(slots))
        self.cur = 0

    def before(self) -> None:
        self.cur = next(self.order)
        if self.perturber is not None:
            self.perturber.apply(self.slots[self.cur], self.cur)
        self.slots[self.cur].refresh()

    def call(self, stream: int | None = None) -> None:
        rc = self.kernel(self.slots[self.cur].packed, stream)
        self.writers[self.cur] = self.kernel.role
        if rc != 0:
            raise KernelFailure(f"{self.kernel.role}: {error_message(rc)} during timing", party=self.kernel.role)

    def warm_call(self) -> None:
        self.before()
        self.call()

    def final_check(self, k: int, tol) -> str | None:
        """Check this kernel's last timed output in slot k; where the other kernel of a shared
        rotation wrote last, call this kernel on the slot once more and check that output."""
        if self.writers[k] == self.kernel.role:
            return self.check(k, tol)
        self.cur = k
        self.slots[k].refresh()
        self.call()
        self.ctx.sync(self.kernel.role)
        return self.check(k, tol)

    def check(self, k: int, tol) -> str | None:
        slot = self.slots[k]
        if self.perturber is not None:  # the reference of the slot's inputs as they are now
            self.perturber.materialize(slot)
            refs = reference(self.ctx.ref, slot.args, slot.pristine, self.shapes)
        else:
            refs = self.uniques[k % len(self.uniques)][1]
        return check_inputs(slot) or check_outputs(slot, refs, tol, errors_by_output())


@dataclass
class Timed:
    stats: timing.Stats
    mode: str
    sampling_s: float = 0.0  # wall seconds of the sampling loop (both sides of an A/B)


def recheck_failure(ctx: Context, rot: Rotation, msg: str) -> str:
    """The reason of a failed re-check of a timed output. Where the kernel is the package's own baseline
    (the baseline host, or a job without one: the baseline's own run), say what timed calls do to the
    float inputs: a float input that holds indices, positions or a table breaks under rescaling."""
    why = f"{rot.kernel.role}: timed output re-check failed: {msg}"
    scaled = rot.perturber.scaled if rot.perturber is not None else set()
    if (rot.kernel.role == "baseline" or ctx.baseline is None) and scaled:
        names = ", ".join(sorted(scaled))
        why += (f" (timed calls rescale every float input by a factor per call, here {names}: if one of them "
                "holds indices, positions or a table, mark it `scale = false` in kernel.toml)")
    return why


def run_profile(ctx: Context, copy_bw: float) -> ProfileResult:
    result = _run_profile(ctx, copy_bw)
    result.notes = list(ctx.notes) + ctx.hosts.summary()
    return result


def _run_profile(ctx: Context, copy_bw: float) -> ProfileResult:
    job = ctx.job
    peak, peak_what = devinfo.peak_bandwidth_gbs(job.target, ctx.device_name, copy_bw)
    result = ProfileResult(
        candidate_id=job.candidate_id, ok=True, device=ctx.device_name, copy_bandwidth_gbs=copy_bw,
        peak_bandwidth_gbs=peak,
    )  # fmt: skip
    cold = timing.ColdL2(ctx.device) if ctx.cuda else None
    monitor = Monitor(ctx.nvml)
    ratios, per_shape = [], []  # parallel: one per (shape, dtype) timed against the baseline
    resumed = 0
    for shape in job.shapes:
        for dtype in job.dtypes:
            key = f"profile {shape.label} {dtype}"
            done = ctx.resumed.get(key)
            if done is not None and done.timing is not None and (done.ab is not None or ctx.baseline is None):
                resumed += 1
                result.timings.append(done.timing)
                if done.ab is not None:
                    per_shape.append(done.ab)
                    ratios.append(stats.Ratio.from_interval(done.ab.speedup, done.ab.ci_low, done.ab.ci_high,
                                                            seed=len(ratios)))  # fmt: skip
                continue
            ctx.progress(key)
            monitor.reset()
            started = time.perf_counter()
            try:
                cand, base = time_shape(ctx, shape, dtype, cold, monitor)
            except KernelFailure as exc:
                result.ok, result.reason, result.failed_party = False, f"{shape.label} {dtype}: {exc}", exc.party
                return result
            nbytes = expr.evaluate(job.spec.model.bytes, {**shape.dims, "elem": ELEMENT_SIZE[dtype]})
            st = cand.stats
            gbs = nbytes / (st.median_us * 1e-6) / 1e9 if st.median_us > 0 else math.inf
            sm, mem, temp = monitor.summary()
            timing_ = ShapeTiming(
                shape=shape.label, dtype=dtype, median_us=st.median_us, p10_us=st.p10_us, p90_us=st.p90_us,
                samples=st.samples, gbytes_per_s=gbs, pct_sol=100.0 * gbs / copy_bw, mode=cand.mode, rse=st.rse,
                throttled_dropped=st.dropped, sm_clock_mhz=sm, mem_clock_mhz=mem, temperature_c=temp,
                seconds=time.perf_counter() - started, sampling_s=cand.sampling_s,
            )  # fmt: skip
            if st.dropped:
                timing_.flags.append(f"{st.dropped} samples dropped: the GPU reported a thermal/power slowdown")
            if gbs > peak:
                result.timings.append(timing_)
                result.ok, result.failed_party = False, "candidate"
                result.reason = (
                    f"{shape.label} {dtype}: measurement fault: {st.median_us:.3g} us implies {gbs:.0f} GB/s, above "
                    f"{peak_what} ({peak:.0f} GB/s); the kernel skips work or its work escaped the timing"
                )
                return result
            if cand.mode != "hot-cpu" and gbs > COPY_FLAG * copy_bw:  # hot CPU caches beat DRAM copies
                timing_.flags.append(f"{100 * gbs / copy_bw:.0f}% of the measured copy bandwidth: check it again")
                result.flags.append(f"{shape.label} {dtype}: above {100 * COPY_FLAG:.0f}% of the copy bandwidth")
            result.timings.append(timing_)
            shape_ab = None
            if base is not None:
                r = stats.ratio_of_medians(list(base.stats.values), list(st.values), seed=len(ratios),
                                           base_blocks=base.stats.blocks, cand_blocks=st.blocks)  # fmt: skip
                ratios.append(r)
                shape_ab = ShapeAB(
                    shape=shape.label, dtype=dtype, mode=cand.mode, baseline_us=base.stats.median_us,
                    candidate_us=st.median_us, speedup=r.speedup, ci_low=r.low, ci_high=r.high,
                    baseline_samples=base.stats.samples, candidate_samples=st.samples,
                )  # fmt: skip
                per_shape.append(shape_ab)
            ctx.report(Partial(key=key, timing=timing_, ab=shape_ab))
    if resumed:
        ctx.notes.append(f"resumed: {resumed} shape(s) timed by an earlier attempt of this job were not timed again")
    if ratios:
        workload = any(s.weight is not None for s in job.shapes)
        if workload:  # each shape's weight shared by its dtypes
            weight = {s.label: (s.weight or 1.0) / len(job.dtypes) for s in job.shapes}
            g, lo, hi = stats.weighted_time_interval(ratios, [a.baseline_us for a in per_shape],
                                                     [weight[a.shape] for a in per_shape])  # fmt: skip
        else:
            g, lo, hi = stats.geomean_interval(ratios)
        floor = max(job.noise_floor, stats.MIN_NOISE_FLOOR[job.target])
        result.ab = ABResult(
            baseline_id=job.baseline_id, per_shape=per_shape, speedup_geomean=g, ci_low=lo, ci_high=hi,
            noise_floor=floor, verdict=stats.verdict(lo, hi, floor), objective="workload" if workload else "geomean",
        )  # fmt: skip
    if not result.timings:
        result.ok, result.reason = False, "nothing to profile: no shapes or no dtypes"
    return result


def time_shape(
    ctx: Context, shape: Shape, dtype: str, cold: timing.ColdL2 | None, monitor: Monitor
) -> tuple[Timed, Timed | None]:
    job = ctx.job
    args = job.spec.arguments
    tol = output_tolerances(args, job.tolerances, dtype)
    cs = CaseSpec(tuple(shape.dims.items()), dtype, "profile")
    shapes = shapes_of(args, shape.dims)
    kernels = [k for k in (ctx.baseline, ctx.kernel) if k is not None]  # baseline first: it picks the mode

    def uniques(n: int) -> list[tuple[dict, dict]]:
        out = []
        for k in range(n):
            pristine = generate(ctx.ref, args, cs, derive_seed(job.seed, job.salt, shape.label, dtype, "profile", k),
                                ctx.device.type)  # fmt: skip
            out.append((pristine, reference(ctx.ref, args, pristine, shapes)))
        return out

    set_bytes = sum(math.prod(s) * _elem(a, dtype) for a, s in zip(args, shapes.values()))
    n_sets = PROFILE_SETS
    if ctx.cuda:
        n_sets = max(2, min(PROFILE_SETS, PROFILE_SET_BUDGET // max(3 * set_bytes, 1)))
    sets = uniques(n_sets)
    rotations: list[Rotation] = []
    for k in kernels:
        rotations.append(Rotation(ctx, k, sets, cs, n_sets, share=rotations[0] if rotations else None, perturb=True))
    for rot in rotations:
        timing.warmup(rot.warm_call, lambda r=rot: ctx.sync(r.kernel.role))
    cap = job.time_cap_s or TIME_CAP_S[job.target]

    mode = "hot-cpu" if not ctx.cuda else job.timing_mode
    measures: list[timing.Measure]
    graphs = None
    if ctx.cuda:
        cold_measures = [timing.cuda_measure(r.call, r.before, r.kernel, ctx.hosts, cold) for r in rotations]
        if mode == "auto":
            probe = timing.sample([cold_measures[0]], min(cap, 0.2))[0]
            mode = "graph" if probe.median_us < timing.GRAPH_BELOW_US else "cold"
        measures = cold_measures
        if mode == "graph":
            graphs = graph_timers(ctx, kernels, sets, cs, set_bytes, cold.l2_bytes)
            if graphs is None:
                mode = "cold"
            else:
                measures = [g.measure for g in graphs]
    else:  # CPU: the kernels run in kernel hosts
        measures = [timing.remote_measure(r.call, r.before, r.kernel, ctx.hosts) for r in rotations]

    checks_left = [RANDOM_CHECKS] * len(rotations)
    rng = random.SystemRandom()

    def after_block(i: int) -> None:
        # Re-check the output of the block's last timed call now and then (cold and CPU modes).
        if graphs is not None or checks_left[i] <= 0 or rng.random() > 0.25:
            return
        checks_left[i] -= 1
        rot = rotations[i]
        ctx.sync(rot.kernel.role)
        msg = rot.check(rot.cur, tol)
        if msg:
            raise KernelFailure(recheck_failure(ctx, rot, msg), party=rot.kernel.role)

    def sampled() -> list[timing.Stats]:
        out = timing.sample(measures, cap, monitor if ctx.cuda else None, after_block)
        ctx.sync_device()
        return out

    sampling_start = time.perf_counter()
    if ctx.cuda:
        baseline = rotations[0].kernel if len(rotations) == 2 else None
        results = ctx.hosts.clock_checked_shape(sampled, rotations[-1].kernel, baseline, f"{shape.label} {dtype}")
    else:
        results = sampled()
    sampling_s = time.perf_counter() - sampling_start
    for i, rot in enumerate(rotations):
        if graphs is not None:
            msg = final_graph_check(ctx, rot, graphs[i], tol)
        else:
            msg = next((m for k in range(len(rot.slots)) if (m := rot.final_check(k, tol))), None)
        if msg:
            raise KernelFailure(recheck_failure(ctx, rot, msg), party=rot.kernel.role)
    if ctx.cuda:
        cand = rotations[-1]
        median_s = max(results[-1].median_us, 0.5) * 1e-6
        n = max(20, min(2000, math.ceil(HIDDEN_WORK_S / median_s)))
        events_s, wall_s = timing.hidden_work(cand.kernel, cand.slots[cand.cur].packed, n)
        if wall_s - events_s > max(events_s, HIDDEN_WORK_SLACK_S):
            raise KernelFailure(
                f"candidate: {n} calls took {1e3 * wall_s:.2f} ms by the judge's clock, to a device-wide "
                f"synchronize, but {1e3 * events_s:.2f} ms by the events on the stream it was given: work "
                "launched elsewhere escapes the timing, or the events are forged"
            )
    timed = [Timed(r, mode, sampling_s) for r in results]
    rotations.clear()  # drop the sets before the next shape allocates its own
    sets.clear()
    graphs = None
    if ctx.cuda:
        torch.cuda.empty_cache()  # the next shape's sets need the room
    return timed[-1], (timed[0] if len(timed) == 2 else None)


def _elem(arg, dtype: str) -> int:
    return ELEMENT_SIZE[arg.dtype or dtype]


def graph_timers(ctx: Context, kernels: list[RemoteKernel], sets, cs: CaseSpec, set_bytes: int, l2_bytes: int):
    """One graph per kernel over GRAPH_L2_FACTOR x L2 of slots; None (cold mode) when a kernel
    cannot be captured (it synchronizes or allocates inside the call)."""
    calls = max(GRAPH_MIN_CALLS, min(GRAPH_MAX_CALLS, math.ceil(GRAPH_L2_FACTOR * l2_bytes / max(set_bytes, 1))))
    uniques = sets[:GRAPH_UNIQUE]
    timers = []
    for kernel in kernels:
        rot = Rotation(ctx, kernel, uniques, cs, calls, share=timers[0].rotation if timers else None)
        ctx.sync()
        try:
            refresh = timers[0].before_replay if timers else Refresher(rot.slots, scalable(ctx))
            timer = timing.GraphTimer(kernel, [slot.packed for slot in rot.slots], ctx.hosts, refresh)
        except CaptureFailed as exc:  # the kernel syncs or allocates inside the call
            ctx.notes.append(f"{kernel.role}: CUDA graph capture failed ({exc}); timed in cold mode instead")
            return None
        timer.replay()
        timer.rotation = rot
        timers.append(timer)
    return timers


def scalable(ctx: Context) -> frozenset[str]:
    """The inputs timing may scale: the float inputs the harness may rewrite (plan.plantable: not
    declared `scale = false`)."""
    return frozenset(a.name for a in ctx.job.spec.arguments if plantable(a))


def final_graph_check(ctx: Context, rot: Rotation, timer, tol) -> str | None:
    """New inputs and fresh poison in every slot of the graph (the timer's own refresh), one replay,
    and a check of a random sample of the slots against the reference of the inputs each had."""
    grot: Rotation = timer.rotation
    timer.before_replay()
    picks = random.SystemRandom().sample(range(len(grot.slots)), min(FINAL_CHECKS, len(grot.slots)))
    had = {k: {a.name: grot.slots[k].tensors[a.name].clone() for a in grot.slots[k].args if a.role != "out"}
           for k in picks}  # fmt: skip
    ctx.sync()
    timer.replay()
    ctx.sync(rot.kernel.role)
    for k in picks:
        slot = grot.slots[k]
        slot.pristine = had[k]  # the slot's own attribute: the unique set it was made from stays as it is
        refs = reference(ctx.ref, slot.args, had[k], grot.shapes)
        msg = check_inputs(slot) or check_outputs(slot, refs, tol, errors_by_output())
        if msg:
            return msg
    return None
