"""Test mode: check the candidate against the reference over the test plan (docs/measurement.md).

Per case: the candidate runs first, on fresh poisoned allocations; then its inputs and guard
zones are checked; then the baseline (when loaded) runs on its own buffers over the same inputs;
then the reference; then the candidate's outputs are checked; then the candidate runs again on
the same, re-poisoned buffers (catches kernels that answer once per address). Per group the
candidate's max |err| must stay within 2x the baseline's on the same inputs (calibration).
Variants (edge shapes, scales, layouts, shapes from the declared ranges and sizes, planted input
classes, output fills, the update and burst sequences: docs/measurement.md, correctness 2 and 4) count
only where they apply: where the baseline passes them, or without a baseline where the candidate
accepts the shape. The package's own code failing is a PackageFault, never the kernel's failure.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

import torch

from gpu_worker import fuzz, plan
from gpu_worker.abi import UNSUPPORTED, KernelFailure, PackageFault, error_message
from gpu_worker.cases import Case, HarnessBug, case_reference, dtype_of, far_bytes, generate, poison, reference, \
    shapes_of, supports_special
from gpu_worker.checks import ErrorsByOutput, bound, check_inputs, check_outputs, errors_by_output, \
    output_tolerances, total  # fmt: skip
from gpu_worker.context import Context, derive_seed
from kopt.models import Partial, ShapeCheck, TestResult, Tolerance


@dataclass
class GroupOutcome:
    message: str | None = None
    skipped: str | None = None
    cand: ErrorsByOutput = field(default_factory=errors_by_output)
    base: ErrorsByOutput = field(default_factory=errors_by_output)
    base_ok: bool = True
    # How the baseline failed a call it took (not one it refused), where it is held to the reference
    # (NEEDS_BASELINE variants hold a candidate to its baseline instead).
    base_failure: str | None = None
    bound: float | None = None


# What a failed variant's label means, in the reason (a bare "x100" said nothing to a package's author).
VARIANT_GLOSS = {f"x{scale:g}": f" (every float input scaled by {scale:g})" for scale in plan.SCALES}
VARIANT_GLOSS[plan.BATCHED] = (" (every argument one rank higher: two calls' arguments as a batch, the batches apart; "
                               "a kernel may refuse it with KOPT_ERR_ARGS)")
# The caller of each plan.FP_ENVS mode, in words.
FPENV_CALLERS = {"ftz-daz": "with flush-to-zero and denormals-are-zero on, as after torch.set_flush_denormal(True)",
                 "upward": "that rounds upward, fesetround(FE_UPWARD)"}
VARIANT_GLOSS |= {plan.FPENV + mode: f" (called from a thread {FPENV_CALLERS[mode]}; inputs as drawn and scaled by "
                  f"2^{math.log2(plan.FPENV_SMALL):g})" for mode in plan.FP_ENVS}  # fmt: skip


def special_differs(ctx: Context, dtype: str) -> bool:
    """Whether make_inputs(special=True) plants anything: at the shape the planted inputs go to (the
    job's smallest, a row or two, had nothing to plant in), its inputs differ from the same seed's
    without it (bit for bit, NaN included)."""
    shape = plan.planted_shape(ctx.job.spec, ctx.job.shapes, ctx.job.target) or \
        min(ctx.job.shapes, key=lambda s: math.prod(s.dims.values()))
    dims = tuple(shape.dims.items())
    try:
        plain, marked = (generate(ctx.ref, ctx.job.spec.arguments, plan.CaseSpec(dims, dtype, special=flag), 1,
                                  ctx.device.type) for flag in (False, True))  # fmt: skip
    except Exception:  # noqa: BLE001 - a generator that fails is reported by the checks themselves
        return True
    bits = {k: (plain[k].reshape(-1).view(torch.uint8), marked[k].reshape(-1).view(torch.uint8)) for k in plain}
    return any(not torch.equal(a, b) for a, b in bits.values())


def run_test(ctx: Context) -> TestResult:
    job = ctx.job
    special = supports_special(ctx.ref)
    if special and job.shapes and job.dtypes and not special_differs(ctx, job.dtypes[0]):
        ctx.notes.append("reference.py: make_inputs() accepts special=True but returns the same inputs without it: "
                         "its 'special' checks test no special values")  # fmt: skip
    declared = [s.dims for s in job.shapes]
    fuzz_seed = derive_seed(job.seed, job.salt, "fuzz")
    fuzzed = [] if job.fuzz_budget == 0 else fuzz.fuzz_shapes(job.spec, job.target, fuzz_seed, job.fuzz_budget,
                                                             exclude=declared)  # fmt: skip
    sized = [] if job.fuzz_budget == 0 else fuzz.size_shapes(job.spec, job.target, fuzz_seed, job.fuzz_budget,
                                                            exclude=declared + fuzzed)  # fmt: skip
    residues = [] if job.fuzz_budget == 0 else fuzz.residue_shapes(job.spec, job.target, fuzz_seed, job.fuzz_budget,
                                                                   exclude=declared + fuzzed + sized)  # fmt: skip
    residues += [] if job.fuzz_budget == 0 else fuzz.tall_residue_shapes(
        job.spec, job.target, fuzz_seed, job.fuzz_budget, exclude=declared + fuzzed + sized + residues)
    # The large and huge shapes where asked (the gates), and never with a sanitizer's smaller budget.
    gate = job.large_shapes and job.fuzz_budget is None
    large = fuzz.large_shape(job.spec, job.target, fuzz_seed, exclude=declared + fuzzed + sized) if gate else []
    huge = fuzz.huge_shape(job.spec, job.target, exclude=declared) if gate else []
    groups = plan.test_plan(job.spec, job.target, job.shapes, job.dtypes, job.trials, job.edge_shapes, special,
                            fuzzed, sized, job.sequences, turn=fuzz_seed % 997, large=large, huge=huge,
                            residues=residues)  # fmt: skip
    if job.only_group is not None:  # a job that looks for the argument a memory fault went through
        groups = [g for g in groups if g.key == job.only_group]
    checks: list[ShapeCheck] = []
    variant_checks: list[ShapeCheck] = []
    reason = baseline_reason = None
    resumed = 0
    for group in groups:
        done = ctx.resumed.get(f"test {group.key}")
        if done is not None and done.check is not None and done.check.ok and reason is None:
            resumed += 1
            (checks if group.declared and not group.variant else variant_checks).append(done.check)
            continue
        if reason is not None:
            # After the first failure, only a quick look at the remaining declared shapes (one
            # trial each), so the report still says which shapes fail, without the full cost.
            if not group.declared:
                continue
            group = plan.Group(group.label, group.dtype, group.variant, True, group.cases[:1])
        tol = output_tolerances(job.spec.arguments, job.tolerances, group.dtype)
        try:
            out = run_sequence(ctx, group, tol) if group.variant in plan.SEQUENCES else run_group(ctx, group, tol)
        except KernelFailure as exc:
            exc.group = group.key
            raise
        if out.message and ctx.baseline is None and group.variant in plan.NEEDS_BASELINE:
            out.skipped, out.message = f"skipped: needs a baseline to compare with ({out.message})", None
            what = ("takes a call one rank above the declared one and computes it otherwise than batch by batch; "
                    "a candidate must refuse it (KOPT_ERR_ARGS) or get it right where this kernel, its baseline, "
                    "refuses it" if group.variant == plan.BATCHED else  # fmt: skip
                    "NaN/Inf handling differs from the reference's; candidates are held to this kernel's where it is "
                    "their baseline")  # fmt: skip
            ctx.notes.append(f"{group.key}: the kernel {what}")
        ok = out.message is None
        cand, base = total(out.cand), total(out.base)
        check = ShapeCheck(
            shape=group.label, dtype=group.dtype, variant=group.variant, ok=ok, message=out.message or out.skipped,
            skipped=out.skipped is not None, max_abs_err=cand.abs if cand.seen else None,
            max_rel_err=cand.rel if cand.seen else None,
            baseline_max_abs_err=base.abs if base.seen and out.base_ok else None, error_bound=out.bound,
        )  # fmt: skip
        (checks if group.declared and not group.variant else variant_checks).append(check)
        if ok and reason is None:
            ctx.report(Partial(key=f"test {group.key}", check=check))
        if out.message and reason is None:
            reason = f"{group.key}{VARIANT_GLOSS.get(group.variant, '')}: {out.message}"
        if out.base_failure and baseline_reason is None:
            baseline_reason = f"{group.key}{VARIANT_GLOSS.get(group.variant, '')}: {out.base_failure}"
        if group.declared and not out.base_ok and ctx.baseline is not None:
            ctx.notes.append(f"{group.key}: the baseline itself fails this declared case; no calibration")
    ctx.sync_device()  # surface asynchronous launch errors as failures of this job
    if resumed:
        ctx.notes.append(f"resumed: {resumed} check group(s) passed in an earlier attempt of this job were not run again")
    if not checks:
        reason = "nothing to test: no shapes or no dtypes"
    return TestResult(
        candidate_id=job.candidate_id, correct=reason is None, reason=reason, checks=checks,
        variant_checks=variant_checks, device=ctx.device_name, notes=list(ctx.notes),
        failed_party="candidate" if reason is not None and checks else None, baseline_reason=baseline_reason,
    )  # fmt: skip


def package_call(ctx: Context, what: str, group: plan.Group, fn):
    """Run the package's own code (make_inputs, reference) for a group; its failure, a device-side
    assert included (waited for here, before any kernel runs), is a PackageFault naming reference.py
    and the case, never a failure of the kernel that runs next."""
    where = "reference.py"  # the package's own file (a worker's unpacked copy's path says nothing to its author)
    try:
        result = fn()
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
    except (PackageFault, HarnessBug):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the package's code raised
        first = (str(exc).strip().splitlines() or [""])[0]
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith("reference.py")]
        at = f"{where}, line {lines[-1]}" if lines else where  # the innermost line of the package's own file
        raise PackageFault(f"{at}: {what} failed at {group.key}: {type(exc).__name__}: {first}") from None
    return result


def run_group(ctx: Context, group: plan.Group, tol: dict[str, Tolerance]) -> GroupOutcome:
    job, out = ctx.job, GroupOutcome()
    args = job.spec.arguments
    dev = ctx.device.type
    for cs in group.cases:
        ctx.progress(f"test {group.key} trial {cs.trial}")
        seed = derive_seed(job.seed, job.salt, group.key, cs.trial)
        try:
            pristine = package_call(ctx, "make_inputs()", group, lambda: generate(ctx.ref, args, cs, seed, dev))
        except PackageFault as exc:  # on a derived case: the case does not apply
            if group.declared:
                raise
            out.skipped = f"skipped: make_inputs() cannot produce it ({exc})"
            return out
        if room := room_needed(ctx, cs):
            out.skipped = f"skipped: {room}"
            return out
        case = Case(args, pristine, cs, dev, pool="candidate")
        rc = ctx.call(ctx.kernel, case.packed, cs.fp_bits)  # candidate first, on fresh allocations
        damage = check_inputs(case)
        base_rc, base_case = None, None
        if ctx.baseline is not None:
            base_case = Case(args, pristine, cs, dev, pool="baseline")  # memory the candidate's host never maps
            base_rc = ctx.call(ctx.baseline, base_case.packed, cs.fp_bits)
        try:
            refs = package_call(ctx, "reference()", group, lambda: case_reference(ctx.ref, args, pristine, cs))
        except PackageFault as exc:
            if group.declared:
                raise
            out.skipped = f"skipped: reference() cannot compute it ({exc})"
            return out
        if base_case is not None:
            base_msg = error_message(base_rc) if base_rc else check_outputs(base_case, refs, tol, out.base)
            base_msg = base_msg or check_inputs(base_case)
            if base_msg:
                out.base_ok = False
                if base_rc not in UNSUPPORTED and group.variant not in plan.NEEDS_BASELINE:
                    out.base_failure = base_msg
                # A baseline that refuses the call (a layout or shape it does not take) leaves the variant
                # to a candidate that refuses it too; one that takes it must compute it right.
                if not group.declared and (base_rc not in UNSUPPORTED or rc in UNSUPPORTED):
                    out.skipped = f"skipped: the baseline fails it too ({base_msg})"
                    return out
        # A call the baseline refuses too, or one in a dtype the package does not declare, may be refused.
        refusable = base_case is None or base_rc in UNSUPPORTED or group.variant.startswith(plan.UNDECLARED)
        if refusable and not group.declared and rc in UNSUPPORTED:
            out.skipped = f"skipped: the candidate does not take it ({error_message(rc)})"
            return out
        if rc != 0:
            out.message = error_message(rc)
            return out
        out.message = damage or check_outputs(case, refs, tol, out.cand)
        if out.message:
            return out
        case.refresh()
        rc = ctx.call(ctx.kernel, case.packed, cs.fp_bits)
        msg = error_message(rc) if rc else (check_inputs(case) or check_outputs(case, refs, tol, out.cand))
        if msg:
            out.message = f"second call on the same buffers: {msg}"
            return out
        del case, base_case, refs, pristine
    if not group.variant.startswith(plan.UNDECLARED):  # a dtype the package does not declare: its tolerance only
        calibrate(ctx, group, tol, out)
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


FAR_HEADROOM = 2 << 30  # device memory a far or huge case leaves free for everything else


def room_needed(ctx: Context, cs: plan.CaseSpec) -> str | None:
    """CUDA: why a far or huge case cannot run here, or None (also None for every other case).

    A far case's argument spans 8 or 16 GiB in each host's pool. The huge case needs each host's buffers,
    the pristine inputs, and the reference and the checks' float32 temporaries (about 8 of each output's size).
    """
    if not ctx.cuda or not (cs.far or cs.variant == plan.HUGE):
        return None
    args, pools = ctx.job.spec.arguments, ["candidate", *(["baseline"] if ctx.baseline is not None else [])]
    shapes = shapes_of(args, cs.dim_map)
    if cs.far:
        arg = next(a for a in args if a.name == cs.far)
        nbytes = far_bytes(shapes[arg.name], dtype_of(arg, cs.dtype))
        need = sum(ctx.arena.new_bytes(nbytes, pool) for pool in pools)
        what = f"{cs.far}'s rows 2^32 elements apart need"
    else:
        size = {a.name: math.prod(shapes[a.name]) * dtype_of(a, cs.dtype).itemsize for a in args}
        need = sum(ctx.arena.new_bytes(size[a.name], pool) for a in args for pool in pools)
        need += sum(size[a.name] for a in args if a.role != "out")
        need += sum(8 * 4 * math.prod(shapes[a.name]) for a in args if a.role != "in")
        what = "an argument of over 2^31 elements needs about"
    free = torch.cuda.mem_get_info(ctx.device)[0]
    if free >= need + FAR_HEADROOM:
        return None
    return f"{what} {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} free"


# The inputs of each call of an "update" sequence: the first as generated, then CHANGES in turn; all
# but the first change find the previous call's outputs still in place, as a caller's reused output buffer does (a
# kernel that skips a call whose outputs look done). Where the kernel has in-place arguments, CHAINED
# calls follow that change nothing: the kernel reads what it wrote itself, as a caller that applies
# it twice does (a kernel that skips a call on its own unchanged outputs). A "repeat" sequence makes a
# job-seeded number of calls in REPEAT_RANGE (log-uniform) on one small buffer set, a few elements
# changed before each, every other one with the outputs left in place (a kernel that counts its calls
# on a buffer, or its calls in a row, and turns lazy after many of them); REPEAT_CHECKED of them are
# checked: the first FEW, the last, the rest at random.
SWAPPED = "elements swapped"
CHANGES = ("one element", "a few elements", "one row", SWAPPED)
CHAINED = 2
REPEAT_RANGE = (200, 2000)
REPEAT_CHECKED = 32
FEW = 8
BURST_CALLS = 6


@dataclass
class Call:
    """One call of a sequence: on buffer set `buffer`, with inputs `inputs`; `keep`: outputs are left as
    the previous call wrote them instead of poisoned; `chain`: nothing is restaged, the inputs are the
    buffers as the previous call left them (`inputs` None); `check`: its outputs are checked."""

    buffer: int
    inputs: dict[str, torch.Tensor] | None
    what: str
    keep: bool = False
    chain: bool = False
    check: bool = True


def changed(pristine: dict[str, torch.Tensor], donor: dict[str, torch.Tensor], how: str,
            gen: torch.Generator) -> dict[str, torch.Tensor]:  # fmt: skip
    """A copy of the inputs with `how` many elements of every input replaced by the donor's (another draw
    of the same generator, so integers stay in range and floats in distribution), at random places."""
    out = {k: v.clone() for k, v in pristine.items()}
    for name, t in out.items():
        n = t.numel()
        if n == 0:
            continue
        if how == SWAPPED:
            _swap(t.view(-1), gen)
            continue
        if how == "one element":
            idx = torch.randint(0, n, (1,), generator=gen)
        elif how == "a few elements":
            idx = torch.randperm(n, generator=gen)[:FEW]
        else:
            w = t.shape[-1] if t.dim() else 1
            r = int(torch.randint(0, max(1, n // max(w, 1)), (1,), generator=gen))
            idx = torch.arange(r * w, min(n, (r + 1) * w))
        idx = idx.to(t.device)
        t.view(-1)[idx] = donor[name].reshape(-1)[idx]
    return out


def _swap(flat: torch.Tensor, gen: torch.Generator) -> None:
    """Two elements of different values (where a few tries find such) exchanged in place, 4, 8 or 12
    elements apart: the same lane of two 8-byte words. Nothing else changes, so a checksum that adds or
    xors elements, or words (a memo keyed on it), sees no change (red team, 2026-11-27: an additive
    checksum of 8-byte words, state kept on the stack). One pair only: a second pair in other lanes would
    change such a checksum and have the memo miss."""
    n, gap = flat.numel(), 4 * int(torch.randint(1, 4, (1,), generator=gen))
    if n <= gap:
        gap = 1
        if n <= gap:
            return
    for _ in range(8):
        i = int(torch.randint(0, n - gap, (1,), generator=gen))
        if bool(flat[i] != flat[i + gap]):
            break
    flat[[i, i + gap]] = flat[[i + gap, i]].clone()


def _restage(case: Case, pristine: dict[str, torch.Tensor], keep: bool) -> None:
    """New input contents at the same addresses (only what changed differs); outputs poisoned again
    unless `keep`."""
    case.pristine = pristine
    for arg in case.args:
        if arg.role != "out":
            case.tensors[arg.name].copy_(pristine[arg.name])
        elif not keep:
            poison(case.tensors[arg.name])


def repeat_calls(gen: torch.Generator) -> int:
    """The length of a repeat sequence: log-uniform in REPEAT_RANGE, from the job's seed."""
    lo, hi = REPEAT_RANGE
    return int(round(math.exp(math.log(lo) + float(torch.rand((), generator=gen)) * math.log(hi / lo))))


