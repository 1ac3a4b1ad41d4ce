"""Correctness checks of one call: outputs against the reference, inputs and guards untouched.

Order of the output checks (docs/measurement.md, correctness 3): never written (poison intact), NaN/Inf
where the reference is finite, special values, bit-exact outputs, closeness under the package's
per-dtype tolerance, then all zeros. Each output is held to the tolerance of its own dtype, and its
errors are kept apart from the other outputs', so a group of calls can hold every output to the
baseline's own error on that output for the same inputs (calibrated bound, see `bound`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from gpu_worker.cases import POISON, SAME_SIZE_INT, Case, poison_mask
from kopt.models import Argument, Tolerance

FLOOR_REL = 2.0**-20  # calibration floor, relative to max |ref|: ~8 fp32 ulp, far below a 16-bit ulp
FLOOR_ATOL = 1e-3  # and relative to the package's atol
BASELINE_FACTOR = 2.0  # a candidate may be at most this much worse than the baseline (max |err|)


@dataclass
class Errors:
    """Running max abs/rel error and max |reference| over the outputs of a group of calls."""

    abs: float = 0.0
    rel: float = 0.0
    ref_max: float = 0.0
    seen: bool = False

    def update(self, abs_err: float, rel_err: float, ref_max: float) -> None:
        self.abs, self.rel = max(self.abs, abs_err), max(self.rel, rel_err)
        self.ref_max, self.seen = max(self.ref_max, ref_max), True


ErrorsByOutput = dict[str, Errors]  # per output argument


def errors_by_output() -> ErrorsByOutput:
    return defaultdict(Errors)


def total(errors: ErrorsByOutput) -> Errors:
    """The errors of all outputs together (what a ShapeCheck reports)."""
    out = Errors()
    for e in errors.values():
        if e.seen:
            out.update(e.abs, e.rel, e.ref_max)
    return out


def output_tolerances(args: list[Argument], tolerances: dict[str, Tolerance], run_dtype: str) -> dict[str, Tolerance]:
    """Each output's tolerance from its own dtype (a float32 output of a half run is held to float32)."""
    return {a.name: tolerances[a.dtype or run_dtype] for a in args if a.role != "in"}


def bound(baseline_abs: float, ref_max: float, tol: Tolerance) -> float:
    """The calibrated cap on a candidate's max |err|: 2x the baseline's, plus a tiny floor."""
    return BASELINE_FACTOR * baseline_abs + max(FLOOR_REL * ref_max, FLOOR_ATOL * tol.atol)


