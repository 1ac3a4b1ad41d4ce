"""Problem instances: inputs from the package's generator, the buffers a kernel sees, poison, guards.

Every buffer a kernel sees is a fresh allocation with a guard zone of GUARD_BYTES before it (and,
for the strided variant, between rows), pre-filled with a NaN carrying a payload; after it, either
unmapped memory (a "fenced" buffer: its end within GUARD_BYTES of memory no host maps, so a read
or write past that faults) or another guard zone (remote.Placement). Outputs start as that poison,
so "never written" is told apart from a computed NaN; a write outside a buffer shows up as damaged
poison in the guards. Inputs the kernel sees are copies; the pristine tensors from make_inputs are
never passed to a kernel.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import mmap
import random
import secrets
import zlib
from types import ModuleType

import torch

from gpu_worker import planted
from gpu_worker.abi import Packed
from gpu_worker.plan import BATCH, PAGED_MAX_ROWS, CaseSpec, alias_pairs, overlaps_rows
from kopt import expr
from kopt.models import Argument
from kopt.package import is_integer, value_range

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int64": torch.int64}
POISON = {
    torch.float32: (torch.int32, 0x7FC5A5A5),
    torch.float64: (torch.int64, 0x7FF8A5A5A5A5A5A5),
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FE5),
}
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The "far" layout's last row begins at least this many elements past its first: an offset kept in 32 bits,
# signed or not, of elements or of bytes, is wrong at one of its rows at least.
FAR_ELEMENTS = 1 << 32
FAR_ALIGN = 64  # elements: a far row's start stays as aligned as its first (vector paths still apply)
GUARD_BYTES = 256  # keeps the kernel-visible view 256-byte aligned, like a fresh allocation
SCALE_STEP, SCALE_LEVELS = 1.25, 2  # Refresher: fresh inputs per call within [1.25**-2, 1.25**2] = [0.64, 1.5625]
ROOM_BYTES = 1 << 20  # a "roomy" buffer's poisoned room on each side: at least this, and its own size
PAGE = mmap.PAGESIZE  # the "paged" layout's unit (the kernel host protects whole pages: kernel_host.row_pages)


class HarnessBug(RuntimeError):
    """The harness's own code failed while preparing a case: neither the package's nor the kernel's fault."""


def poison(t: torch.Tensor) -> None:
    if t.dtype in POISON:
        int_dtype, bits = POISON[t.dtype]
        t.view(int_dtype).fill_(bits)
    else:
        t.fill_(float("nan") if t.is_floating_point() else -1)


def fill_output(t: torch.Tensor, how: str) -> None:
    """An output before a call: the NaN poison (""), zeros, or finite garbage (normal values, x4)."""
    if how == "zeros":
        t.zero_()
    elif how == "garbage":  # drawn anew each time: no pattern a kernel could learn to tell the harness by
        gen = torch.Generator(device=t.device).manual_seed(secrets.randbits(63))
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * 4)
    elif how:
        raise HarnessBug(f"unknown output fill {how!r}")
    else:
        poison(t)


def poison_mask(t: torch.Tensor) -> torch.Tensor:
    """True where t still holds the exact poison bits."""
    if t.dtype in POISON:
        int_dtype, bits = POISON[t.dtype]
        return t.view(int_dtype) == bits
    return torch.isnan(t) if t.is_floating_point() else t == -1


# The arena shared with the kernel hosts (remote.Arena on CPU, remote.CudaArena on CUDA), where every
# kernel-visible buffer lives; set by Context. Pristine inputs and references stay in the judge's
# private memory.
ARENA = None
READONLY_INPUTS = True  # a CPU kernel host maps the memory of inputs read-only (False: locate_fault's probe)


