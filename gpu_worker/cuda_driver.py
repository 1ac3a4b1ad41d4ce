"""The few CUDA driver API calls the kernel hosts and the judge make themselves (ctypes, no torch).

A CUDA kernel host (kernel_host.py) is a fresh interpreter without torch: it sets up the device's
primary context, one stream and a pair of timing events through libcuda, maps the judge's buffer
segments, and times calls. The judge (remote.py) allocates those segments: physical device memory
(cuMemCreate) exported as a file descriptor, which travels to each host over the control socket
(SCM_RIGHTS) and is mapped there into the host's own address range. Nothing else of the judge's
device memory is visible to a host (another process, another context).
"""

from __future__ import annotations

import ctypes

CUresult = ctypes.c_int
CU_STREAM_NON_BLOCKING = 1
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_STREAM_CAPTURE_MODE_GLOBAL = 0


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call}: {error_name(code) or f'CUDA error {code}'}")
        self.code = code


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]  # fmt: skip


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]  # fmt: skip


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _fn(*names: str):
    """The first of `names` libcuda exports (versioned entry points first)."""
    for name in names:
        f = getattr(lib(), name, None)
        if f is not None:
            f.restype = CUresult
            return f
    raise CudaError(names[-1], 500)  # CUDA_ERROR_NOT_FOUND


def check(call: str, code: int) -> None:
    if code:
        raise CudaError(call, code)


def error_name(code: int) -> str | None:
    """The driver's name and text for a CUresult (None for a code it does not know: a code a kernel
    process chose is not echoed)."""
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    try:
        if lib().cuGetErrorName(code, ctypes.byref(name)) or lib().cuGetErrorString(code, ctypes.byref(text)):
            return None
    except OSError:
        return None
    return f"{(text.value or b'').decode()} ({(name.value or b'').decode()})"


def _prop(ordinal: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    return prop


def granularity(ordinal: int) -> int:
    g = ctypes.c_size_t()
    prop = _prop(ordinal)
    check("cuMemGetAllocationGranularity", lib().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0))
    return g.value


def _map(handle: int, size: int, ordinal: int, hole: int = 0) -> int:
    """Reserve an address range, map `handle` into its first `size` bytes read-write for this device,
    leaving `hole` bytes after it reserved and unmapped (an access there faults); the address."""
    ptr = ctypes.c_uint64()
    check("cuMemAddressReserve", lib().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size + hole),
                                                           ctypes.c_size_t(0), ctypes.c_uint64(0),
                                                           ctypes.c_uint64(0)))  # fmt: skip
    check("cuMemMap", lib().cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle),
                                     ctypes.c_uint64(0)))  # fmt: skip
    desc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    check("cuMemSetAccess", lib().cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)))
    return ptr.value


def create_segment(size: int, ordinal: int) -> tuple[int, int]:
    """(device address in this process, exportable file descriptor) of `size` bytes of device memory
    (a multiple of granularity()); needs a current context."""
    handle = ctypes.c_uint64()
    prop = _prop(ordinal)
    check("cuMemCreate", lib().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                           ctypes.c_uint64(0)))  # fmt: skip
    fd = ctypes.c_int(-1)
    check("cuMemExportToShareableHandle", lib().cuMemExportToShareableHandle(
        ctypes.byref(fd), ctypes.c_uint64(handle.value), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_uint64(0)))
    ptr = _map(handle.value, size, ordinal)
    lib().cuMemRelease(ctypes.c_uint64(handle.value))  # the mapping keeps the memory
    return ptr, fd.value


def import_segment(fd: int, size: int, ordinal: int) -> int:
    """Map a segment exported by the judge, followed by a reserved, unmapped granule (a kernel that
    runs past a buffer placed at the segment's end faults there); returns its address here."""
    handle = ctypes.c_uint64()
    check("cuMemImportFromShareableHandle", lib().cuMemImportFromShareableHandle(
        ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    ptr = _map(handle.value, size, ordinal, hole=granularity(ordinal))
    lib().cuMemRelease(ctypes.c_uint64(handle.value))
    return ptr


class Device:
    """A kernel host's view of the GPU: the primary context of one device made current on this
    thread (the candidate's CUDA runtime binds to it), a non-blocking stream of its own, and two
    events for timing."""

    def __init__(self, ordinal: int) -> None:
        cu = lib()
        check("cuInit", cu.cuInit(0))
        dev = ctypes.c_int()
        check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), ordinal))
        self.ordinal = ordinal
        self.ctx = ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(self.ctx))
        self.stream = ctypes.c_void_p()
        check("cuStreamCreate", cu.cuStreamCreate(ctypes.byref(self.stream), CU_STREAM_NON_BLOCKING))
        self.start, self.end = ctypes.c_void_p(), ctypes.c_void_p()
        for ev in (self.start, self.end):
            check("cuEventCreate", cu.cuEventCreate(ctypes.byref(ev), 0))
        self.record = _fn("cuEventRecord")
        self.sync_stream = _fn("cuStreamSynchronize")
        self.sync_ctx = _fn("cuCtxSynchronize")
        self.elapsed = _fn("cuEventElapsedTime_v2", "cuEventElapsedTime")
        self.begin_capture = _fn("cuStreamBeginCapture_v2", "cuStreamBeginCapture")
        self.end_capture = _fn("cuStreamEndCapture")
        self.instantiate = _fn("cuGraphInstantiateWithFlags")
        self.launch_graph = _fn("cuGraphLaunch")
        self._ms = ctypes.c_float()

    def event_ns(self) -> tuple[int, int]:
        """(status, ns between the two events); waits for the stream first."""
        status = self.sync_stream(self.stream)
        if status:
            return status, 0
        status = self.elapsed(ctypes.byref(self._ms), self.start, self.end)
        return status, int(self._ms.value * 1e6)

    def capture(self, body) -> tuple[int, ctypes.c_void_p]:
        """(status, executable graph) of what body() launches on the stream."""
        status = self.begin_capture(self.stream, CU_STREAM_CAPTURE_MODE_GLOBAL)
        if status:
            return status, ctypes.c_void_p()
        body()
        graph = ctypes.c_void_p()
        status = self.end_capture(self.stream, ctypes.byref(graph))
        if status:
            return status, ctypes.c_void_p()
        exe = ctypes.c_void_p()
        status = self.instantiate(ctypes.byref(exe), graph, ctypes.c_uint64(0))
        return status, exe
