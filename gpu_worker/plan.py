"""What a test job checks: declared shapes, derived edge shapes and input variants (no torch).

Every declared shape and dtype gets `trials` seeded trials plus one trial per input scale; the
package's declared test shapes also yield edge shapes (all symbols 1, one symbol at a time 1 and
every value 2..8, every symbol a prime near its value) and one padded-row layout, each kept cheap by an element
budget. On top (issue #25): shapes drawn from the package's ranges and its declared sizes (fuzz.py),
input classes planted into the inputs (planted.py), outputs that start as zeros or garbage instead of
the poison, and the update, repeat and burst sequences (correctness.run_sequence). Variants are
enforced only where they apply: where the baseline passes them, or, without a baseline, where the
candidate accepts the shape (see correctness.py).
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field

from kopt import expr
from kopt.models import Argument, KernelSpec, Shape
from kopt.package import is_integer, shape_symbols

# Elements over all arguments: edge shapes stay under EDGE_BUDGET, scale and layout variants
# run on declared shapes under VARIANT_BUDGET (CPU kernels are single-threaded and slow).
EDGE_BUDGET = {"cpu": 1 << 18, "cuda": 1 << 22}
VARIANT_BUDGET = {"cpu": 1 << 20, "cuda": 1 << 26}
SCALES = (0.01, 100.0)  # input scales of the scale variants (docs/measurement.md, correctness 2)
ROW_PAD = 8  # elements of padding per row in the strided variant (keeps 16-byte alignment)
# Layouts beyond "strided" (every argument's rows padded alike), as callers pass views: "mixed", each
# argument's rows padded by another multiple of ROW_PAD (0, 1, 2 in turn: an input strided and the
# residual dense); "offset", every base a few elements past an aligned address (a view with a storage
# offset); "transposed", 2-D arguments whose inner stride is not 1 (a [T, NH] view of an [NH, T] tensor).
# Where an argument is 3-D: "planes", every 3-D argument with dense rows and a spare row per plane (some
# heads of a wider tensor: the outer stride is not the product of the inner ones; padded 3-D arguments
# of the other layouts get one too), the others dense; "heads-major", every 3-D argument's first two
# dimensions swapped in storage ([T, NH, D] of an [NH, T, D] tensor), the others dense; "decoy", every
# 3-D argument [A, B, C] in [B, A, B * C] storage: its outer stride is the dense one (B * C), its middle one
# is not (a kernel that checks only the outer stride for a dense fast path reads wrong: red team,
# 2026-11-27). "interleaved": every other argument (the first, third... or by the turn the second,
# fourth...) every other element of a wider tensor (inner stride 2; a baseline that needs dense rows of its
# values may still take strided scales), and at each one-row edge shape both ways ("interleaved" and
# "interleaved-odd": a decode fast path at T = 1 that ignored the strides, red team 2026-11-27).
# "overlap": every float `in` argument's rows (but a `scale = false` table's) half a row apart, so each row's
# second half is the next one's first (a sliding-window view of one buffer; the ABI allows any positive
# strides, and an input's rows may share elements: a kernel that took a row stride below the row length for
# packed rows passed: red team, 2026-11-27).
# Each applies where the baseline takes it (a kernel that needs dense rows refuses, and it is skipped).
LAYOUTS = ("mixed", "offset", "transposed", "planes", "heads-major", "decoy", "interleaved", "overlap", "paged")
PAGED_EVERY = 3  # the residue shapes that also get the "paged" layout: every third (residues 0, 3, 6, ...)
PAGED_MAX_ROWS = 64  # ... of those of this many rows at most (a tail is per row; cases.pageable)
LAYOUTS_CPU = ("paged",)  # only where a kernel host protects pages (cases.Buffer: rows a page apart)
LAYOUTS_3D = ("planes", "heads-major", "decoy")  # only where an argument has 3 dimensions
EDGE_LAYOUTS = ("interleaved", "interleaved-odd")  # at each edge shape with a symbol at 1
# Input classes the harness plants (gpu_worker/planted.py), each a variant group at one shape.
# A call in a float dtype the package does not declare: where the baseline takes it, or a candidate does
# though the baseline refuses it, the result must be right (silu_and_mul's CPU baseline computes float32
# too; a candidate wrong only there passed: red team, 2026-11-26, round 5). A kernel that refuses the
# dtype (KOPT_ERR_DTYPE) is not checked there.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
UNDECLARED = "dtype:"  # the variant prefix of those calls
PLANT_ROWS = 8  # rows a planted shape has at least, where a declared shape has them
PLANTED_KINDS = ("zeros", "repeated", "sparse", "constant", "leading-zeros", "huge", "tiny", "magnitudes",
                 "nonfinite", "ones", "same-as-other", "lowest", "cancelling", "binades", "extremes",
                 "outlier-channel")
# Planted kinds in every dtype, not one in turn: "cancelling" (in bfloat16 a residual sits 2^-8 of x off -x
# at the least, which leaves a float32 expansion's loss near the tolerance; float16's 2^-11 shows it) and
# "extremes" (float16's top overflows no float32 product; bfloat16's does).
# And "outlier-channel": in bfloat16 input + residual cancel to an exact zero in most rows of 4096, which a
# kernel's condition may exclude (red team, 2026-11-27: a bfloat16-only plant missed it in one job).
EVERY_DTYPE = ("cancelling", "extremes", "outlier-channel")
# Variants that count only beside a baseline that passes them: a kernel's NaN and infinity handling is
# the package's to choose (a -ffast-math baseline drops it); a candidate must keep what its baseline does.
# Judged alone (the package's own kernel in an optimization's round 0), a failure there is a note.
# "binades", "extremes": values up to a quarter of the dtype's top, where a sum of squares overflows as the
# baseline's does.
# "huge": values near the top cancel (merge's v_a * ca + v_b * cb), where on some draws even the package's
# own baseline misses the bfloat16 tolerance (red team, 2026-11-27: a correct candidate refused as
# "baseline failed" on one of two runs); "lowest": outputs may overflow to inf.
# "rank:batched" (below): a kernel that never reads ndim (a newcomer's scale2) takes it and computes something
# else; what it owes there is its baseline's refusal or each batch right, not a rank check of its own.
NEEDS_BASELINE = ("planted:nonfinite", "planted:magnitudes", "planted:huge", "planted:lowest", "planted:binades",
                  "planted:extremes", "rank:batched")
# Outputs filled with something other than the NaN poison before the call, as a serving framework's
# buffers are (torch.empty's leftovers, zeros): a kernel that does its work only on poisoned outputs, to
# tell the harness from production, is wrong here.
OUTPUT_FILLS = ("zeros", "garbage")
# Variants that call the kernel several times: "update" changes a few input elements in place between
# calls on the same buffers; "repeat" calls one small buffer set a hundred times; "burst" calls it back
# to back on several buffers and checks at the end (correctness.run_sequence).
SEQUENCES = ("update", "repeat", "burst")
REPEAT_MIN_ELEMENTS = 64  # the repeat sequence's shape: the smallest declared with at least this many
SMALL_SIZES = 8  # edge shapes set each symbol to every value 2..SMALL_SIZES (one vector of 8 halves)
# "far:<argument>": that argument's rows spread so far apart that its last row begins 2^32 elements or more
# past its first (cases.far_stride): an offset computed in 32 bits (`(int)(t * stride)`) is wrong there.
# A tensor that large cannot be checked in full on CPU; its rows alone are (cases.Buffer). One group per
# argument of two or more dimensions whose elements are 4 bytes or fewer, at the planted shape.
FAR = "far:"
# "fpenv:<mode>": calls from a caller whose floating-point mode is not the default, as a -ffast-math program's
# or one after torch.set_flush_denormal(True) is (CPU, x86-64): the candidate's outputs must still be right
# and the caller's mode (MXCSR) be as it was after each call. Its two cases: inputs as drawn and scaled by
# FPENV_SMALL, where intermediates a kernel pre-scales fall into the subnormals FTZ/DAZ flush (red team,
# 2026-11-27: a sum of squares pre-scaled by 2^-56, and a kernel that set MXCSR to the default and left it).
FPENV = "fpenv:"
# The MXCSR control bits each mode sets: flush-to-zero (bit 15) and denormals-are-zero (6); rounding upward
# (bits 13-14: 10), which the ABI leaves to the caller too (a kernel that told the rounding mode by arithmetic
# and returned zeros outside round-to-nearest passed: red team, 2026-11-27).
FP_ENVS = {"ftz-daz": 0x8040, "upward": 0x4000}
FPENV_SMALL = 2.0**-10
FPENV_APPLIES = platform.machine() in ("x86_64", "AMD64")  # kernel_host.FpMode.caller sets MXCSR only there
# "rank:batched": every argument one rank higher, a leading batch of BATCH calls' arguments with the batches
# apart (a spare row per batch where an argument has rows). The ABI's KOPT_ERR_ARGS is for ranks a kernel does
# not take, and the baselines refuse it; a kernel that takes it must compute each batch as its own call (red
# team, 2026-11-27: a silu that took [B, T, 2D], flattening B * T rows at the T stride, passed).
BATCHED = "rank:batched"
BATCH = 2
HUGE = "huge"  # the gates' shape with an argument of more than 2^31 elements (fuzz.huge_shape; CUDA only)


@dataclass(frozen=True)
class CaseSpec:
    dims: tuple[tuple[str, int], ...]
    dtype: str
    variant: str = ""
    trial: int = 0
    scale: float = 1.0
    special: bool = False
    row_pad: int = 0
    plant: str = ""  # an input class the harness plants (gpu_worker/planted.py)
    fill: str = ""  # what outputs hold before a call: "" the NaN poison, or one of OUTPUT_FILLS
    layout: str = ""  # "" every argument alike (row_pad each), or one of LAYOUTS (cases.Buffer)
    turn: int = 0  # which of the layout's variations (the "offset" layout: which base offsets)
    far: str = ""  # the argument whose rows span 2^32 elements (FAR)
    fpenv: str = ""  # the caller's floating-point mode (one of FP_ENVS), or "" the host's own
    batch: bool = False  # every argument one rank higher: BATCH calls' arguments (BATCHED)

    @property
    def fp_bits(self) -> int:
        return FP_ENVS[self.fpenv] if self.fpenv else 0

    @property
    def dim_map(self) -> dict[str, int]:
        return dict(self.dims)


@dataclass
class Group:
    """Cases whose errors are aggregated and reported together as one ShapeCheck."""

    label: str
    dtype: str
    variant: str
    declared: bool  # a declared shape with declared inputs: failures always count
    cases: list[CaseSpec] = field(default_factory=list)

    @property
    def key(self) -> str:
        return " ".join(p for p in (self.label, self.dtype, self.variant) if p)


def arg_shapes(spec: KernelSpec, dims: dict[str, int]) -> list[list[int]]:
    return [[int(expr.evaluate(d, dims)) for d in arg.shape] for arg in spec.arguments]


def alias_pairs(args: list[Argument], shapes: dict[str, list[int]]) -> list[tuple[str, str]]:
    """Pairs of `in` arguments of one shape and dtype, which a caller may pass as one buffer (the ABI
    forbids only an output overlapping another argument): the "alias" layout's (cases.aliased)."""
    ins = [a for a in args if a.role == "in" and shapes[a.name] and math.prod(shapes[a.name])]
    return [(a.name, b.name) for i, a in enumerate(ins) for b in ins[i + 1 :]
            if shapes[a.name] == shapes[b.name] and a.dtype == b.dtype]  # fmt: skip