def _expected(want: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """The reference in float32/64; values the output dtype cannot hold become the inf it rounds to."""
    want = want.to(raw.device)
    want = want if want.dtype == torch.float64 else want.float()
    if raw.dtype in (torch.float16, torch.bfloat16) and want.numel():
        top = torch.finfo(raw.dtype).max
        low, high = (float(v) for v in torch.aminmax(want))
        if not (-top <= low and high <= top):  # a value the dtype cannot hold (or a NaN): round them all
            stored = want.to(raw.dtype).to(want.dtype)
            want = torch.where(torch.isinf(stored) & torch.isfinite(want), stored, want)
    return want


def check_outputs(case: Case, refs: dict[str, torch.Tensor], tols: dict[str, Tolerance], errors: ErrorsByOutput,
                  ) -> str | None:  # fmt: skip
    """First failed output check of one call, or None; updates `errors` (per output) with this call's
    errors. `tols`: each output's tolerance (output_tolerances). Where the reference is finite everywhere
    (the common case), the NaN/Inf checks take one pass each (they count only where they fail)."""
    for arg in case.args:
        if arg.role == "in":
            continue
        tol = tols[arg.name]
        raw = case.tensors[arg.name]
        want = _expected(refs[arg.name], raw)
        passed = _passes(raw, want, tol, arg.exact)
        if passed is not None:
            errors[arg.name].update(*passed)
            continue
        got = raw.to(want.dtype)
        finite = torch.isfinite(want)
        all_finite = bool(finite.all())
        numel, name = want.numel(), arg.name
        if arg.role == "out":
            never = poison_mask(raw)
            n = int(torch.count_nonzero(never if all_finite else never & finite))
            if n:
                return f"{name}: {n} of {numel} elements never written (still the NaN poison)"
        got_finite = torch.isfinite(got)
        n = numel - int(torch.count_nonzero(got_finite)) if all_finite else \
            int(torch.count_nonzero(~got_finite & finite))  # fmt: skip
        if n:
            return f"{name}: {n} of {numel} elements are NaN/Inf where the reference is finite"
        if all_finite:
            diff, scale = (got - want).abs_(), want.abs()
        else:
            n = int(torch.count_nonzero(~finite & ~((torch.isnan(got) & torch.isnan(want)) | (got == want))))
            if n:
                return f"{name}: {n} elements differ from the reference's NaN/Inf values"
            diff = torch.where(finite, (got - want).abs(), torch.zeros_like(want))
            scale = torch.where(finite, want.abs(), torch.zeros_like(want))
        if numel:
            rel = diff / scale.clamp_min(max(tol.atol, 1e-30))
            errors[arg.name].update(*torch.stack([diff.max(), rel.max(), scale.max()]).tolist())
        if arg.exact:
            n = int(torch.count_nonzero(finite & (got != want)))
            if n:
                return f"{name}: {n} of {numel} elements mismatch; this output must match the reference bit for bit"
            continue
        bad = diff > tol.atol + tol.rtol * scale
        n = int(torch.count_nonzero(bad))
        if n:
            at = int(torch.argmax(torch.where(bad, diff, torch.full_like(diff, -1.0))))
            idx = [int(i) for i in torch.unravel_index(torch.tensor(at), want.shape)]
            shown_got, shown_want = distinct(float(got.flatten()[at]), float(want.flatten()[at]))
            return (
                f"{name}: {n} of {numel} elements mismatch; worst at {idx}: got {shown_got}, "
                f"expected {shown_want} (|err| {float(diff.flatten()[at]):.3g} > "
                f"atol {tol.atol:g} + rtol {tol.rtol:g} * |ref|; kernel.toml [tolerances.{dtype_name(raw)}] sets them)"
            )
        if numel and int(torch.count_nonzero(got)) == 0 and int(torch.count_nonzero(want)) != 0:
            return f"{name}: output is all zeros while the reference is not"
    return None


def _passes(raw: torch.Tensor, want: torch.Tensor, tol: Tolerance, exact: bool) -> tuple[float, float, float] | None:
    """The output's (max |err|, max rel err, max |ref|) where it passes every check of check_outputs, None
    where any of them might fail (check_outputs then looks at it check by check, for the message). Two
    buffers and reductions instead of a dozen full-size temporaries: 3-4x less time on a large output.
    Where the reference and the errors are finite (maxima propagate NaN), the output holds no NaN/Inf and
    so no poison (NaN bits). An all-zero output has |err| = |ref| everywhere, so max |err| < max |ref|
    rules it out. The tolerance test is the same arithmetic as check_outputs's, compared by subtraction
    (a difference of finite floats is 0 only where they are equal; <= 0 sends the output there)."""
    if not raw.is_floating_point() or raw.dtype not in POISON or not want.numel():
        return None
    err, work = raw.to(want.dtype, copy=True), want.abs()  # a copy even where the dtypes match
    err.sub_(want).abs_()
    abs_max, ref_max = float(err.max()), float(work.max())
    if not (math.isfinite(abs_max) and math.isfinite(ref_max)) or (exact and abs_max != 0.0):
        return None
    if ref_max > 0 and abs_max >= ref_max:  # perhaps all zeros
        return None
    rel_max = float(torch.div(err, work.clamp_min_(max(tol.atol, 1e-30)), out=work).max())
    torch.abs(want, out=work).mul_(tol.rtol).add_(tol.atol).sub_(err)  # (atol + rtol * |ref|) - |err|
    if not exact and float(work.min()) <= 0.0:
        return None
    return abs_max, rel_max, ref_max


def distinct(got: float, want: float) -> tuple[str, str]:
    """Two values printed with as many significant digits (6 to 9) as it takes to tell them apart."""
    for digits in range(6, 10):
        a, b = f"{got:.{digits}g}", f"{want:.{digits}g}"
        if a != b:
            break
    return a, b


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_inputs(case: Case) -> str | None:
    """Inputs not declared in-place must be unchanged; nothing may be written outside any buffer."""
    for arg in case.args:
        if arg.role != "in":
            continue
        now, before = case.tensors[arg.name], case.pristine[arg.name]
        int_dtype = SAME_SIZE_INT[now.element_size()]
        now_bits, before_bits = now.contiguous().view(int_dtype), before.view(int_dtype)
        if not torch.equal(now_bits, before_bits):
            n = int(torch.count_nonzero(now_bits != before_bits))
            return f"{arg.name}: input modified by the kernel ({n} of {now.numel()} elements changed)"
    for arg in case.args:
        n = case.buffers[arg.name].damage()
        if n:
            return (
                f"{arg.name}: {n} elements written outside the buffer (guard zone or row padding): "
                "out-of-bounds or aliasing writes"
            )
    return None
