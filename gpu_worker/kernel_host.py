"""The kernel host: the only process that loads a kernel library, and it loads exactly one.

    python -m gpu_worker.kernel_host CONTROL_FD ARENA_FD ARENA_BYTES LIBRARY ENTRY ROLE MEMORY_MB

Started by the judge (the harness process, which never loads candidate code: docs/decisions/
0014-judge-and-kernel-hosts.md) inside the same jail, as a fresh interpreter without torch, so
nothing of the judge's memory (the key, the references, the verdict) is ever in this process.
Before the library loads it maps the judge's shared arena (the only memory both processes see: the
kernel-visible buffers), closes the arena's descriptor, makes itself non-dumpable (the other host
runs as the same uid), and puts on its own limits: rlimits and
the seccomp profile "host" (as the harness profile, and no threads or processes at all, so no
code of the library can run between the calls the judge makes).

The control socket (SOCK_SEQPACKET, one message per datagram), judge to host:
  P <pack id, count> then per tensor <arena offset, dtype, ndim> <shape...> <strides...>
  F <pack id>                 forget a pack (no reply)
  C <pack id>                 call the entry point once; reply <rc, ns>
  N                           no-op; reply <0, 0> (the judge's round-trip calibration)
Host to judge, once: R (ready) or E<reason>. `ns` is the host's own reading of the call; the judge
believes its own clock, and a host that reports more than the judge measured is lying.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
import sys
import time

PACK_HEAD = struct.Struct("<IH")
TENSOR_HEAD = struct.Struct("<Qii")
CALL = struct.Struct("<I")
REPLY = struct.Struct("<iq")
MAX_MESSAGE = 1 << 16
MAX_NDIM = 8


class KoptTensor(ctypes.Structure):
    """kopt_tensor of kernels/kopt_abi.h."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
    ]


def decode_pack(body: bytes, base: int, size: int) -> tuple[int, object, list]:
    """(pack id, KoptTensor array, arrays to keep alive) from a P message; raises ValueError on
    anything outside the arena or malformed."""
    pack_id, n = PACK_HEAD.unpack_from(body, 0)
    at = PACK_HEAD.size
    array = (KoptTensor * n)()
    keep: list = []
    for i in range(n):
        offset, dtype, ndim = TENSOR_HEAD.unpack_from(body, at)
        at += TENSOR_HEAD.size
        if not 0 <= ndim <= MAX_NDIM or offset > size:
            raise ValueError("malformed pack")
        dims = struct.unpack_from(f"<{2 * ndim}q", body, at)
        at += 16 * ndim
        shape = (ctypes.c_int64 * ndim)(*dims[:ndim])
        strides = (ctypes.c_int64 * ndim)(*dims[ndim:])
        keep += [shape, strides]
        array[i] = KoptTensor(base + offset, dtype, ndim, shape, strides)
    return pack_id, array, keep


def serve(sock: socket.socket, fn, base: int, size: int) -> None:
    packs: dict[int, tuple[object, int, list]] = {}
    null = ctypes.c_void_p(None)
    perf = time.perf_counter_ns
    while True:
        msg = sock.recv(MAX_MESSAGE)
        if not msg:
            return
        op = msg[:1]
        if op == b"C":
            array, n, _ = packs[CALL.unpack_from(msg, 1)[0]]
            t0 = perf()
            rc = fn(array, n, null)
            t1 = perf()
            sock.send(REPLY.pack(rc, t1 - t0))
        elif op == b"N":
            sock.send(REPLY.pack(0, 0))
        elif op == b"P":
            pack_id, array, keep = decode_pack(msg[1:], base, size)
            packs[pack_id] = (array, len(array), keep)
        elif op == b"F":
            packs.pop(CALL.unpack_from(msg, 1)[0], None)
        else:
            return


def main(argv: list[str]) -> None:
    control_fd, arena_fd, arena_bytes, library, entry, role, memory_mb = argv
    sock = socket.socket(fileno=int(control_fd))
    arena = mmap.mmap(int(arena_fd), int(arena_bytes))
    os.close(int(arena_fd))  # the mapping stays; the descriptor (resize, more mappings) goes
    base = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    from gpu_worker import sandbox

    # Non-dumpable: the other host (the baseline beside a candidate) runs as the same uid; without
    # this it could open /proc/<this host>/mem and patch this library's code.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    notes = sandbox.apply("cpu", int(memory_mb), profile="host")
    if notes:
        print(f"kopt-host: {role}: " + "; ".join(notes), file=sys.stderr, flush=True)
    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        sock.send(b"E" + f"cannot load the {role} library: {exc}".encode()[:4000])
        return
    try:
        fn = getattr(lib, entry)
    except AttributeError:
        sock.send(b"E" + f"{role}: entry symbol {entry!r} is not exported (KOPT_EXPORT, extern \"C\"?)".encode())
        return
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(KoptTensor), ctypes.c_int32, ctypes.c_void_p]
    sock.send(b"R")
    serve(sock, fn, base, int(arena_bytes))


if __name__ == "__main__":
    main(sys.argv[1:])
