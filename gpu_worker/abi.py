"""The kernel C ABI of kernels/kopt_abi.h, seen from ctypes (harness child only)."""

from __future__ import annotations

import ctypes
import os

import torch

from gpu_worker.kernel_host import KoptTensor, missing_entry  # noqa: F401 - one definition, torch-free

KOPT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int32: 4, torch.int64: 5}
KOPT_ERRORS = {1: "KOPT_ERR_ARGS", 2: "KOPT_ERR_DTYPE", 3: "KOPT_ERR_SHAPE", 4: "KOPT_ERR_LAUNCH"}
UNSUPPORTED = (1, 2, 3)  # codes that say "this kernel does not take these arguments", not "I broke"


class KernelFailure(Exception):
    """A kernel library failed in a way that ends the job; the message is the reason. `party`: whose
    library, the candidate's or the baseline's (kernel hosts are named by role); `memory_fault`: it
    touched memory no buffer of its call covers (a segmentation fault, a CUDA illegal address);
    `group`: the check group it failed at, where the test step knows it."""

    def __init__(self, message: str, memory_fault: bool = False, party: str = "candidate") -> None:
        super().__init__(message)
        self.memory_fault = memory_fault
        self.party = party
        self.group: str | None = None


class PackageFault(Exception):
    """The package's own code (reference.py's make_inputs or reference) failed: the package is at fault,
    not the kernel under test; the message names the file and the case."""

    def __init__(self, message: str) -> None:
        super().__init__(f"package error: {message}")


class Packed:
    """The argument array of one call, built once so the timed region holds only the call."""

    def __init__(self, tensors: list[torch.Tensor], readonly: list[bool] | None = None) -> None:
        self.n = len(tensors)
        self.tensors = tensors  # kept alive with the array of their pointers
        # Per tensor: an input the kernel must not write (a CPU kernel host maps its memory read-only).
        self.readonly = readonly or [False] * self.n
        self.array = (KoptTensor * self.n)()
        self._keep = []  # shape/stride arrays must outlive the calls
        for i, t in enumerate(tensors):
            shape = (ctypes.c_int64 * t.dim())(*t.shape)
            strides = (ctypes.c_int64 * t.dim())(*t.stride())
            self._keep += [shape, strides]
            self.array[i] = KoptTensor(t.data_ptr(), KOPT_DTYPES[t.dtype], t.dim(), shape, strides)


class Kernel:
    """One library's entry point: int ENTRY(const kopt_tensor*, int32_t, void *stream)."""

    def __init__(self, library: str, entry: str, stream: int | None, role: str = "candidate") -> None:
        try:
            self.lib = ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            raise KernelFailure(f"cannot load the {role} library: {exc}", party=role) from None
        try:
            fn = getattr(self.lib, entry)
        except AttributeError:
            raise KernelFailure(missing_entry(role, entry), party=role) from None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(KoptTensor), ctypes.c_int32, ctypes.c_void_p]
        self.fn = fn
        self.role = role
        self.stream = ctypes.c_void_p(stream)

    def __call__(self, packed: Packed, stream: int | None = None) -> int:
        return self.fn(packed.array, packed.n, self.stream if stream is None else ctypes.c_void_p(stream))


def error_message(rc: int) -> str:
    """A KOPT error by its name; any other code unnamed (a code the kernel chose carries whatever it
    put there, e.g. bytes of a file, into the reason, history and the next prompt)."""
    if rc in KOPT_ERRORS:
        return f"entry returned KOPT error {rc} ({KOPT_ERRORS[rc]})"
    return "entry returned a non-zero code that is not a KOPT_ERR_* value"