def sequence_plan(variant: str, firsts: list[dict], gen: torch.Generator, chain: bool = False) -> list[list[Call]]:
    """The calls of a sequence, in bursts: each inner list runs back to back and is checked after.
    `chain`: the kernel has in-place arguments (an update sequence ends with CHAINED calls)."""
    kept = ", the last outputs left in place"
    if variant == "update":  # one buffer set, its inputs changed step by step
        calls = [Call(0, firsts[0], "first call")]
        for i, how in enumerate(CHANGES, start=1):
            what = "two elements of every input swapped" if how == SWAPPED else f"{how} of every input changed"
            calls.append(Call(0, changed(calls[-1].inputs, firsts[i], how, gen),
                              f"after {what} in place{kept if i > 1 else ''}", i > 1))
        if chain:
            calls += [Call(0, None, f"called again on its own outputs ({k} of {CHAINED}: the in-place arguments "
                                    "hold what the last call wrote, nothing else changed)", True, True)
                      for k in range(1, CHAINED + 1)]  # fmt: skip
        return [[c] for c in calls]
    if variant == "repeat":  # one buffer set, called repeat_calls() times
        n = repeat_calls(gen)
        rest = torch.randperm(n - FEW - 1, generator=gen)[: max(0, REPEAT_CHECKED - FEW - 1)] + FEW
        checked = set(range(FEW)) | {n - 1} | set(rest.tolist())
        calls = [Call(0, firsts[0], "first call")]
        for k in range(1, n):
            keep = k % 2 == 0
            calls.append(Call(0, changed(calls[-1].inputs, firsts[1 + k % (len(firsts) - 1)], "a few elements", gen),
                              f"call {k + 1} of {n} on the same buffers, a few elements changed{kept if keep else ''}",
                              keep, check=k in checked))  # fmt: skip
        return [[c] for c in calls]
    # burst: BURST_CALLS buffer sets, each called back to back, twice
    again = [changed(p, firsts[(i + 1) % len(firsts)], "a few elements", gen) for i, p in enumerate(firsts)]
    return [[Call(i, p, f"burst 1, call {i + 1} of {len(firsts)}") for i, p in enumerate(firsts)],
            [Call(i, p, f"burst 2, call {i + 1} of {len(firsts)} (a few elements changed)")
             for i, p in enumerate(again)]]  # fmt: skip


