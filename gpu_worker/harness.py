"""The isolated harness: load one candidate library, then check it or time it (MEASUREMENT.md).

    python -m gpu_worker.harness JOB_JSON_PATH RESULT_FD

Reads a HarnessJob (gpu_worker.runner), writes exactly one TestResult or ProfileResult JSON object
to RESULT_FD and exits 0, also when the kernel or the package fails: the failure is the result.
A crash, hang or exit() inside the kernel ends this process; the parent reports that instead.
Every torch.cuda call sits behind target == "cuda", so a CPU job never touches a GPU.
"""

from __future__ import annotations

import warnings

# Some environments ship torch without numpy; the warning would fill every failure's log tail.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import ctypes  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import torch  # noqa: E402

from gpu_worker import timing  # noqa: E402
from gpu_worker.device import cpu_name  # noqa: E402
from gpu_worker.runner import PROGRESS_PREFIX, HarnessJob  # noqa: E402
from kopt import expr  # noqa: E402
from kopt.models import ELEMENT_SIZE, Argument, ProfileResult, ShapeCheck, ShapeTiming, TestResult, Tolerance  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KOPT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int32: 4, torch.int64: 5}
KOPT_ERRORS = {1: "KOPT_ERR_ARGS", 2: "KOPT_ERR_DTYPE", 3: "KOPT_ERR_SHAPE", 4: "KOPT_ERR_LAUNCH"}
# Outputs are poisoned with a quiet NaN carrying a payload, so "never written" (the exact poison
# bits survive) is told apart from a NaN the kernel computed.
POISON = {
    torch.float32: (torch.int32, 0x7FC5A5A5),
    torch.float64: (torch.int64, 0x7FF8A5A5A5A5A5A5),
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FE5),
}
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PROFILE_SETS = 3  # rotating input sets per timed shape
PROFILE_SET_BUDGET = 8 << 30  # bytes of rotating sets on CUDA; huge shapes rotate fewer (min 2)

log = logging.getLogger("kopt.harness")


class KernelFailure(Exception):
    """The candidate failed a check in a way that ends the job; the message is the reason."""


class KoptTensor(ctypes.Structure):
    """kopt_tensor of kernels/kopt_abi.h."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
    ]


class Packed:
    """The argument array of one call, built once so the timed region holds only the call."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.n = len(tensors)
        self.array = (KoptTensor * self.n)()
        self._keep = []  # shape/stride arrays must outlive the calls
        for i, t in enumerate(tensors):
            shape = (ctypes.c_int64 * t.dim())(*t.shape)
            strides = (ctypes.c_int64 * t.dim())(*t.stride())
            self._keep += [shape, strides]
            self.array[i] = KoptTensor(t.data_ptr(), KOPT_DTYPES[t.dtype], t.dim(), shape, strides)


class Kernel:
    """The candidate's entry point: int ENTRY(const kopt_tensor*, int32_t, void *stream)."""

    def __init__(self, library: str, entry: str, stream: int | None) -> None:
        try:
            self.lib = ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            raise KernelFailure(f"cannot load the library: {exc}") from None
        try:
            fn = getattr(self.lib, entry)
        except AttributeError:
            raise KernelFailure(f"entry symbol {entry!r} is not exported (KOPT_EXPORT, extern \"C\"?)") from None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(KoptTensor), ctypes.c_int32, ctypes.c_void_p]
        self.fn = fn
        self.stream = ctypes.c_void_p(stream)

    def __call__(self, packed: Packed) -> int:
        return self.fn(packed.array, packed.n, self.stream)


def error_message(rc: int) -> str:
    return f"entry returned KOPT error {rc} ({KOPT_ERRORS.get(rc, 'unknown code')})"


# ---------------------------------------------------------------- inputs and outputs