class Buffer:
    """A kernel-visible tensor inside a poisoned, guarded (and possibly row-padded) allocation, placed
    as the arena says for argument `name` (remote.Placement): fenced (the view's end within
    GUARD_BYTES of unmapped memory, as close as a 256-byte aligned start allows), plain (a guard zone
    after it too) or roomy (poison on each side as large as the view, and ROOM_BYTES at least).
    Layouts (plan.LAYOUTS): `row_pad` elements after every row; in 3-D and more `plane_pad` spare rows
    after every plane (a slice of a larger tensor, e.g. some heads of [T, heads, D]: its outer stride is
    not the product of the inner ones); `offset` elements between the aligned start and the view (a view
    with a storage offset: its base is not 16-byte aligned); `transposed` (2-D): the storage holds the
    transpose, so the view's inner stride is its row count; `swapped` (3-D): the first two dimensions
    are swapped in storage ([heads, T, D] seen as [T, heads, D]), the inner stride stays 1; `decoy` (3-D):
    [B, A, B * C] in storage seen as [A, B, C], whose outer stride is the dense one and whose middle one is
    not; `interleaved`: every other element of a tensor twice as wide (inner stride 2); `overlap`: each
    row half a row after the one before (a sliding window: rows share elements; inputs only); `far`: the
    outer dimension's stride is far_stride(shape) and the rest dense, so the view spans 2^32 elements or
    more, of which only the rows and a guard after each are poisoned and checked (the gaps between them
    are never touched: on CPU the arena's pages there stay unallocated); `paged` (CPU, where pageable()):
    every row ends at a page end and a page or more of poison follows it, which a CPU kernel host keeps
    read-only for an output (kernel_host.row_pages), so a write past a row's end faults even where it
    puts back what was there."""

    def __init__(self, shape: list[int], dtype: torch.dtype, device: str, row_pad: int = 0, guards: bool = True,
                 pool: str = "shared", name: str = "", offset: int = 0, transposed: bool = False,
                 plane_pad: int = 0, swapped: bool = False, far: bool = False, interleaved: bool = False,
                 decoy: bool = False, overlap: bool = False, paged: bool = False):  # fmt: skip
        size = dtype.itemsize
        unit = GUARD_BYTES // size  # elements in one alignment unit
        g = unit if guards else 0
        # (poisoned storage outside the view, and where in it the outside lies; None: all of it)
        self.windows: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.overlap = False
        if far:
            self._far(shape, dtype, device, pool, name, g, unit)
            return
        if paged and pageable(shape, dtype):
            self._paged(shape, dtype, device, pool, name, g)
            return
        row_pad = row_pad if len(shape) >= 2 else 0
        plane_pad = plane_pad if len(shape) >= 3 else 0
        transposed = transposed and len(shape) == 2 and not row_pad
        swapped = swapped and len(shape) == 3 and not row_pad
        decoy = decoy and len(shape) == 3 and not row_pad
        interleaved = interleaved and len(shape) >= 1 and not (row_pad or plane_pad)
        self.overlap = overlap and overlappable(shape) and not (row_pad or plane_pad)
        padded = bool(row_pad or plane_pad)
        pick: tuple | None = None  # the view's elements within the storage where gaps lie between them
        if self.overlap:  # rows half a row apart: the view fills its span, shared elements and all
            phys = [overlap_span(shape)[1]]
        elif decoy:  # [B, A, B * C] in storage, seen as [A, B, C]: strides (B * C, A * B * C, 1)
            phys = [shape[1], shape[0], shape[1] * shape[2]]
            pick = (slice(None), slice(None), slice(0, shape[2]))
        elif transposed or swapped:
            phys = [shape[1], shape[0], *shape[2:]]
        elif interleaved:  # every other element: the inner stride is 2
            phys = [*shape[:-1], 2 * shape[-1]]
            pick = (..., slice(None, None, 2))
        elif padded:  # the last dimension padded by row_pad, the middle ones by plane_pad
            phys = [shape[0], *(s + plane_pad for s in shape[1:-1]), shape[-1] + row_pad]
            pick = tuple(slice(0, s) for s in shape)
        else:
            phys = list(shape)
        n = math.prod(phys)
        shared = ARENA is not None and ARENA.target == device  # with the kernel hosts (remote.py)
        self.placement = ARENA.placement(name, (offset + n) * size, pool) if shared else "plain"
        room = max(g, n, ROOM_BYTES // size)
        lead = g if self.placement != "roomy" else -(-room // unit) * unit
        tail = {"fence": 0, "plain": g, "roomy": room}[self.placement]
        tail += (-(offset + n + tail)) % unit  # the storage ends on the unit, so its start is on it
        if shared:
            self.storage = ARENA.tensor(lead + offset + n + tail, dtype, owner=self, pool=pool,
                                        fence=self.placement == "fence")  # fmt: skip
        else:
            self.storage = torch.empty(lead + offset + n + tail, dtype=dtype, device=device)
        poison(self.storage)
        start = lead + offset
        inner = self.storage[start : start + n].view(phys)
        picked = inner[pick] if pick is not None else inner
        if self.overlap:
            self.view = inner.as_strided(shape, overlap_span(shape)[0])
        else:
            self.view = picked.transpose(0, 1) if transposed or swapped or decoy else picked
        if pick is not None:  # gaps lie between the view's elements: a mask over the whole storage
            outside = torch.ones(self.storage.shape, dtype=torch.bool, device=device)
            outside[start : start + n].view(phys)[pick] = False
            self.windows.append((self.storage, outside))
        else:  # the view fills [start, start + n): the guards and the offset lie before and after it
            self.windows += [(w, None) for w in (self.storage[:start], self.storage[start + n :]) if w.numel()]

    def _far(self, shape: list[int], dtype: torch.dtype, device: str, pool: str, name: str, g: int, unit: int) -> None:
        rows, inner = shape[0], math.prod(shape[1:])
        stride = far_stride(shape)
        n = (rows - 1) * stride + inner
        lead = g
        tail = g + (-(lead + n + g)) % unit
        count = lead + n + tail
        if ARENA is not None and ARENA.target == device:
            self.placement = ARENA.placement(name, count * dtype.itemsize, pool)
            self.storage = ARENA.tensor(count, dtype, owner=self, pool=pool, fence=self.placement == "fence")
        else:
            self.placement = "plain"
            self.storage = torch.empty(count, dtype=dtype, device=device)
        dense = [math.prod(shape[i + 1:]) for i in range(1, len(shape))]
        at = self.storage.storage_offset() + lead  # as_strided counts from the start of the underlying storage
        self.view = self.storage.as_strided(shape, [stride, *dense], at)
        # Each row with a guard after it (the last one's runs to the storage's end), and the guard before the first.
        rows_after = self.storage.as_strided((rows - 1, inner + g), (stride, 1), at)
        last = self.storage[lead + n - inner:]
        head = self.storage[:lead]
        for piece in (rows_after, last, head):
            poison(piece)
        self.windows += [(w, None) for w in (rows_after[:, inner:], last[inner:], head) if w.numel()]

    def _paged(self, shape: list[int], dtype: torch.dtype, device: str, pool: str, name: str, g: int) -> None:
        rows, inner, size = shape[0], math.prod(shape[1:]), dtype.itemsize
        stride = paged_stride(shape, dtype)
        n = (rows - 1) * stride + inner
        tail = PAGE // size  # a page after the last row: the storage ends at a page end, and so does every row
        count = g + n + tail
        if ARENA is not None and ARENA.target == device:
            self.placement = ARENA.placement(name, count * size, pool)
            self.storage = ARENA.tensor(count, dtype, owner=self, pool=pool, fence=self.placement == "fence")
        else:  # the judge's private memory: the same strides, pages unprotected
            self.placement = "plain"
            self.storage = torch.empty(count, dtype=dtype, device=device)
        poison(self.storage)
        dense = [math.prod(shape[i + 1:]) for i in range(1, len(shape))]
        self.view = self.storage.as_strided(shape, [stride, *dense], self.storage.storage_offset() + g)
        outside = torch.ones(count, dtype=torch.bool, device=device)
        outside.as_strided((rows, inner), (stride, 1), g).fill_(False)
        self.windows.append((self.storage, outside))

    def load(self, values: torch.Tensor) -> None:
        """Write an input's values into the view (overlapping rows: through the storage they share; the
        values must agree where rows overlap, as overlapped() makes them)."""
        if self.overlap:
            _fill_overlapping(self.view.as_strided((overlap_span(list(values.shape))[1],), (1,)), values)
        else:
            self.view.copy_(values)

    def damage(self) -> int:
        """Elements outside the view whose poison was overwritten (out-of-bounds writes)."""
        n = 0
        for piece, outside in self.windows:
            changed = ~poison_mask(piece)
            n += int(torch.count_nonzero(changed if outside is None else changed & outside))
        return n


def paged_stride(shape: list[int], dtype: torch.dtype) -> int:
    """The "paged" layout's outer stride (elements): whole pages, one page more than a row needs."""
    return (-(-math.prod(shape[1:]) * dtype.itemsize // PAGE) + 1) * PAGE // dtype.itemsize


def pageable(shape: list[int], dtype: torch.dtype) -> bool:
    """Whether the "paged" layout applies to a tensor of `shape`: two rows to PAGED_MAX_ROWS, none empty."""
    return len(shape) >= 2 and 2 <= shape[0] <= PAGED_MAX_ROWS and 0 not in shape


def overlappable(shape: list[int]) -> bool:
    """Whether the "overlap" layout applies to a tensor of `shape`: two rows or more, two elements a row or more."""
    return len(shape) >= 2 and shape[-1] >= 2 and math.prod(shape[:-1]) >= 2


def overlap_span(shape: list[int]) -> tuple[list[int], int]:
    """The "overlap" layout's strides for `shape` and the elements its view spans: each row starts half a
    row (rounded up) after the one before, so the second half of a row is the first half of the next (a
    sliding window over one buffer); the outer dimensions are dense over those rows."""
    step = (shape[-1] + 1) // 2
    strides = [1, step]
    for size in reversed(shape[1:-1]):
        strides.append(strides[-1] * size)
    rows = math.prod(shape[:-1])
    return strides[::-1], (rows - 1) * step + shape[-1]


def _fill_overlapping(flat: torch.Tensor, values: torch.Tensor) -> None:
    """Lay `values` into the storage of an overlapping view: each row's first half, then the last row whole."""
    rows = values.reshape(-1, values.shape[-1])
    step = (values.shape[-1] + 1) // 2
    head = (rows.shape[0] - 1) * step
    flat[:head].view(rows.shape[0] - 1, step).copy_(rows[:-1, :step])
    flat[head:].copy_(rows[-1])


def overlapped(values: torch.Tensor) -> torch.Tensor:
    """The values an "overlap" view of `values`' shape holds when laid out from `values` (row r's second
    half is row r + 1's first half): inputs drawn for that layout, made to agree where rows share elements."""
    strides, span = overlap_span(list(values.shape))
    flat = torch.empty(span, dtype=values.dtype, device=values.device)
    _fill_overlapping(flat, values)
    return flat.as_strided(list(values.shape), strides).clone()


def overlaps(arg: Argument, cs: CaseSpec, shape: list[int]) -> bool:
    """Whether argument `arg` is laid out with overlapping rows in case `cs`: the "overlap" layout's float
    `in` arguments whose values may change (an output's rows never overlap: the ABI; rows that share elements
    get new values, so integer tables and `scale = false` tables, whose values mean something, keep theirs)."""
    return cs.layout == "overlap" and overlaps_rows(arg) and overlappable(shape)


def far_stride(shape: list[int]) -> int:
    """The "far" layout's outer stride for a tensor of `shape` (2 or more rows): its last row begins
    FAR_ELEMENTS or more past its first, each row FAR_ALIGN-aligned like the first, and no closer to
    the next than its own length."""
    inner = math.prod(shape[1:])
    least = max(-(-FAR_ELEMENTS // (shape[0] - 1)), inner + 1)
    return -(-least // FAR_ALIGN) * FAR_ALIGN


def far_bytes(shape: list[int], dtype: torch.dtype) -> int:
    """The address space one far buffer of `shape` spans."""
    return ((shape[0] - 1) * far_stride(shape) + math.prod(shape[1:])) * dtype.itemsize


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def supports_special(ref: ModuleType) -> bool:
    return _accepts(ref.make_inputs, "special")


def shapes_of(args: list[Argument], dims: dict[str, int]) -> dict[str, list[int]]:
    return {a.name: [int(expr.evaluate(d, dims)) for d in a.shape] for a in args}


def case_shapes(args: list[Argument], cs: CaseSpec) -> dict[str, list[int]]:
    """Each argument's shape in a case: the declared one, with a leading batch in the batched variant."""
    return {k: [BATCH, *v] if cs.batch else v for k, v in shapes_of(args, cs.dim_map).items()}


def dtype_of(arg: Argument, run_dtype: str) -> torch.dtype:
    return TORCH_DTYPES[arg.dtype] if arg.dtype else TORCH_DTYPES[run_dtype]


def generate(ref: ModuleType, args: list[Argument], cs: CaseSpec, seed: int, device: str) -> dict[str, torch.Tensor]:
    """Pristine inputs (in and inout arguments) for one case, validated against kernel.toml (a batched
    case: BATCH cases' inputs, from seeds in turn, stacked)."""
    if cs.batch:
        parts = [generate(ref, args, dataclasses.replace(cs, batch=False), seed + b, device) for b in range(BATCH)]
        return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
    dims = cs.dim_map
    kwargs = {}
    if cs.special:
        kwargs["special"] = True
    native_scale = cs.scale != 1.0 and _accepts(ref.make_inputs, "scale")
    if native_scale:
        kwargs["scale"] = cs.scale
    with torch.no_grad():
        made = ref.make_inputs(dict(dims), TORCH_DTYPES[cs.dtype], seed, device, **kwargs)
    shapes = shapes_of(args, dims)
    out = {}
    for arg in args:
        if arg.role == "out":
            continue
        want = dtype_of(arg, cs.dtype)
        t = made.get(arg.name) if isinstance(made, dict) else None
        if t is None and arg.range is not None:
            t = draw_integers(arg, shapes[arg.name], dims, seed, device)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"reference.py: make_inputs() returned no tensor {arg.name!r}"
                             + (" (and kernel.toml gives it no range to draw from)" if is_integer(arg) else ""))  # fmt: skip
        if list(t.shape) != shapes[arg.name] or t.dtype != want or t.device.type != device:
            raise ValueError(
                f"reference.py: make_inputs() gave {arg.name!r} as {list(t.shape)} {t.dtype} on {t.device}, "
                f"kernel.toml declares {shapes[arg.name]} {want} on {device}"
            )
        if arg.range is not None and t.numel():
            low, high = value_range(arg, dims)
            if int(t.min()) < low or int(t.max()) >= high:
                raise ValueError(f"reference.py: make_inputs() gave {arg.name!r} values in [{int(t.min())}, "
                                 f"{int(t.max())}], outside its kernel.toml range [{low}, {high}) at "
                                 f"{','.join(f'{k}={v}' for k, v in dims.items())}")  # fmt: skip
        if cs.scale != 1.0 and not native_scale and t.is_floating_point() and arg.scale:
            t = (t.double() * cs.scale).to(t.dtype)
        out[arg.name] = t.contiguous().clone()
    if cs.plant:
        try:
            planted.plant(cs.plant, args, out, seed)
        except Exception as exc:  # noqa: BLE001 - the harness's own code: never the package's fault
            raise HarnessBug(f"planting {cs.plant!r}: {type(exc).__name__}: {exc}") from exc
    if (pair := aliased(args, cs, shapes)) is not None:  # one buffer for both: the same values
        out[pair[1]] = out[pair[0]]
    for arg in args:
        if overlaps(arg, cs, shapes[arg.name]):
            out[arg.name] = overlapped(out[arg.name])
    return out


def aliased(args: list[Argument], cs: CaseSpec, shapes: dict[str, list[int]]) -> tuple[str, str] | None:
    """The "alias" layout's pair (the case's turn picks it): both arguments one buffer. A merge that took
    v_a and v_b at one address for a merge of a state with itself, and so skipped s_a == s_b, passed
    every other check (red team, 2026-11-27)."""
    pairs = alias_pairs(args, shapes) if cs.layout == "alias" else []
    return pairs[cs.turn % len(pairs)] if pairs else None


def draw_integers(arg: Argument, shape: list[int], dims: dict[str, int], seed: int, device: str) -> torch.Tensor:
    """Values for an integer input that make_inputs() leaves out: uniform in its range, seeded by the
    case and the argument's name, with the range's two edges among them (first and last element)."""
    low, high = value_range(arg, dims)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(arg.name.encode())) % (1 << 63))
    t = torch.randint(low, high, shape, generator=gen, dtype=TORCH_DTYPES[arg.dtype])
    flat = t.view(-1)
    if flat.numel():
        flat[0], flat[-1] = low, high - 1
    return t.to(device)


# Per argument, in the order the package declares them: the row padding of the "mixed" layout (in units
# of plan.ROW_PAD: every argument strided apart from the one before it, some dense) and the element
# offset of the "offset" layout (every base misaligned, each by another amount, the amounts turning
# with the case's `turn`). The offsets put a 2-byte element's base at 2, 4, 6, 8, 16, 32, 48, 80 and
# 128 bytes past a 256-byte line (a 4-byte one's at 4 to 256): a kernel that went wrong only at bases
# 4-byte but not 64-byte aligned met only 2, 4 and 6 bytes and passed (red team, 2026-11-27).
LAYOUT_PADS = (0, 1, 2)
LAYOUT_OFFSETS = (1, 3, 2, 4, 8, 16, 24, 40, 64)


def plane_pad(cs: CaseSpec) -> int:
    """Spare rows per plane of a 3-D argument: one wherever rows are padded, in the mixed and planes
    layouts for every argument (dense rows in a slice of a wider tensor), and between a batch's calls."""
    return 1 if cs.row_pad or cs.batch or cs.layout in ("mixed", "planes") else 0


def interleaves(cs: CaseSpec, index: int) -> bool:
    """Whether argument `index` is interleaved (plan.LAYOUTS): every other argument, from the first or, by
    the case's turn or the "interleaved-odd" layout, the second."""
    odd = cs.turn + (cs.layout == "interleaved-odd")
    return cs.layout in ("interleaved", "interleaved-odd") and (index + odd) % 2 == 0


def layout_pad(cs: CaseSpec, index: int) -> int:
    """The row padding of argument `index` in a case: the case's own, or the mixed layout's."""
    if cs.layout == "mixed":
        return cs.row_pad * LAYOUT_PADS[index % len(LAYOUT_PADS)]
    return cs.row_pad


class Case:
    """One call's worth of buffers over given pristine inputs; outputs poisoned."""

    def __init__(
        self, args: list[Argument], pristine: dict[str, torch.Tensor], cs: CaseSpec, device: str, guards: bool = True,
        pool: str = "shared",
    ):  # fmt: skip
        """`pool`: the host whose calls alone use these buffers ("candidate", "baseline"), or "shared"."""
        self.args = args
        self.pristine = pristine
        self.spec = cs
        shapes = case_shapes(args, cs)
        self.buffers = {
            a.name: Buffer(shapes[a.name], dtype_of(a, cs.dtype), device, layout_pad(cs, i), guards, pool, a.name,
                           offset=LAYOUT_OFFSETS[(cs.turn + i) % len(LAYOUT_OFFSETS)] if cs.layout == "offset" else 0,
                           transposed=cs.layout == "transposed", plane_pad=plane_pad(cs),
                           swapped=cs.layout == "heads-major", far=cs.far == a.name,
                           interleaved=interleaves(cs, i),
                           decoy=cs.layout == "decoy", overlap=overlaps(a, cs, shapes[a.name]),
                           paged=cs.layout == "paged")
            for i, a in enumerate(args)
        }  # fmt: skip
        if (pair := aliased(args, cs, shapes)) is not None:
            self.buffers[pair[1]] = self.buffers[pair[0]]
        self.tensors = {name: b.view for name, b in self.buffers.items()}
        for arg in args:
            if arg.role == "in":
                self.buffers[arg.name].load(pristine[arg.name])
        self.refresh()
        check_no_overlap(self.tensors)
        readonly = [READONLY_INPUTS and a.role == "in" for a in args]  # a CPU host maps these read-only
        self.packed = Packed([self.tensors[a.name] for a in args], readonly=readonly)

    def refresh(self) -> None:
        """Poison outputs (or fill them as the case says) and restore inout args, so each call must do
        all of its work again."""
        for arg in self.args:
            t = self.tensors[arg.name]
            if arg.role == "out":
                fill_output(t, self.spec.fill)
            elif arg.role == "inout":
                t.copy_(self.pristine[arg.name])


class Refresher:
    """Case.refresh for many cases at once, in a few multi-tensor operations (a graph replays thousands
    of slots; one fill per slot and output would cost more launches than the replay has calls).

    With `scaled` (the float inputs declared scalable), every call also gives the cases new inputs:
    "in" buffers are multiplied in place by SCALE_STEP or its inverse, drawn per call, and restored
    "inout" buffers by the product of those steps, which stays within SCALE_STEP ** SCALE_LEVELS of 1
    either way. Every nonzero element moves, so no call can be answered from an earlier one (a replay
    of cached outputs keyed on addresses or on a sample of the values); the judge reads the inputs a
    call had from the buffers themselves before that call."""

    def __init__(self, cases: list[Case], scaled: frozenset[str] = frozenset()) -> None:
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.ins: list[torch.Tensor] = []  # "in" buffers scaled by each step
        self.inouts: list[torch.Tensor] = []  # restored "inout" buffers, scaled by the product of the steps
        self.level = 0
        self.rng = random.Random(secrets.randbits(63))
        seen: set[int] = set()
        poisons: dict[tuple, torch.Tensor] = {}
        for case in cases:
            for arg in case.args:
                t = case.tensors[arg.name]
                if arg.name in scaled and arg.role != "out" and t.is_floating_point() and t.numel():
                    if t.data_ptr() not in seen:  # slots shared by two kernels are one set of buffers
                        seen.add(t.data_ptr())
                        (self.ins if arg.role == "in" else self.inouts).append(t)
                if arg.role == "inout":
                    self.dst.append(t)
                    self.src.append(case.pristine[arg.name])
                elif arg.role == "out" and t.dtype in POISON:
                    key = (tuple(t.shape), t.dtype)
                    if key not in poisons:
                        p = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                        poison(p)
                        poisons[key] = p.view(POISON[t.dtype][0])
                    self.dst.append(t.view(POISON[t.dtype][0]))
                    self.src.append(poisons[key])
                elif arg.role == "out":
                    self.dst.append(t)
                    self.src.append(torch.full_like(t, float("nan") if t.is_floating_point() else -1))

    def __call__(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
        if self.ins or self.inouts:
            step = self.rng.choice((-1, 1)) if abs(self.level) < SCALE_LEVELS else -self.level // abs(self.level)
            self.level += step
            if self.ins:
                torch._foreach_mul_(self.ins, SCALE_STEP**step)
            if self.inouts and self.level:
                torch._foreach_mul_(self.inouts, SCALE_STEP**self.level)


def check_no_overlap(tensors: dict[str, torch.Tensor]) -> None:
    """The harness never hands a kernel outputs that alias inputs (or each other)."""
    spans, seen = [], set()
    for name, t in tensors.items():
        if t.numel() == 0 or (t.data_ptr(), t.shape, t.stride()) in seen:  # one buffer for two inputs ("alias")
            continue
        seen.add((t.data_ptr(), t.shape, t.stride()))
        lo = t.data_ptr()
        hi = lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        spans.append((lo, hi, name))
    spans.sort()
    for (_, hi1, a), (lo2, _, b) in zip(spans, spans[1:]):
        if lo2 < hi1:
            raise RuntimeError(f"harness bug: buffers {a!r} and {b!r} overlap")


def case_reference(ref: ModuleType, args: list[Argument], pristine: dict[str, torch.Tensor],
                   cs: CaseSpec) -> dict[str, torch.Tensor]:  # fmt: skip
    """The reference's outputs for a case: of a batched case, each batch's as its own call, stacked."""
    shapes = shapes_of(args, cs.dim_map)
    if not cs.batch:
        return reference(ref, args, pristine, shapes)
    outs = [reference(ref, args, {k: v[b] for k, v in pristine.items()}, shapes) for b in range(BATCH)]
    return {a.name: torch.stack([o[a.name] for o in outs]) for a in args if a.role != "in"}


def reference(ref: ModuleType, args: list[Argument], pristine: dict[str, torch.Tensor],
              shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:  # fmt: skip
    with torch.no_grad():
        # Clones: a reference that writes to its inputs must not spoil the pristine copies.
        out = ref.reference({k: v.clone() for k, v in pristine.items()})
    for arg in args:
        if arg.role == "in":
            continue
        if not isinstance(out, dict) or arg.name not in out:
            raise ValueError(f"reference.py: reference() returned no {arg.name!r}")
        if list(out[arg.name].shape) != shapes[arg.name]:
            raise ValueError(
                f"reference.py: reference() returned {arg.name!r} of shape {list(out[arg.name].shape)}, "
                f"kernel.toml declares {shapes[arg.name]}"
            )
    return out
