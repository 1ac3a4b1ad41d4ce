"""Input classes the harness plants itself, whatever the package's make_inputs() draws.

A generator of random normals never yields a row of zeros, a row equal to another, a row of one
value, values near the dtype's limits, a NaN or an infinity, or a weight of exactly one; kernels that
take shortcuts on such rows (skip a zero row, treat a leading run of zeros as padding, memoize a
repeated row, read a NaN as padding, skip work for a unit gain) pass every random test. Each kind below rewrites a seeded share of the rows (the last
dimension) of every float input the package lets the harness rescale (kernel.toml `scale`, default
true: tables and integer inputs are left alone). Rows are chosen alike in every input of the same
row count, so a zero row of `input` meets a zero row of `residual`, plus a few rows of each input
alone. docs/measurement.md, correctness 2.
"""

from __future__ import annotations

import math

import torch

from gpu_worker.plan import PLANTED_KINDS as KINDS
from gpu_worker.plan import plantable
from kopt.models import Argument

SHARE = 4  # about 1 row in SHARE of every planted input gets the kind
# "magnitudes": values up to this over sqrt(row width) (a quarter of the dtype's top at most), so a row's
# sum of squares stays finite in float32; float16 reaches a quarter of its top (a gate of 16000).
MAGNITUDE_TOP = 2.0**63
OUTLIER_RANGE = (7.0, 11.0)  # "outlier-channel": the outlier is 2^7 to 2^11 times its row's RMS (log-uniform)
MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}  # stored fraction bits


def plant(kind: str, args: list[Argument], inputs: dict[str, torch.Tensor], seed: int) -> None:
    """Rewrite rows of the plantable inputs (a tensor of fewer than 2 rows is left alone)."""
    if kind not in KINDS:
        raise ValueError(f"unknown planted kind {kind!r}")
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    names = [a.name for a in args if plantable(a) and a.name in inputs and inputs[a.name].dim() >= 1]
    shared: dict[int, torch.Tensor] = {}  # row count -> the rows every input of that count shares
    taken: dict[int, set[int]] = {}  # row count -> rows already planted in some input (shared or own)
    levels: dict[int, torch.Tensor] = {}  # row count -> a place in the dtype's range per row (binades, extremes)
    channels: dict[int, tuple[int, float]] = {}  # row width -> the outlier's column and its size over a row's RMS
    for name in names:
        t = inputs[name]
        if kind == "ones" and t.dim() == 1:  # a gain of exactly one everywhere (a norm without a learned scale)
            inputs[name] = torch.ones_like(t)
            continue
        rows = t.reshape(-1, row_width(t)) if t.numel() else None
        if rows is None or rows.shape[0] < 2 or rows.shape[1] == 0:
            continue
        n = rows.shape[0]
        if kind in ("binades", "extremes") and n not in levels:
            levels[n] = _levels(kind, n, gen)
        if kind == "outlier-channel":  # activations ([T, H], [T, 2D]), not a 1-D weight
            if t.dim() >= 2:
                _outlier_channel(rows, inputs, name, t, channels, gen)
            continue
        if kind == "extremes":  # every row, the regimes in turn: each regime meets a job of four rows or more
            picked = torch.arange(n)
        else:
            picked = _pick(n, shared, taken, gen)
        if kind in ("same-as-other", "cancelling"):
            _from_other(name, names, inputs, picked, gen, kind == "cancelling")
            continue

        work = rows.double().cpu()  # planted on the CPU (the seeded generator's device), then moved back
        if kind == "binades":
            _binades(work, picked, levels[n][picked], gen, t.dtype)
        elif kind == "extremes":
            _extremes(work, picked, levels[n][picked], gen, t.dtype)
        else:
            _apply(kind, work, picked, gen, t.dtype)
        inputs[name] = work.to(dtype=t.dtype, device=t.device).reshape(t.shape)