class Case:
    """One problem instance: pristine inputs, the buffers the kernel sees, and its packed args."""

    def __init__(self, job: HarnessJob, ref: ModuleType, dims: dict[str, int], dtype: str, seed: int, device: str):
        self.args = job.spec.arguments
        run_dtype = TORCH_DTYPES[dtype]
        with torch.no_grad():
            made = ref.make_inputs(dict(dims), run_dtype, seed, device)
        self.pristine: dict[str, torch.Tensor] = {}  # never passed to the kernel
        self.tensors: dict[str, torch.Tensor] = {}  # what the kernel sees, fresh allocations
        for arg in self.args:
            shape = [int(expr.evaluate(d, dims)) for d in arg.shape]
            want = TORCH_DTYPES[arg.dtype] if arg.dtype else run_dtype
            if arg.role == "out":
                self.tensors[arg.name] = torch.empty(shape, dtype=want, device=device)
                continue
            t = _validated_input(made, arg, shape, want, device)
            # The kernel gets its own copy of inout args; `in` args are compared with a copy after.
            self.pristine[arg.name] = t if arg.role == "inout" else t.clone()
            self.tensors[arg.name] = t.clone() if arg.role == "inout" else t
        self.refresh()
        self.packed = Packed([self.tensors[a.name] for a in self.args])

    def refresh(self) -> None:
        """Poison outputs and restore inout args, so each call must do all of its work again."""
        for arg in self.args:
            t = self.tensors[arg.name]
            if arg.role == "out":
                poison(t)
            elif arg.role == "inout":
                t.copy_(self.pristine[arg.name])

    def reference(self, ref: ModuleType) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            # Clones: a reference that writes to its inputs must not spoil the pristine copies.
            out = ref.reference({k: v.clone() for k, v in self.pristine.items()})
        for arg in self.args:
            if arg.role == "in":
                continue
            if arg.name not in out:
                raise ValueError(f"reference.py: reference() returned no {arg.name!r}")
            if tuple(out[arg.name].shape) != tuple(self.tensors[arg.name].shape):
                raise ValueError(
                    f"reference.py: reference() returned {arg.name!r} of shape {list(out[arg.name].shape)}, "
                    f"kernel.toml declares {list(self.tensors[arg.name].shape)}"
                )
        return out


def _validated_input(made: dict, arg: Argument, shape: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    t = made.get(arg.name) if isinstance(made, dict) else None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"reference.py: make_inputs() returned no tensor {arg.name!r}")
    if list(t.shape) != shape or t.dtype != dtype or t.device.type != device:
        raise ValueError(
            f"reference.py: make_inputs() gave {arg.name!r} as {list(t.shape)} {t.dtype} on {t.device}, "
            f"kernel.toml declares {shape} {dtype} on {device}"
        )
    return t


def poison(t: torch.Tensor) -> None:
    if t.dtype in POISON:
        int_dtype, bits = POISON[t.dtype]
        t.view(int_dtype).fill_(bits)
    else:
        t.fill_(float("nan") if t.is_floating_point() else -1)