def elements(spec: KernelSpec, dims: dict[str, int]) -> int:
    return sum(math.prod(s) for s in arg_shapes(spec, dims))


def valid(spec: KernelSpec, dims: dict[str, int], allow_empty: bool = False) -> bool:
    """Every argument's shape evaluates, with dimensions >= 1 (>= 0 with allow_empty)."""
    least = 0 if allow_empty else 1
    try:
        return all(d >= least for s in arg_shapes(spec, dims) for d in s)
    except (expr.ExprError, ZeroDivisionError, TypeError):
        return False


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, math.isqrt(n) + 1))


def prime_at_most(n: int) -> int:
    while n > 2 and not is_prime(n):
        n -= 1
    return max(n, 2)


def next_prime(n: int) -> int:
    n += 1
    while not is_prime(n):
        n += 1
    return n


def label(dims: dict[str, int]) -> str:
    return Shape(dims=dims).label


def edge_shapes(spec: KernelSpec, declared: list[Shape], target: str) -> list[dict[str, int]]:
    """Edge shapes derived from the declared ones: all ones, one symbol at a time set to 1 (1 row)
    and to every value 2..SMALL_SIZES, and every symbol a prime near its value; valid, under the
    budget, not already declared."""
    syms = shape_symbols(spec)
    budget = EDGE_BUDGET.get(target, EDGE_BUDGET["cuda"])
    largest = planted_shape(spec, declared, target)
    base = largest.dims if largest is not None else None
    seen = [dict(s.dims) for s in declared]
    out: list[dict[str, int]] = []

    def add(dims: dict[str, int]) -> None:
        if dims not in seen and valid(spec, dims) and elements(spec, dims) <= budget:
            seen.append(dims)
            out.append(dims)

    add({s: 1 for s in syms})
    if base is None:
        return out
    for s in syms:
        if base[s] > 1:
            add({**base, s: 1})
    # Every small size up to one vector width, one symbol at a time: a shortcut or a dropped tail
    # that shows only at some remainders (2, 4 or 6 rows of a kernel that works in 8s) is met.
    for s in syms:
        for v in range(2, SMALL_SIZES + 1):
            if v < base[s]:
                add({**base, s: v})
    primes = {s: prime_at_most(v) if v > 2 else v for s, v in base.items()}
    if primes in seen:
        primes = {s: next_prime(v) for s, v in base.items()}
    add(primes)
    return out