def _outlier_channel(rows: torch.Tensor, inputs: dict[str, torch.Tensor], name: str, t: torch.Tensor,
                     channels: dict[int, tuple[int, float]], gen: torch.Generator) -> None:  # fmt: skip
    """A massive activation (as served LLMs have: one channel 100 to 2000 times a row's RMS, in every row at
    the same column): every row of the input gets a positive value OUTLIER_RANGE times the RMS of its
    other values (a quarter of the dtype's top at most) at one column in the first half of the row, the same
    column and factor in every input of that width (input and residual's channel add up). A silu and an
    rmsnorm wrong only where the next row's outlier is in the same channel passed every other class (red
    team, 2026-11-27). Positive: a gate's negative outlier makes silu's output about zero, which hides a
    wrong one there."""
    n, w = rows.shape
    if w not in channels:
        lo, hi = OUTLIER_RANGE
        factor = 2.0 ** (lo + (hi - lo) * float(torch.rand((), generator=gen)))
        channels[w] = (int(torch.randint(0, max(w // 2, 1), (), generator=gen)), factor)
    col, factor = channels[w]
    work = rows.double().cpu()
    others = torch.cat([work[:, :col], work[:, col + 1:]], dim=1)
    rms = others.square().mean(dim=1).sqrt().clamp_min(2.0**-8) if others.shape[1] else torch.ones(n).double()
    work[:, col] = (rms * factor).clamp(-torch.finfo(t.dtype).max / 4, torch.finfo(t.dtype).max / 4)
    inputs[name] = work.to(dtype=t.dtype, device=t.device).reshape(t.shape)


def _levels(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """Each of n rows' place in [0, 1) of its dtype's range, the same in every input of n rows: at random
    ("binades"), or the four regimes in turn by row from a seeded start ("extremes")."""
    if kind == "binades":
        return torch.rand(n, generator=gen, dtype=torch.float64)
    start = int(torch.randint(0, 4, (1,), generator=gen))
    return ((torch.arange(n) + start) % 4 + 0.5).double() / 4


def _pick(n: int, shared: dict[int, torch.Tensor], taken: dict[int, set[int]], gen: torch.Generator) -> torch.Tensor:
    """The rows of one input of n rows to plant: the rows every input of n rows shares (drawn for the first),
    and rows of this input alone, drawn from rows no input has planted yet, so each input has some (a zero
    row of residual under a nonzero row of input, say) wherever rows are left."""
    per = max(1, n // SHARE)
    if n not in shared:
        shared[n] = torch.randperm(n, generator=gen)[:per]
        taken[n] = set(shared[n].tolist())
    free = [r for r in torch.randperm(n, generator=gen).tolist() if r not in taken[n]]
    own = torch.tensor(free[: max(1, per // 2)], dtype=torch.int64)
    taken[n] |= set(own.tolist())
    return torch.unique(torch.cat([shared[n], own]))


def row_width(t: torch.Tensor) -> int:
    """The last dimension; a 1-D tensor is taken as rows of its largest divisor up to 64."""
    if t.dim() >= 2:
        return t.shape[-1]
    return next(w for w in range(min(64, t.numel()), 0, -1) if t.numel() % w == 0)


def _apply(kind: str, rows: torch.Tensor, picked: torch.Tensor, gen: torch.Generator, dtype: torch.dtype) -> None:
    n, w = rows.shape
    if kind == "zeros":
        rows[picked] = 0.0
    elif kind == "repeated":  # a row equal to another row of the same input
        src = torch.randint(0, n, (len(picked),), generator=gen)
        rows[picked] = rows[src].clone()
    elif kind == "sparse":  # most values zero, about 1 in 16 kept
        keep = torch.rand((len(picked), w), generator=gen) < 1 / 16
        rows[picked] = torch.where(keep, rows[picked], torch.zeros_like(rows[picked]))
    elif kind == "constant":  # one value repeated along the row
        rows[picked] = rows[picked][:, :1].expand(-1, w).clone()
    elif kind == "leading-zeros":  # the first half of the row (a gate, say), or a shorter prefix, zero
        for i, r in enumerate(picked.tolist()):
            k = w // 2 if i % 2 == 0 else int(torch.randint(1, max(2, w // 2), (1,), generator=gen))
            rows[r, : max(1, k)] = 0.0
    elif kind == "ones":  # rows of exactly 1.0
        rows[picked] = 1.0
    elif kind == "lowest":  # rows at the dtype's lowest finite value: an additive mask's fill (finfo.min), the
        # LSE of a fully masked chunk; shared rows meet in every input (both LSEs of a pair masked). A
        # merge whose running max started at -1e30 instead of -inf made NaN of two such LSEs and passed
        # every other class (red team, 2026-11-27). A 16-bit storage type gets a quarter of its lowest:
        # bfloat16's reaches float32's, where a weighted sum of two such values (merge's v) overflows.
        rows[picked] = torch.finfo(dtype).min / (1 if dtype == torch.float32 else 4)
    elif kind == "nonfinite":  # NaN, +inf and -inf (an upstream overflow, an empty state) in each half of a row
        # Each half of every picked row gets the three values at seed-chosen columns: a row that is a gate and
        # its values ([T, 2D] of silu_and_mul) gets -inf in the gate, where one per row at a random column
        # left it out of most tests (red team, 2026-11-26: a kernel writing garbage at a -inf gate passed).
        values = (math.nan, math.inf, -math.inf)
        half = max(w // 2, 1)
        for i, r in enumerate(picked.tolist()):
            for lo, hi in ((0, half), (half, w)):
                cols = lo + torch.randperm(max(hi - lo, 0), generator=gen)[: len(values)]
                for k, c in enumerate(cols.tolist()):
                    rows[r, c] = values[(i + k) % len(values)]
    elif kind in ("huge", "tiny"):
        info = torch.finfo(dtype)
        sign = torch.where(torch.rand((len(picked), w), generator=gen) < 0.5, -1.0, 1.0).double()
        if kind == "huge":  # 1/32 .. 1/2 of the dtype's top over sqrt(width): a row's sum of squares stays finite
            top = info.max if info.max < 1e5 else info.max**0.5  # float16: its max; wider types: sqrt(max)
            mag = top / max(w, 1) ** 0.5 * torch.exp2(-1 - 4 * torch.rand((len(picked), w), generator=gen))
        else:  # around the smallest normal, some subnormal
            mag = info.tiny * torch.exp2(8 * torch.rand((len(picked), w), generator=gen) - 4)
        rows[picked] = sign * mag.double()
    elif kind == "magnitudes":  # every binade, log-uniform from the smallest normal up to MAGNITUDE_TOP
        info = torch.finfo(dtype)
        sign = torch.where(torch.rand((len(picked), w), generator=gen) < 0.5, -1.0, 1.0).double()
        lo, hi = math.log2(info.tiny), math.log2(min(info.max / 4, MAGNITUDE_TOP / max(w, 1) ** 0.5))
        mag = torch.exp2(lo + (hi - lo) * torch.rand((len(picked), w), generator=gen).double())
        rows[picked] = sign * mag


def _binades(rows: torch.Tensor, picked: torch.Tensor, level: torch.Tensor, gen: torch.Generator,
             dtype: torch.dtype) -> None:  # fmt: skip
    """Each picked row at one binade of the dtype's whole range, from 2^-8 up to a quarter of its top, the
    binade at the row's `level` (shared by every input of that row count: both LSEs of a merged pair meet
    at -1e25 together); signs and mantissas random. A merge that took LSEs between -1e36 and -1e20 for
    empty passed every other class, whose values stop at 2^63 over the square root of the row width or
    jump to the dtype's lowest (red team, 2026-11-27)."""
    top = math.floor(math.log2(torch.finfo(dtype).max / 4))
    exp = torch.floor(-8 + level * (top + 9)).clamp_max(top)
    w = rows.shape[1]
    sign = torch.where(torch.rand((len(picked), w), generator=gen) < 0.5, -1.0, 1.0).double()
    mant = 1 + torch.rand((len(picked), w), generator=gen, dtype=torch.float64)
    rows[picked] = sign * mant * torch.exp2(exp)[:, None]


EXTREME_BANDS = ((-8.0, -2.0), (-2.0, 7.0))  # log2 magnitudes of the "low" and "mid" bands; "top" is the dtype's


def _extremes(rows: torch.Tensor, picked: torch.Tensor, level: torch.Tensor, gen: torch.Generator,
              dtype: torch.dtype) -> None:  # fmt: skip
    """Each row in one regime, in turn by row (`level`, the same in every input of that row count): every
    element low (2^-8 .. 2^-2: a row whose rms is below 1), every element mid (2^-2 .. 2^7), every element
    at the top (a 64th to a quarter of the dtype's top), or each element in one of the three at random. Where a product of a mid and a top
    value, or a top value and an inverse rms, overflows float32 though the result is finite, a kernel that
    multiplies in another order than the reference is wrong: silu's g * u before the division, a norm's
    scale * w before s (red team, 2026-11-27: accepted with bfloat16 values up to 1e32 only)."""
    w = rows.shape[1]
    top = math.log2(torch.finfo(dtype).max / 4)
    bands = torch.tensor([*EXTREME_BANDS, (top - 4, top)], dtype=torch.float64)
    regime = (level * 4).long().clamp_max(3)[:, None].expand(-1, w)
    mixed = torch.randint(0, 3, (len(picked), w), generator=gen)
    band = bands[torch.where(regime == 3, mixed, regime)]
    u = torch.rand((len(picked), w), generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand((len(picked), w), generator=gen) < 0.5, -1.0, 1.0).double()
    rows[picked] = sign * torch.exp2(band[..., 0] + u * (band[..., 1] - band[..., 0]))


def _from_other(name: str, names: list[str], inputs: dict[str, torch.Tensor], picked: torch.Tensor,
                gen: torch.Generator, cancel: bool) -> None:  # fmt: skip
    """Rows equal to the same rows of another input of the same shape and dtype (ties, x == residual), or,
    `cancel`, their negation off by a few units in the last place: x + residual a thousandth of either (a
    norm that expanded (x + r)^2 into x^2 + 2xr + r^2 in float32 kept nothing of it and passed every other
    class: red team, 2026-11-27)."""
    t = inputs[name]
    twins = [o for o in names if o != name and inputs[o].shape == t.shape and inputs[o].dtype == t.dtype]
    if not twins or names.index(name) < names.index(twins[0]):
        return  # the first of a pair is the source
    w = row_width(t)
    rows = t.reshape(-1, w).clone()
    src = inputs[twins[0]].reshape(-1, w)[picked.to(t.device)]
    if cancel:
        off = 2.0 ** -MANTISSA[t.dtype] * torch.randint(1, 9, (len(picked), w), generator=gen).double().to(t.device)
        src = (-src.double() * (1 - off)).to(t.dtype)
    rows[picked.to(t.device)] = src
    inputs[name] = rows.reshape(t.shape)