def unwritten_mask(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in POISON:
        int_dtype, bits = POISON[t.dtype]
        return t.view(int_dtype) == bits
    return torch.isnan(t) if t.is_floating_point() else torch.zeros_like(t, dtype=torch.bool)


# ---------------------------------------------------------------- checks


class Errors:
    """Running max abs/rel error over the outputs of one shape and dtype."""

    def __init__(self) -> None:
        self.abs = 0.0
        self.rel = 0.0
        self.seen = False

    def update(self, abs_err: float, rel_err: float) -> None:
        self.abs, self.rel, self.seen = max(self.abs, abs_err), max(self.rel, rel_err), True


def check_case(case: Case, refs: dict[str, torch.Tensor], tol: Tolerance, errors: Errors) -> str | None:
    """First failed check of one call's outputs and inputs, or None. Order: never written,
    NaN/Inf, closeness, all zeros, then inputs modified."""
    for arg in case.args:
        if arg.role == "in":
            continue
        raw = case.tensors[arg.name]
        want = refs[arg.name].to(raw.device)
        want = want if want.dtype == torch.float64 else want.float()
        got = raw.to(want.dtype)
        finite = torch.isfinite(want)
        numel = want.numel()
        name = arg.name
        if arg.role == "out":
            n = int((unwritten_mask(raw) & finite).sum())
            if n:
                return f"{name}: {n} of {numel} elements never written (still the NaN poison)"
        n = int((~torch.isfinite(got) & finite).sum())
        if n:
            return f"{name}: {n} of {numel} elements are NaN/Inf where the reference is finite"
        special = ~finite
        n = int((special & ~((torch.isnan(got) & torch.isnan(want)) | (got == want))).sum())
        if n:
            return f"{name}: {n} elements differ from the reference's NaN/Inf values"
        diff = torch.where(finite, (got - want).abs(), torch.zeros_like(want))
        scale = want.abs()
        rel = diff / scale.clamp_min(max(tol.atol, 1e-30))
        if numel:
            errors.update(float(diff.max()), float(rel.max()))
        excess = diff - (tol.atol + tol.rtol * scale)
        bad = excess > 0
        n = int(bad.sum())
        if n:
            at = int(torch.argmax(torch.where(bad, diff, torch.full_like(diff, -1.0))))
            idx = [int(i) for i in torch.unravel_index(torch.tensor(at), want.shape)]
            return (
                f"{name}: {n} of {numel} elements mismatch; worst at {idx}: got {float(got.flatten()[at]):.6g}, "
                f"expected {float(want.flatten()[at]):.6g} (|err| {float(diff.flatten()[at]):.3g} > "
                f"atol {tol.atol:g} + rtol {tol.rtol:g} * |ref|)"
            )
        if numel and int(torch.count_nonzero(got)) == 0 and int(torch.count_nonzero(want)) != 0:
            return f"{name}: output is all zeros while the reference is not"
    for arg in case.args:
        if arg.role != "in":
            continue
        now, before = case.tensors[arg.name], case.pristine[arg.name]
        int_dtype = SAME_SIZE_INT[now.element_size()]
        n = int((now.view(int_dtype) != before.view(int_dtype)).sum())
        if n:
            return f"{arg.name}: input modified by the kernel ({n} of {now.numel()} elements changed)"
    return None


# ---------------------------------------------------------------- modes


class Context:
    """What a job loads once: the reference module, the kernel, the device."""

    def __init__(self, job: HarnessJob) -> None:
        self.job = job
        self.cuda = job.target == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("target cuda, but torch sees no CUDA device")
            self.device = torch.device("cuda", torch.cuda.current_device())
            # A stream of our own, so the stream a kernel is given is never the legacy default one.
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
            self.device_name = torch.cuda.get_device_name(self.device)
            stream = torch.cuda.current_stream(self.device).cuda_stream
        else:
            self.device = torch.device("cpu")
            self.device_name = cpu_name()
            stream = None
        self.ref = load_reference(Path(job.package_dir))
        self.kernel = Kernel(job.library, job.spec.entry, stream)

    def sync(self) -> None:
        """Wait for the harness stream only: work a kernel hid on another stream is not waited for."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def case(self, dims: dict[str, int], dtype: str, seed: int) -> Case:
        return Case(self.job, self.ref, dims, dtype, seed, self.device.type)


def load_reference(package_dir: Path) -> ModuleType:
    path = package_dir / "reference.py"
    spec = importlib.util.spec_from_file_location(f"kopt_reference_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for fn in ("make_inputs", "reference"):
        if not callable(getattr(module, fn, None)):
            raise ValueError(f"{path}: no function {fn}()")
    return module


def derive_seed(job_seed: int, *parts: object) -> int:
    """A seed the candidate cannot predict from the shape, yet reproducible from the job seed."""
    digest = hashlib.blake2b(json.dumps([job_seed, *map(str, parts)]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def run_test(ctx: Context) -> TestResult:
    job = ctx.job
    checks: list[ShapeCheck] = []
    reason = None
    for shape in job.shapes:
        for dtype in job.dtypes:
            errors, message = Errors(), None
            for trial in range(job.trials):
                progress(f"test {shape.label} {dtype} trial {trial}")
                case = ctx.case(shape.dims, dtype, derive_seed(job.seed, shape.label, dtype, trial))
                message = test_case(ctx, case, job.tolerances[dtype], errors)
                del case
                if message:
                    break
            checks.append(
                ShapeCheck(
                    shape=shape.label, dtype=dtype, ok=message is None, message=message,
                    max_abs_err=errors.abs if errors.seen else None, max_rel_err=errors.rel if errors.seen else None,
                )  # fmt: skip
            )
            if message and reason is None:
                reason = f"{shape.label} {dtype}: {message}"
    if ctx.cuda:
        torch.cuda.synchronize()  # surface asynchronous launch errors as failures of this job
    if not checks:
        reason = "nothing to test: no shapes or no dtypes"
    return TestResult(
        candidate_id=job.candidate_id, correct=reason is None, reason=reason, checks=checks, device=ctx.device_name
    )


def test_case(ctx: Context, case: Case, tol: Tolerance, errors: Errors) -> str | None:
    """Call the candidate first, on fresh allocations, then check it against the reference; then
    re-poison and call again on the same buffers (catches kernels that answer once per address)."""
    rc = ctx.kernel(case.packed)
    ctx.sync()
    if rc != 0:
        return error_message(rc)
    refs = case.reference(ctx.ref)
    message = check_case(case, refs, tol, errors)
    if message:
        return message
    case.refresh()
    rc = ctx.kernel(case.packed)
    ctx.sync()
    if rc != 0:
        return f"second call on the same buffers: {error_message(rc)}"
    message = check_case(case, refs, tol, errors)
    return f"second call on the same buffers: {message}" if message else None


def run_profile(ctx: Context) -> ProfileResult:
    job = ctx.job
    progress("profile copy bandwidth")
    copy_bw = timing.cuda_copy_bandwidth(ctx.device) if ctx.cuda else timing.cpu_copy_bandwidth()
    cold = timing.ColdL2(ctx.device) if ctx.cuda else None
    cap = job.time_cap_s or timing.TIME_CAP_S[job.target]
    result = ProfileResult(candidate_id=job.candidate_id, ok=True, device=ctx.device_name, copy_bandwidth_gbs=copy_bw)
    for shape in job.shapes:
        for dtype in job.dtypes:
            progress(f"profile {shape.label} {dtype}")
            stats, message = time_shape(ctx, shape.dims, shape.label, dtype, cold, cap)
            if message:
                result.ok, result.reason = False, f"{shape.label} {dtype}: {message}"
                return result
            nbytes = expr.evaluate(job.spec.model.bytes, {**shape.dims, "elem": ELEMENT_SIZE[dtype]})
            gbs = nbytes / (stats.median_us * 1e-6) / 1e9 if stats.median_us > 0 else math.inf
            result.timings.append(
                ShapeTiming(
                    shape=shape.label, dtype=dtype, median_us=stats.median_us, p10_us=stats.p10_us,
                    p90_us=stats.p90_us, samples=stats.samples, gbytes_per_s=gbs, pct_sol=100.0 * gbs / copy_bw,
                )  # fmt: skip
            )
    if not result.timings:
        result.ok, result.reason = False, "nothing to profile: no shapes or no dtypes"
    return result


def time_shape(
    ctx: Context, dims: dict[str, int], label: str, dtype: str, cold: timing.ColdL2 | None, cap: float
) -> tuple[timing.Stats, str | None]:
    """Warm up, sample, then re-check the last timed call's outputs (catches answer-once kernels)."""
    job = ctx.job
    first = ctx.case(dims, dtype, derive_seed(job.seed, label, dtype, "profile", 0))
    n_sets = PROFILE_SETS
    if ctx.cuda:
        set_bytes = sum(t.numel() * t.element_size() for t in [*first.tensors.values(), *first.pristine.values()])
        n_sets = max(2, min(PROFILE_SETS, PROFILE_SET_BUDGET // max(set_bytes, 1)))
    cases = [first] + [ctx.case(dims, dtype, derive_seed(job.seed, label, dtype, "profile", k)) for k in range(1, n_sets)]
    order = itertools.cycle(range(n_sets))
    current = [0]

    def before() -> None:
        current[0] = next(order)
        cases[current[0]].refresh()

    def call() -> None:
        rc = ctx.kernel(cases[current[0]].packed)
        if rc != 0:
            raise KernelFailure(error_message(rc))

    def warm_call() -> None:
        before()
        call()

    try:
        timing.warmup(warm_call, ctx.sync)
        if ctx.cuda:
            measure = timing.cuda_measure(call, before, cold)
        else:
            measure = timing.cpu_measure(call, before)
        stats = timing.sample(measure, cap)
    except KernelFailure as exc:
        return timing.Stats(0, 0, 0, 0, math.inf), str(exc)
    ctx.sync()
    last = cases[current[0]]
    message = check_case(last, last.reference(ctx.ref), job.tolerances[dtype], Errors())
    del cases, first, last
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the next shape's sets and the flush buffer need the room
    return stats, (f"timed output re-check failed: {message}" if message else None)


# ---------------------------------------------------------------- entry point


_step = [""]  # the current step, named in the reason of a Python error


def progress(step: str) -> None:
    """One line per step on stderr; the parent names the last one when the kernel crashes or hangs."""
    _step[0] = step
    log.info(step)


def run_job(job: HarnessJob) -> TestResult | ProfileResult:
    with torch.no_grad():
        ctx = Context(job)
        return run_test(ctx) if job.mode == "test" else run_profile(ctx)


def failed(job: HarnessJob | None, mode: str, reason: str) -> TestResult | ProfileResult:
    cid = job.candidate_id if job else ""
    if mode == "test":
        return TestResult(candidate_id=cid, correct=False, reason=reason)
    return ProfileResult(candidate_id=cid, ok=False, reason=reason)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    job_path, fd = Path(args[0]), int(args[1])
    result_file = os.fdopen(fd, "w")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(PROGRESS_PREFIX + "%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    start = time.monotonic()
    job, mode = None, "test"
    try:
        raw = json.loads(job_path.read_text())
        mode = raw.get("mode", "test")
        job = HarnessJob.model_validate(raw)
        result = run_job(job)
    except KernelFailure as exc:
        result = failed(job, mode, str(exc))
    except Exception as exc:  # any Python error is a failed result, never a missing one
        traceback.print_exc()
        where = f" (during {_step[0]})" if _step[0] else ""
        result = failed(job, mode, f"{type(exc).__name__}: {exc}{where}")
    result.seconds = time.monotonic() - start
    if not result.device and job is not None:
        result.device = cpu_name() if job.target == "cpu" else _cuda_name()
    result_file.write(result.model_dump_json())
    result_file.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: library destructors and CUDA shutdown of a broken context may crash.
    os._exit(0)


def _cuda_name() -> str:
    try:
        return torch.cuda.get_device_name() if torch.cuda.is_initialized() else ""
    except Exception:  # a broken context may refuse even this
        return ""


if __name__ == "__main__":
    main()
