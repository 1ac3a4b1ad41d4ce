"""Test mode: check the candidate against the reference over the test plan (docs/measurement.md).

Per case: the candidate runs first, on fresh poisoned allocations; then its inputs and guard
zones are checked; then the baseline (when loaded) runs on its own buffers over the same inputs;
then the reference; then the candidate's outputs are checked; then the candidate runs again on
the same, re-poisoned buffers (catches kernels that answer once per address). Per group the
candidate's max |err| must stay within 2x the baseline's on the same inputs (calibration).
Variants (edge shapes, scales, layouts) count only where they apply: where the baseline passes
them, or without a baseline where the candidate accepts the shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gpu_worker import plan
from gpu_worker.abi import UNSUPPORTED, error_message
from gpu_worker.cases import Case, generate, reference, shapes_of, supports_special
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
    bound: float | None = None


def special_differs(ctx: Context, dtype: str) -> bool:
    """Whether make_inputs(special=True) plants anything: at the job's smallest shape, its inputs
    differ from the same seed's without it (bit for bit, NaN included)."""
    shape = min(ctx.job.shapes, key=lambda s: math.prod(s.dims.values()))
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
    groups = plan.test_plan(job.spec, job.target, job.shapes, job.dtypes, job.trials, job.edge_shapes, special)
    checks: list[ShapeCheck] = []
    variant_checks: list[ShapeCheck] = []
    reason = None
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
        out = run_group(ctx, group, output_tolerances(job.spec.arguments, job.tolerances, group.dtype))
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
            reason = f"{group.key}: {out.message}"
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
    )  # fmt: skip


def run_group(ctx: Context, group: plan.Group, tol: dict[str, Tolerance]) -> GroupOutcome:
    job, out = ctx.job, GroupOutcome()
    args = job.spec.arguments
    dev = ctx.device.type
    for cs in group.cases:
        ctx.progress(f"test {group.key} trial {cs.trial}")
        seed = derive_seed(job.seed, job.salt, group.key, cs.trial)
        try:
            pristine = generate(ctx.ref, args, cs, seed, dev)
        except Exception as exc:  # noqa: BLE001 - a package error on a derived case: the case does not apply
            if group.declared:
                raise
            out.skipped = f"skipped: make_inputs() cannot produce it ({type(exc).__name__}: {exc})"
            return out
        case = Case(args, pristine, cs, dev)
        rc = ctx.call(ctx.kernel, case.packed)  # candidate first, on fresh allocations
        damage = check_inputs(case)
        base_rc, base_case = None, None
        if ctx.baseline is not None:
            base_case = Case(args, pristine, cs, dev)
            base_rc = ctx.call(ctx.baseline, base_case.packed)
        try:
            refs = reference(ctx.ref, args, pristine, shapes_of(args, cs.dim_map))
        except Exception as exc:  # noqa: BLE001
            if group.declared:
                raise
            out.skipped = f"skipped: reference() cannot compute it ({type(exc).__name__}: {exc})"
            return out
        if base_case is not None:
            base_msg = error_message(base_rc) if base_rc else check_outputs(base_case, refs, tol, out.base)
            base_msg = base_msg or check_inputs(base_case)
            if base_msg:
                out.base_ok = False
                if not group.declared:
                    out.skipped = f"skipped: the baseline fails it too ({base_msg})"
                    return out
        elif not group.declared and rc in UNSUPPORTED:
            out.skipped = f"skipped: the candidate does not take it ({error_message(rc)})"
            return out
        if rc != 0:
            out.message = error_message(rc)
            return out
        out.message = damage or check_outputs(case, refs, tol, out.cand)
        if out.message:
            return out
        case.refresh()
        rc = ctx.call(ctx.kernel, case.packed)
        msg = error_message(rc) if rc else (check_inputs(case) or check_outputs(case, refs, tol, out.cand))
        if msg:
            out.message = f"second call on the same buffers: {msg}"
            return out
        del case, base_case, refs, pristine
    calibrate(ctx, group, tol, out)
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


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
