"""The kernel host: the only process that loads a kernel library, and it loads exactly one.

    main([CONTROL_FD, TARGET, ARENA, LIBRARY, ENTRY, ROLE, MEMORY_MB])

run by a bare `python -S -u` that reads the call from stdin (remote.host_program), so the host's command
line and environment name nothing of kopt (a kernel reads both at the top of its stack);
`python -m gpu_worker.kernel_host ARGS...` does the same by hand.

Started by the judge (the harness process, which never loads candidate code: docs/decisions/
0014-judge-and-kernel-hosts.md) inside the same jail, as a fresh interpreter without torch, so
nothing of the judge's memory (the key, the references, the verdict) is ever in this process.
ARENA is how the kernel-visible buffers are shared: "FD:BYTES" (CPU: a sealed memfd, mapped here
with no access at all, its descriptor closed; the pages of the buffers a registered pack uses are
opened read-write while a pack uses them, so this host sees only its own calls' buffers and a buffer
whose end the judge placed against a page it never opens faults on the first byte read or written
past that page) or "cuda:ORDINAL" (the device; the judge sends its device-memory segments later,
each as a descriptor over the control socket, mapped into this process's own context with a
reserved, unmapped granule after it: a buffer at a segment's end faults likewise).
Before the library loads the host makes itself non-dumpable (the other host runs as the same uid)
and puts on its own limits: rlimits and a seccomp profile ("host" on CPU: no threads or processes
at all, so no code of the library runs between the calls the judge makes; "cuda-host": the CUDA
driver needs threads, so the judge watches the host's threads and CPU time instead).

The control socket (SOCK_SEQPACKET, one message per datagram), judge to host:
  P <pack id, count> then per tensor <segment << 48 | offset, dtype, ndim, open from, open bytes>
                              <shape...> <strides...>   (CPU: the tensor's allocation, whose pages
                              are opened while the pack is registered; it covers the tensor)
  F <pack id>                 forget a pack (no reply)
  S <segment id, bytes>       + a descriptor (CUDA): map a device-memory segment (no reply)
  M <extra mode bits>         the caller's floating-point mode for the calls that follow: the host's own
                              mode with these MXCSR control bits set (0: the host's own; x86-64 only;
                              no reply)
  C <pack id>                 call the entry point once; reply <rc, ns, status>
  N                           no-op; reply <0, ns, status> (the judge's round-trip calibration)
  G <count> <pack id...>      CUDA: capture the calls in a graph; reply <rc, graph id, status>
  R <graph id>                CUDA: launch a graph once; reply <0, ns, status>
  H <pack id, count>          CUDA: count calls back to back, then wait for the whole context;
                              reply <rc, ns on the stream, status>
Host to judge, once: R (ready) or E<reason>. `ns` is the host's own reading (CPU: its clock around
the call; CUDA: its events around the call on its stream), `status` a CUresult (0 on CPU), or
FP_MODE_CHANGED with the floating-point mode before and after in place of rc and ns. The
judge believes its own clock: a host whose reading disagrees with the judge's round trip is lying.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
import sys
import time


class Op:
    """Judge to host: the first byte of every message (the module docstring gives each one's body)."""

    PACK = b"P"
    FORGET = b"F"
    MODE = b"M"
    SEGMENT = b"S"
    CALL = b"C"
    NOOP = b"N"
    CAPTURE = b"G"
    REPLAY = b"R"
    BURST = b"H"


class Hello:
    """Host to judge, once, before anything else: ready to be called, or why not (the text follows)."""

    READY = b"R"
    ERROR = b"E"


PACK_HEAD = struct.Struct("<IH")
TENSOR_HEAD = struct.Struct("<QiiQQi")  # where, dtype, ndim, allocation (offset, bytes), writable
CALL = struct.Struct("<I")
MODE = struct.Struct("<I")
REPLY = struct.Struct("<iqi")
SEGMENT = struct.Struct("<IQ")
BURST = struct.Struct("<II")
SEGMENT_SHIFT = 48
EMPTY = (1 << 64) - 1  # the "where" of a tensor with no elements: its data pointer is NULL, as torch's is
MAX_MESSAGE = 1 << 16
MAX_NDIM = 8
ELEMENT_BYTES = {0: 4, 1: 2, 2: 2, 3: 8, 4: 4, 5: 8}  # kopt_dtype -> bytes (kernels/kopt_abi.h)
PAGE = mmap.PAGESIZE
# A reply's status when the call left the thread's floating-point mode changed (CUresults are >= 0);
# rc and ns then carry the mode before and after (FpMode.read).
FP_MODE_CHANGED = -1
X87_IN_USE = 1 << 28  # FpMode.read's bit for "an x87 register is tagged in use" (above the control word's bits)
PROT_NONE, PROT_RO, PROT_RW = 0, mmap.PROT_READ, mmap.PROT_READ | mmap.PROT_WRITE


class KoptTensor(ctypes.Structure):
    """kopt_tensor of kernels/kopt_abi.h."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
    ]


def missing_entry(role: str, entry: str) -> str:
    """Why a library cannot be called: it does not export the entry point the package names."""
    return (f"{role}: its library exports no {entry!r}, the entry point kernel.toml's `entry` names "
            "(defined with KOPT_EXPORT, as extern \"C\"?)")


def decode_pack(body: bytes, segments: dict[int, tuple[int, int]]) -> tuple[int, object, list, list]:
    """(pack id, KoptTensor array, arrays to keep alive, (segment, offset, bytes, writable, row pages) of each
    tensor's allocation) from a P message; `segments` maps a segment id to (base address here, bytes). Raises
    ValueError on anything outside them or malformed."""
    pack_id, n = PACK_HEAD.unpack_from(body, 0)
    at = PACK_HEAD.size
    array = (KoptTensor * n)()
    keep: list = []
    spans: list[tuple] = []
    for i in range(n):
        where, dtype, ndim, open_from, open_bytes, writable = TENSOR_HEAD.unpack_from(body, at)
        at += TENSOR_HEAD.size
        base, size = segments.get(where >> SEGMENT_SHIFT, (0, -1))
        offset = where & ((1 << SEGMENT_SHIFT) - 1)
        if where == EMPTY:
            base, offset, size = 0, 0, 0
        if not 0 <= ndim <= MAX_NDIM or offset > size or dtype not in ELEMENT_BYTES:
            raise ValueError("malformed pack")
        dims = struct.unpack_from(f"<{2 * ndim}q", body, at)
        at += 16 * ndim
        if where != EMPTY:
            extent = (sum((s - 1) * st for s, st in zip(dims[:ndim], dims[ndim:])) + 1) * ELEMENT_BYTES[dtype]
            if not open_bytes:  # CUDA: whole segments are mapped
                open_from, open_bytes = offset, extent
            if min(dims, default=1) < 0 or not open_from <= offset <= offset + extent <= open_from + open_bytes <= size:
                raise ValueError("malformed pack")
            rows = row_pages(offset, dims[:ndim], dims[ndim:], ELEMENT_BYTES[dtype]) if writable else ()
            spans.append((where >> SEGMENT_SHIFT, open_from, open_bytes, bool(writable), rows))
        shape = (ctypes.c_int64 * ndim)(*dims[:ndim])
        strides = (ctypes.c_int64 * ndim)(*dims[ndim:])
        keep += [shape, strides]
        array[i] = KoptTensor(base + offset, dtype, ndim, shape, strides)
    return pack_id, array, keep, spans


MAX_ROW_PAGES = 4096  # rows a view may have for its writes to be confined to their own pages


def row_pages(offset: int, shape, strides, element_bytes: int) -> tuple[tuple[int, int], ...]:
    """The pages an output's rows lie in, where a whole page or more lies between one row's end and the
    next one's start ("paged" and "far" layouts): ((first byte, end byte) of each row's pages), else ()
    (the whole allocation is the output's). A kernel that writes in such a gap, even what the gap held
    (a read-modify-write of padding after a row's end: another thread writing that memory loses its
    writes; red team, 2026-11-27), faults there."""
    if len(shape) < 2 or not 2 <= shape[0] <= MAX_ROW_PAGES or 0 in shape:
        return ()
    row = (sum((s - 1) * st for s, st in zip(shape[1:], strides[1:])) + 1) * element_bytes
    step = strides[0] * element_bytes
    if step - row < PAGE:
        return ()
    starts = (offset + r * step for r in range(shape[0]))
    return tuple((at // PAGE * PAGE, -(-(at + row) // PAGE) * PAGE) for at in starts)


class CpuPages:
    """CPU: the arena mapped with no access; the pages of each allocation a registered pack's tensors lie
    in are opened (counted: packs may share a buffer) and closed again when the last pack using it is
    forgotten. An allocation only inputs use is opened read-only: a kernel that writes an input and
    restores it before returning (wrong for a caller whose input is read-only memory or is read by another
    thread meanwhile) faults (red team, 2026-11-27). The judge forgets a pack before the memory under it is
    used again. Spans are whole allocations (remote.Arena.allocation): page-aligned, and two of them either
    the same or apart, so one count each does (a "far" buffer's allocation spans gigabytes: one mprotect,
    not a page list). Where every output in a written allocation has rows a page or more apart
    (row_pages), only the rows' pages are opened writable, the rest of it read-only."""

    def __init__(self, fd: int, size: int) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]  # fmt: skip
        self.libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = self.libc.mmap(None, size, PROT_NONE, mmap.MAP_SHARED, fd, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the buffer arena failed")
        self.base, self.size = base, size
        self.count: dict[tuple[int, int], int] = {}  # (offset, bytes) of an allocation -> packs using it
        self.writers: dict[tuple[int, int], int] = {}  # ... -> packs that write it (an output in it)
        self.whole: dict[tuple[int, int], int] = {}  # ... -> writing packs whose outputs there are not in rows
        self.rows: dict[tuple[int, int], dict[tuple, int]] = {}  # ... -> each row-page set written there: packs

    def _protect(self, span: tuple[int, int], prot: int) -> None:
        off, n = span
        first = off // PAGE * PAGE
        if self.libc.mprotect(self.base + first, -(-(off + n) // PAGE) * PAGE - first, prot):
            raise OSError(ctypes.get_errno(), "mprotect of the buffer arena failed")

    def _prot(self, span: tuple[int, int]) -> tuple[int, frozenset]:
        """The span's protection, and the pages opened writable in it where not all of it."""
        if span not in self.count:
            return PROT_NONE, frozenset()
        if not self.writers.get(span):
            return PROT_RO, frozenset()
        if self.whole.get(span):
            return PROT_RW, frozenset()
        return PROT_RO, frozenset(page for rows in self.rows.get(span, {}) for page in rows)

    @staticmethod
    def _count(table: dict, key, step: int) -> None:
        table[key] = table.get(key, 0) + step
        if not table[key]:
            del table[key]

    def _apply(self, spans: list[tuple], step: int) -> None:
        written: dict[tuple[int, int], list] = {}
        for _, off, n, w, rows in spans:
            if w:
                written.setdefault((off, n), []).append(rows)
        for span in {(off, n) for _, off, n, _, _ in spans}:
            before = self._prot(span)
            self._count(self.count, span, step)
            if span in written:
                self._count(self.writers, span, step)
                if any(not rows for rows in written[span]):
                    self._count(self.whole, span, step)
                else:
                    key = tuple(sorted({page for rows in written[span] for page in rows}))
                    self._count(self.rows.setdefault(span, {}), key, step)
                    if not self.rows[span]:
                        del self.rows[span]
            after = self._prot(span)
            if after != before:
                self._protect(span, after[0])
                for first, end in after[1]:
                    self._protect((first, end - first), PROT_RW)

    def open(self, spans: list[tuple]) -> None:
        self._apply(spans, 1)

    def close(self, spans: list[tuple]) -> None:
        self._apply(spans, -1)


class NoPages:
    """CUDA: a host maps only the segments its packs use, whole (remote.CudaArena)."""

    def open(self, spans: list[tuple]) -> None:
        pass

    close = open


class FpMode:
    """The calling thread's floating-point mode, read without the kernel's help: on x86-64 the x87
    control word (rounding, precision, exception masks) and MXCSR's control bits (flush-to-zero,
    denormals-are-zero, rounding, exception masks; not the sticky exception flags, which any float
    code sets) and whether the x87 register stack is empty, as the x86-64 calling convention leaves it (a
    kernel that left the registers tagged in use made its caller's next `long double` NaN: red team,
    2026-11-27), elsewhere the rounding mode. A kernel that returns with it changed makes every later
    float operation of its caller's thread differ (red team, 2026-11-27: FTZ or round-toward-zero left
    on after a right answer)."""

    X86_64 = os.uname().machine in ("x86_64", "AMD64")
    # glibc's x86-64 fenv_t (fnstenv's 28 bytes, then MXCSR): the fields read and written here
    CONTROL, TAGS, MXCSR = slice(0, 2), slice(8, 10), slice(28, 32)

    def __init__(self) -> None:
        libm = ctypes.CDLL("libm.so.6")  # loaded before the sandbox's filters (the interpreter has it already)
        self.fegetenv, self.fesetenv, self.fegetround = libm.fegetenv, libm.fesetenv, libm.fegetround
        self.env = ctypes.create_string_buffer(64)  # fenv_t: 32 bytes on x86-64
        self.own = self.read() if self.X86_64 else 0

    def caller(self, extra: int) -> None:
        """Put this thread in the mode of a caller: the host's own mode with `extra` MXCSR control bits set
        (flush-to-zero, denormals-are-zero, rounding; 0 gives back the host's own). x86-64 only: the judge
        sends it nowhere else. The sticky exception flags are kept as they are."""
        if not self.X86_64:
            return
        self.fegetenv(self.env)
        raw = bytearray(self.env.raw)
        mxcsr = int.from_bytes(raw[self.MXCSR], "little")
        raw[self.MXCSR] = ((mxcsr & 0x3F) | (self.own & 0xFFC0) | (extra & 0xFFC0)).to_bytes(4, "little")
        self.env.raw = bytes(raw)
        self.fesetenv(self.env)

    def read(self) -> int:
        if not self.X86_64:
            return self.fegetround()
        self.fegetenv(self.env)
        raw = self.env.raw
        in_use = X87_IN_USE if int.from_bytes(raw[self.TAGS], "little") != 0xFFFF else 0  # a tag not "empty"
        control = (int.from_bytes(raw[self.CONTROL], "little") & 0x0F3F) << 16
        return in_use | control | int.from_bytes(raw[self.MXCSR], "little") & 0xFFC0


class CpuCalls:
    """Calls on the CPU, timed by this process's clock (which the judge does not believe); each one's
    floating-point mode checked after it (outside the clock; the no-op reads it as often)."""

    def __init__(self) -> None:
        self.null = ctypes.c_void_p(None)
        self.fp = FpMode()

    def call(self, fn, array, n: int) -> tuple[int, int, int]:
        mode = self.fp.read()
        t0 = time.perf_counter_ns()
        rc = fn(array, n, self.null)
        ns = time.perf_counter_ns() - t0
        after = self.fp.read()
        return (mode, after, FP_MODE_CHANGED) if after != mode else (rc, ns, 0)

    def noop(self) -> tuple[int, int, int]:
        mode = self.fp.read()
        return (mode, 0, FP_MODE_CHANGED) if self.fp.read() != mode else (0, 0, 0)


class CudaCalls:
    """Calls on this host's stream, each between two events and waited for, as the judge's no-op is
    (so the judge's round trip less its no-op round trip is comparable with the events' reading)."""

    def __init__(self, device) -> None:
        self.dev = device
        self.graphs: list = []
        self.fp = FpMode()

    def call(self, fn, array, n: int) -> tuple[int, int, int]:
        d = self.dev
        mode = self.fp.read()
        d.record(d.start, d.stream)
        rc = fn(array, n, d.stream)
        d.record(d.end, d.stream)
        after = self.fp.read()
        status, ns = d.event_ns()
        return (mode, after, FP_MODE_CHANGED) if after != mode else (rc, ns, status)

    def noop(self) -> tuple[int, int, int]:
        d = self.dev
        mode = self.fp.read()
        d.record(d.start, d.stream)
        d.record(d.end, d.stream)
        after = self.fp.read()
        status, ns = d.event_ns()
        return (mode, after, FP_MODE_CHANGED) if after != mode else (0, ns, status)

    def capture(self, fn, packs: list) -> tuple[int, int, int]:
        rcs = []
        mode = self.fp.read()
        status, exe = self.dev.capture(lambda: rcs.extend(fn(array, n, self.dev.stream) for array, n, _ in packs))
        after = self.fp.read()
        if after != mode:
            return mode, after, FP_MODE_CHANGED
        rc = next((r for r in rcs if r), 0)
        if status or rc:
            return rc, 0, status
        self.graphs.append(exe)
        return 0, len(self.graphs) - 1, 0

    def replay(self, graph: int) -> tuple[int, int, int]:
        d = self.dev
        d.record(d.start, d.stream)
        status = d.launch_graph(self.graphs[graph], d.stream)
        d.record(d.end, d.stream)
        ev_status, ns = d.event_ns()
        return 0, ns, status or ev_status

    def burst(self, fn, array, n: int, count: int) -> tuple[int, int, int]:
        d = self.dev
        mode = self.fp.read()
        d.record(d.start, d.stream)
        rc = 0
        for _ in range(count):
            rc = fn(array, n, d.stream) or rc
        d.record(d.end, d.stream)
        after = self.fp.read()
        status, ns = d.event_ns()
        if after != mode:
            return mode, after, FP_MODE_CHANGED
        return rc, ns, status or d.sync_ctx()


def serve(sock: socket.socket, fn, segments: dict[int, tuple[int, int]], calls, device=None, pages=None) -> None:
    pages = pages or NoPages()
    packs: dict[int, tuple[object, int, list, list]] = {}
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        if not msg:
            return
        op = msg[:1]
        if op == Op.CALL:
            array, n, _, _ = packs[CALL.unpack_from(msg, 1)[0]]
            sock.send(REPLY.pack(*calls.call(fn, array, n)))
        elif op == Op.NOOP:
            sock.send(REPLY.pack(*calls.noop()))
        elif op == Op.MODE:
            calls.fp.caller(MODE.unpack_from(msg, 1)[0])
        elif op == Op.PACK:
            pack_id, array, keep, spans = decode_pack(msg[1:], segments)
            if pack_id in packs:
                return
            pages.open(spans)
            packs[pack_id] = (array, len(array), keep, spans)
        elif op == Op.FORGET:
            gone = packs.pop(CALL.unpack_from(msg, 1)[0], None)
            if gone is not None:
                pages.close(gone[3])
        elif op == Op.SEGMENT and device is not None and len(fds) == 1:
            seg, size = SEGMENT.unpack_from(msg, 1)
            from gpu_worker import cuda_driver

            segments[seg] = (cuda_driver.import_segment(fds[0], size, device.ordinal), size)
            os.close(fds[0])
        elif op == Op.CAPTURE and device is not None:
            (count,) = CALL.unpack_from(msg, 1)
            ids = struct.unpack_from(f"<{count}I", msg, 1 + CALL.size)
            sock.send(REPLY.pack(*calls.capture(fn, [packs[i][:3] for i in ids])))
        elif op == Op.REPLAY and device is not None:
            sock.send(REPLY.pack(*calls.replay(CALL.unpack_from(msg, 1)[0])))
        elif op == Op.BURST and device is not None:
            pack_id, count = BURST.unpack_from(msg, 1)
            array, n, _, _ = packs[pack_id]
            sock.send(REPLY.pack(*calls.burst(fn, array, n, count)))
        else:
            return


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def main(argv: list[str]) -> None:
    control_fd, target, arena, library, entry, role, memory_mb = argv
    sock = socket.socket(fileno=int(control_fd))
    device = None
    if target == "cuda":
        from gpu_worker import cuda_driver

        try:
            device = cuda_driver.Device(int(arena.split(":")[1]))
        except (OSError, cuda_driver.CudaError) as exc:
            sock.send(Hello.ERROR + f"{role}: the kernel process could not set up the GPU: {exc}".encode()[:4000])
            return
        segments: dict[int, tuple[int, int]] = {}
        calls = CudaCalls(device)
        pages = None
    else:
        arena_fd, arena_bytes = (int(x) for x in arena.split(":"))
        pages = CpuPages(arena_fd, arena_bytes)
        os.close(arena_fd)  # the mapping stays; the descriptor (resize, more mappings) goes
        segments = {0: (pages.base, arena_bytes)}
        calls = CpuCalls()
    from containment import seccomp
    from gpu_worker import sandbox

    # Non-dumpable: the other host (the baseline beside a candidate) runs as the same uid; without
    # this it could open /proc/<this host>/mem and patch this library's code.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    notes = sandbox.apply(target, int(memory_mb), profile="cuda-host" if device is not None else "host")
    if notes:
        print(f"kopt-host: {role}: " + "; ".join(notes), file=sys.stderr, flush=True)
    threads = _tasks()
    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        sock.send(Hello.ERROR + f"cannot load the {role} library: {exc}".encode()[:4000])
        return
    try:
        fn = getattr(lib, entry)
    except AttributeError:
        sock.send(Hello.ERROR + missing_entry(role, entry).encode())
        return
    started = _tasks() - threads
    if started > 0:
        sock.send(Hello.ERROR + f"{role}: started {started} thread(s) when its library loaded (code at load time runs "
                         "outside the calls that are checked and timed)".encode())  # fmt: skip
        return
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(KoptTensor), ctypes.c_int32, ctypes.c_void_p]
    if device is None:  # loaded: from here on a call that would tell the kernel where it runs ends the host
        why = seccomp.install("served")
        if why:
            print(f"kopt-host: {role}: {why}", file=sys.stderr, flush=True)
    sock.send(Hello.READY)
    serve(sock, fn, segments, calls, device, pages)


if __name__ == "__main__":
    main(sys.argv[1:])