def plantable(arg: Argument) -> bool:
    """A float input the harness may rewrite (kernel.toml `scale = false` keeps tables as they are)."""
    return arg.role != "out" and not is_integer(arg) and arg.scale


def repeat_shape(spec: KernelSpec, declared: list[Shape]) -> Shape:
    """Where the repeat sequence runs: the smallest declared shape of at least REPEAT_MIN_ELEMENTS
    elements (a hundred calls stay cheap; a few changed elements are a small share), else the largest."""
    sizes = sorted((s for s in declared if valid(spec, s.dims)), key=lambda s: elements(spec, s.dims)) or declared
    return next((s for s in sizes if elements(spec, s.dims) >= REPEAT_MIN_ELEMENTS), sizes[-1])


def planted_shape(spec: KernelSpec, declared: list[Shape], target: str) -> Shape | None:
    """Where planted inputs go: the declared shape under the edge budget whose plantable inputs have the
    most rows, up to PLANT_ROWS, the largest of those (rows enough to plant several kinds of row: a
    one-row decode shape, the largest of a package's held-out shapes, got nothing planted), cheap
    enough to plant all of them."""
    budget = EDGE_BUDGET.get(target, EDGE_BUDGET["cuda"])
    fitting = [s for s in declared if valid(spec, s.dims) and elements(spec, s.dims) <= budget]

    def fewest_rows(shape: Shape) -> int:
        dims = [[int(expr.evaluate(d, shape.dims)) for d in a.shape] for a in spec.arguments if plantable(a)]
        return min((math.prod(d[:-1]) for d in dims if len(d) >= 2), default=0)

    return max(fitting, key=lambda s: (min(fewest_rows(s), PLANT_ROWS), elements(spec, s.dims))) if fitting else None


