"""The output checks' one-pass screen (gpu_worker.checks._passes) passes only what the check-by-check path
passes, with the same errors, and leaves the kernel's output as it found it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from gpu_worker import checks
from gpu_worker.cases import POISON
from kopt.models import Argument, Tolerance

NAN, INF = float("nan"), float("inf")


def _check(raw: torch.Tensor, want: torch.Tensor, tol: Tolerance, exact: bool, screen: bool = True,
           role: str = "out"):  # fmt: skip
    """check_outputs on one output: (message, (max |err|, max rel, max |ref|) or None)."""
    arg = Argument(name="y", role=role, shape=["N"], exact=exact)
    case = SimpleNamespace(args=[arg], tensors={"y": raw})
    errors = checks.errors_by_output()
    saved = checks._passes
    if not screen:
        checks._passes = lambda *a: None
    try:
        msg = checks.check_outputs(case, {"y": want}, {"y": tol}, errors)
    finally:
        checks._passes = saved
    e = errors["y"]
    return msg, ((e.abs, e.rel, e.ref_max) if e.seen else None)


def _poison(t: torch.Tensor, i: int) -> None:
    int_dtype, bits = POISON[t.dtype]
    t.view(int_dtype)[i] = bits


def _drawn_case(rng: random.Random, device: str = "cpu"):
    n = rng.randint(1, 40)
    dtype = rng.choice([torch.float16, torch.bfloat16, torch.float32])
    want = torch.randn(n, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    want *= rng.choice([1.0, 1e-3, 1e3, 0.0])
    if rng.random() < 0.2:
        want[rng.randrange(n)] = rng.choice([NAN, INF, -INF, 0.0, 1e30])
    raw = want.to(dtype).clone()
    kind = rng.random()
    if kind < 0.25:  # one element off by an amount around the tolerance, or not finite
        raw[rng.randrange(n)] += rng.choice([1e-5, 1e-3, 2e-3, 1e-2, 1.0, NAN, -INF])
    elif kind < 0.35:
        raw.zero_()
    elif kind < 0.45:
        _poison(raw, rng.randrange(n))
    elif kind < 0.5:
        raw.neg_()
    tol = Tolerance(rtol=rng.choice([0.0, 1e-3, 1.6e-2]), atol=rng.choice([0.0, 1e-5, 1e-3]))
    return raw.to(device), want.to(device), tol, rng.random() < 0.2


@pytest.mark.parametrize("device, cases", [("cpu", 2500), pytest.param("cuda", 600, marks=pytest.mark.gpu)])
def test_the_screen_passes_only_what_every_check_passes_with_the_same_errors(device, cases):
    rng = random.Random(20261127)
    screened = 0
    for _ in range(cases):
        raw, want, tol, exact = _drawn_case(rng, device)
        fast = checks._passes(raw.clone(), want, tol, exact)
        role = rng.choice(["out", "inout"])
        full = _check(raw.clone(), want, tol, exact, screen=False, role=role)
        if fast is not None:
            screened += 1
            assert full[0] is None, (raw, want, tol, exact, full)
            assert tuple(fast) == full[1]
        assert _check(raw.clone(), want, tol, exact, role=role) == full  # with the screen: the same verdict, errors
    assert screened > cases // 4  # the screen decides most passing outputs itself


@pytest.mark.parametrize("how, expect", [
    ("poison", "never written"),
    ("nan", "NaN/Inf where the reference is finite"),
    ("zeros", "all zeros"),
    ("just_over", "mismatch"),
    ("exact_ulp", "bit for bit"),
])  # fmt: skip
def test_each_kind_of_wrong_output_gets_its_own_message(how, expect):
    """The outputs that would slip past a screen that only looked at maxima or at a sample."""
    want = torch.linspace(-3.0, 5.0, 4099)
    raw = want.to(torch.float16)
    tol, exact = Tolerance(rtol=1e-3, atol=1e-3), how == "exact_ulp"
    if how == "poison":
        _poison(raw, 4098)
    elif how == "nan":
        raw[2049] = NAN
    elif how == "zeros":  # within atol of a reference that is not zero
        want = want * 1e-4
        raw.zero_()
    elif how == "just_over":  # the one element over atol + rtol * |ref|, by a hair
        want = raw.float()
        want[4000] += 1e-3 + 1e-3 * float(want[4000].abs()) + 1e-4
    elif how == "exact_ulp":
        want = raw.float()
        raw.view(torch.int16)[7] += 1
    assert checks._passes(raw, want, tol, exact) is None
    msg, _ = _check(raw, want, tol, exact)
    assert msg is not None and expect in msg, msg


def test_a_float32_output_is_checked_without_being_changed():
    """raw.to(float32) of a float32 tensor is the tensor itself: the screen must work on a copy, or it would
    leave |err| in the kernel's output for the next check (the second call's inputs, the guards) to read."""
    want = torch.randn(1000)
    raw = want + 1e-7
    before = raw.clone()
    assert checks._passes(raw, want, Tolerance(rtol=1.3e-6, atol=1e-5), False) is not None
    assert torch.equal(raw, before)