def run_sequence(ctx: Context, group: plan.Group, tol: dict[str, Tolerance]) -> GroupOutcome:
    """Calls that change inputs the way callers do (docs/measurement.md, correctness 4):
    - "update": one call, then, on the same buffers, a call after each CHANGES of the inputs in place
      (a memo keyed on addresses and a sample of values, or on outputs that look done, answers stale),
      then, with in-place arguments, CHAINED calls on the kernel's own outputs (checked against the
      reference of the buffers as they are: a kernel that skips a call on what it wrote is stale);
    - "repeat": repeat_calls() calls on one small buffer set (a kernel that counts its calls turns wrong);
    - "burst": BURST_CALLS calls back to back on buffers of different inputs, then the same buffers
      with a few elements changed, back to back again; outputs checked only after each burst (a replay
      that fires only in a tight loop of calls answers wrong).
    The baseline runs the same sequence on its own buffers first where loaded: where it fails, the
    variant does not apply. Of a repeat sequence it runs only the checked calls (each restages its inputs
    in full): its errors there calibrate the candidate's; the calls between them test a kernel's state,
    which is the candidate's under test, and ran the baseline as often (half of a small job's time)."""
    job, out = ctx.job, GroupOutcome()
    args, dev = job.spec.arguments, ctx.device.type
    cs = group.cases[0]
    ctx.progress(f"test {group.key}")
    seed = derive_seed(job.seed, job.salt, group.key, cs.trial)
    gen = torch.Generator().manual_seed(seed)
    n_inputs = BURST_CALLS if group.variant == "burst" else 1 + len(CHANGES)
    try:
        firsts = package_call(ctx, "make_inputs()", group,
                              lambda: [generate(ctx.ref, args, cs, seed + i, dev) for i in range(n_inputs)])
    except PackageFault as exc:
        out.skipped = f"skipped: make_inputs() cannot produce it ({exc})"
        return out
    bursts = sequence_plan(group.variant, firsts, gen, chain=any(a.role == "inout" for a in args))
    shapes = shapes_of(args, cs.dim_map)

    def refer(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return package_call(ctx, "reference()", group, lambda: reference(ctx.ref, args, inputs, shapes))

    try:
        refs = {id(c.inputs): refer(c.inputs) for b in bursts for c in b if c.check and c.inputs is not None}
    except PackageFault as exc:
        out.skipped = f"skipped: reference() cannot compute it ({exc})"
        return out
    may_refuse = ctx.baseline is None  # no baseline, or one that refuses the call: the candidate may too
    if ctx.baseline is not None:
        base_bursts = [[c] for b in bursts for c in b if c.check] if group.variant == "repeat" else bursts
        msg = _sequence(ctx, ctx.baseline, args, cs, dev, base_bursts, refs, refer, tol, out.base)
        if msg:
            out.base_ok = False
            if not msg.startswith("UNSUPPORTED "):
                out.base_failure = msg if group.variant not in plan.NEEDS_BASELINE else None
                out.skipped = f"skipped: the baseline fails it too ({msg})"
                return out
            may_refuse = True  # refused: a candidate that takes the call is checked
    msg = _sequence(ctx, ctx.kernel, args, cs, dev, bursts, refs, refer, tol, out.cand)
    if msg:
        if may_refuse and msg.startswith("UNSUPPORTED "):
            out.skipped = f"skipped: the candidate does not take it ({msg.removeprefix('UNSUPPORTED ')})"
        else:
            out.message = msg.removeprefix("UNSUPPORTED ")
        return out
    calibrate(ctx, group, tol, out)
    return out


def _sequence(ctx: Context, kernel, args, cs: plan.CaseSpec, dev: str, bursts: list[list[Call]], refs: dict, refer,
              tol: dict[str, Tolerance], errors) -> str | None:  # fmt: skip
    """Run the planned calls of one kernel on its own buffers: each burst back to back, checked after
    it. A chained call's reference is computed here, from this kernel's own buffers (`refer`). The
    first failure, or None."""
    cases: dict[int, Case] = {}
    for burst in bursts:
        chained: dict[int, dict] = {}
        for c in burst:
            if c.chain:  # the inputs are what the buffers hold now
                case = cases[c.buffer]
                case.pristine = {a.name: case.tensors[a.name].clone() for a in args if a.role != "out"}
                chained[id(c)] = refer(case.pristine)
            elif c.buffer not in cases:
                cases[c.buffer] = Case(args, c.inputs, cs, dev, pool=kernel.role)
            else:
                _restage(cases[c.buffer], c.inputs, c.keep)
        rcs = [ctx.call(kernel, cases[c.buffer].packed) for c in burst]  # back to back, nothing checked between
        for c, rc in zip(burst, rcs):
            if rc:
                return f"{'UNSUPPORTED ' if rc in UNSUPPORTED else ''}{c.what}: {error_message(rc)}"
            if not c.check:
                continue
            case = cases[c.buffer]
            want = chained[id(c)] if c.chain else refs[id(c.inputs)]
            msg = check_inputs(case) or check_outputs(case, want, tol, errors)
            if msg:
                return f"{c.what}: {msg}"
    return None


def calibrate(ctx: Context, group: plan.Group, tols: dict[str, Tolerance], out: GroupOutcome) -> None:
    """Hold each output's max |err| to 2x the baseline's on that output (same inputs), or, without a
    baseline library, all outputs together to the baseline's own test run."""
    cand = total(out.cand)
    if not cand.seen:
        return
    if ctx.baseline is None:
        if group.key not in ctx.job.baseline_errors:
            return
        base, tol = ctx.job.baseline_errors[group.key], ctx.job.tolerances[group.dtype]
        out.bound = bound(base, cand.ref_max, tol)
        if cand.abs > out.bound:
            out.message = (f"max |err| {cand.abs:.4g} exceeds the calibrated bound {out.bound:.4g} (2x the baseline's "
                           f"{base:.4g} in its own test run, plus a floor): less accurate than the baseline")  # fmt: skip
        return
    if not out.base_ok:
        return
    worst = None  # (err / bound, name, err, bound, baseline err)
    for name, errs in out.cand.items():
        if not (errs.seen and out.base[name].seen):
            continue
        b = bound(out.base[name].abs, errs.ref_max, tols[name])
        if worst is None or errs.abs / b > worst[0]:
            worst = (errs.abs / b, name, errs.abs, b, out.base[name].abs)
    if worst is None:
        return
    _, name, err, out.bound, base = worst
    if err > out.bound:
        out.message = (
            f"{name}: max |err| {err:.4g} exceeds the calibrated bound {out.bound:.4g} (2x the baseline's {base:.4g} "
            "on the same inputs, plus a floor): less accurate than the baseline"
        )