def overlaps_rows(arg: Argument) -> bool:
    """Whether the "overlap" layout gives this argument rows that share elements (where it has two rows or
    more at the case's shape, cases.overlappable): a float `in` argument of two dimensions or more whose
    values may change (plantable: not an integer or `scale = false` table, whose values mean something)."""
    return arg.role == "in" and len(arg.shape) >= 2 and plantable(arg)


def far_applies(arg: Argument, dims: dict[str, int]) -> bool:
    """Whether an argument gets a "far" group at `dims`: two rows or more, elements of 4 bytes or fewer (an
    8-byte one would need 32 GiB of address space for each host's calls)."""
    shape = [int(expr.evaluate(d, dims)) for d in arg.shape]
    return len(shape) >= 2 and shape[0] >= 2 and arg.dtype != "int64"


def layout_group(name: str, dims: tuple, dtype: str, kind: str, turn: int = 0) -> Group:
    """One case of a layout variant: "strided" (every argument's rows padded by ROW_PAD) or
    "layout:<one of LAYOUTS>"; `turn` picks the layout's variation (cases.LAYOUT_OFFSETS)."""
    layout = kind.removeprefix("layout:") if kind != "strided" else ""
    pad = ROW_PAD if kind == "strided" or layout == "mixed" else 0
    return Group(name, dtype, kind, False, [CaseSpec(dims, dtype, kind, 0, row_pad=pad, layout=layout, turn=turn)])


def test_plan(
    spec: KernelSpec, target: str, shapes: list[Shape], dtypes: list[str], trials: int, edge: bool, special: bool,
    fuzz: list[dict[str, int]] | None = None, sizes: list[dict[str, int]] | None = None, sequences: bool = True,
    turn: int = 0, large: list[dict[str, int]] | None = None, huge: list[dict[str, int]] | None = None,
    residues: list[dict[str, int]] | None = None,
) -> list[Group]:
    """Groups to check, declared shapes first. `special`: make_inputs takes special=True. `fuzz`:
    the job's seeded shapes from the declared ranges (gpu_worker/fuzz.py), one trial each; `sizes`: the
    declared sizes' shapes, one trial each in one dtype (in turn); `large`: shapes far above the fuzzed
    ones' budget (fuzz.large_shape), one trial in one dtype; `huge`: a shape with an argument of more
    than 2^31 elements (fuzz.huge_shape), likewise; `residues`: shapes that give every symbol every residue
    (fuzz.residue_shapes), one dtype each in turn; `turn`: the first dtype of the turns."""
    groups: list[Group] = []
    budget = VARIANT_BUDGET.get(target, VARIANT_BUDGET["cuda"])
    two_d = any(len(a.shape) >= 2 for a in spec.arguments)
    for shape in shapes:
        dims = tuple(shape.dims.items())
        small = elements(spec, shape.dims) <= budget
        for dtype in dtypes:
            groups.append(Group(shape.label, dtype, "", True, [CaseSpec(dims, dtype, "", t) for t in range(trials)]))
            if not small:
                continue
            for scale in SCALES:
                v = f"x{scale:g}"
                groups.append(Group(shape.label, dtype, v, False, [CaseSpec(dims, dtype, v, 0, scale=scale)]))
            if special:
                groups.append(Group(shape.label, dtype, "special", False, [CaseSpec(dims, dtype, "special", 0,
                                                                                    special=True)]))
    base = planted_shape(spec, shapes, target)
    # The added classes: the update and burst sequences in every dtype; the repeat sequence, the output
    # fills and the planted classes in one dtype each, the dtypes in turn from `turn` on (a job's seed
    # picks it, so across judgements every class meets every dtype).
    added: list[tuple[Shape, str, bool, dict]] = []  # (shape, variant, one dtype only, CaseSpec extras)
    if base is not None and sequences:  # calls that change inputs the way callers do (correctness.run_sequence)
        added += [(repeat_shape(spec, shapes) if v == "repeat" else base, v, v == "repeat", {}) for v in SEQUENCES]
    if base is not None:
        added += [(base, f"fill:{fill}", True, {"fill": fill}) for fill in OUTPUT_FILLS]
    if base is not None and any(plantable(a) for a in spec.arguments):
        added += [(base, f"planted:{kind}", kind not in EVERY_DTYPE, {"plant": kind}) for kind in PLANTED_KINDS]
    if base is not None and dtypes:  # the float dtypes the package does not declare (the kernel may take them)
        for other in (d for d in FLOAT_DTYPES if d not in dtypes):
            v = f"{UNDECLARED}{other}"
            groups.append(Group(base.label, other, v, False, [CaseSpec(tuple(base.dims.items()), other, v, 0)]))
    for shape, v, one, extra in added:
        for dtype in ([dtypes[turn % len(dtypes)]] if one and dtypes else dtypes):
            turn += one
            groups.append(Group(shape.label, dtype, v, False, [CaseSpec(tuple(shape.dims.items()), dtype, v, 0,
                                                                        **extra)]))  # fmt: skip
    if edge:
        for i, dims in enumerate(edge_shapes(spec, shapes, target)):
            for dtype in dtypes:
                case = CaseSpec(tuple(dims.items()), dtype, "edge", 0)
                groups.append(Group(label(dims), dtype, "edge", False, [case]))
            if 1 in dims.values() and dtypes:  # a one-row (or one-head...) shape: interleaved, both halves in turn
                for kind in (f"layout:{name}" for name in EDGE_LAYOUTS):
                    groups.append(layout_group(label(dims), tuple(dims.items()), dtypes[(turn + i) % len(dtypes)],
                                               kind))  # fmt: skip
    if target == "cpu" and two_d:  # rows a page apart at every third residue shape of a few rows (cases.pageable)
        few = [d for d in residues or [] if max(s[0] for s in arg_shapes(spec, d) if len(s) >= 2) <= PAGED_MAX_ROWS]
        for i, dims in enumerate(few[::PAGED_EVERY]):
            if dtypes:
                groups.append(layout_group(label(dims), tuple(dims.items()), dtypes[(turn + i) % len(dtypes)],
                                           "layout:paged", turn + i))  # fmt: skip
    for variant, drawn in (("size", sizes), ("residue", residues)):  # one dtype each in turn (there are many)
        for i, dims in enumerate(drawn or []):
            if dtypes:
                dtype = dtypes[(turn + i) % len(dtypes)]
                groups.append(Group(label(dims), dtype, variant, False, [CaseSpec(tuple(dims.items()), dtype, variant,
                                                                                  0)]))  # fmt: skip
    for dims in fuzz or []:
        for dtype in dtypes:
            groups.append(Group(label(dims), dtype, "fuzz", False, [CaseSpec(tuple(dims.items()), dtype, "fuzz", 0)]))
    for i, dims in enumerate(large or []):
        if dtypes:
            dtype = dtypes[(turn + i + 1) % len(dtypes)]
            groups.append(Group(label(dims), dtype, "large", False, [CaseSpec(tuple(dims.items()), dtype, "large", 0)]))
    for i, dims in enumerate(huge or []):
        if dtypes:
            dtype = dtypes[(turn + i) % len(dtypes)]
            groups.append(Group(label(dims), dtype, HUGE, False, [CaseSpec(tuple(dims.items()), dtype, HUGE, 0)]))
    three_d = any(len(a.shape) >= 3 for a in spec.arguments)
    rows_in = any(overlaps_rows(a) for a in spec.arguments)
    kinds = ["strided", *(f"layout:{L}" for L in LAYOUTS if (three_d or L not in LAYOUTS_3D)
                          and (rows_in or L != "overlap") and (target == "cpu" or L not in LAYOUTS_CPU))
             ] if two_d else []  # fmt: skip
    if kinds:
        fitting = [s for s in shapes if elements(spec, s.dims) <= budget]
        if fitting:  # every layout at the largest declared shape that fits, "strided" in every dtype
            shape = max(fitting, key=lambda s: elements(spec, s.dims))
            dims = tuple(shape.dims.items())
            for dtype in dtypes:
                groups.append(layout_group(shape.label, dims, dtype, "strided"))
            for i, kind in enumerate(kinds[1:]):  # one dtype each
                if dtypes:
                    groups.append(layout_group(shape.label, dims, dtypes[(turn + i) % len(dtypes)], kind, turn))
        # And one layout in turn at each drawn shape (declared sizes, fuzzed shapes): a kernel that takes
        # strides only at some widths (odd ones, a head size below 256) met a layout at one shape only
        # (red team, 2026-11-27).
        for i, dims in enumerate([*(sizes or []), *(fuzz or [])]):
            if dtypes:
                kind, dtype = kinds[(turn + i) % len(kinds)], dtypes[(turn + i + 1) % len(dtypes)]
                groups.append(layout_group(label(dims), tuple(dims.items()), dtype, kind, turn + i))
    if base is not None and dtypes:  # two inputs of one shape and dtype as one buffer, each such pair in turn
        shapes_at = dict(zip((a.name for a in spec.arguments), arg_shapes(spec, base.dims)))
        for i, (a, b) in enumerate(alias_pairs(spec.arguments, shapes_at)):
            dtype, v = dtypes[(turn + i) % len(dtypes)], f"alias:{a}={b}"
            groups.append(Group(base.label, dtype, v, False, [CaseSpec(tuple(base.dims.items()), dtype, v, 0,
                                                                       layout="alias", turn=i)]))  # fmt: skip
    if base is not None and dtypes and target == "cpu" and FPENV_APPLIES:  # one dtype each, in turn
        for i, mode in enumerate(FP_ENVS):
            dtype, v, dims = dtypes[(turn + i) % len(dtypes)], FPENV + mode, tuple(base.dims.items())
            small = CaseSpec(dims, dtype, v, 1, scale=FPENV_SMALL, fpenv=mode)
            groups.append(Group(base.label, dtype, v, False, [CaseSpec(dims, dtype, v, 0, fpenv=mode), small]))
    if base is not None and dtypes:  # a call at one rank higher, which a kernel may refuse
        dtype, dims = dtypes[(turn + 1) % len(dtypes)], tuple(base.dims.items())
        groups.append(Group(base.label, dtype, BATCHED, False, [CaseSpec(dims, dtype, BATCHED, 0, batch=True)]))
    if base is not None and dtypes:  # last: a kernel that ignores strides fails the layouts above by name
        for i, arg in enumerate(a for a in spec.arguments if far_applies(a, base.dims)):
            dtype = dtypes[(turn + i) % len(dtypes)]
            groups.append(Group(base.label, dtype, FAR + arg.name, False, [
                CaseSpec(tuple(base.dims.items()), dtype, FAR + arg.name, 0, far=arg.name)]))  # fmt: skip
    return groups
