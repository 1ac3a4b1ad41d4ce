"""Benchmark: kopt's Astra kernels side by side with FlashInfer and torch.compile, in one process.

For silu_and_mul, fused_add_rmsnorm and merge_attn_states_lse, at the package's bench and held-out
shapes and the model shapes of issue #15's table, it times in one process, interleaved call by call:
  baseline       the package's kernel.cu with its default tunables (kopt's ABI, through ctypes)
  best           a run's best: best_kernel.cu beside --best K=REPORT.json with its flags (a
                 shape-specialized best is more than other tunables); without that file, kernel.cu
                 with the best's tunables (default: the newest bench/results/astra-report-K-*.json)
  flashinfer     FlashInfer's header-only kernels (bench/peers/flashinfer_ops.cu), launched as its
                 Python front end launches them
  torch.compile  the op written in torch, compiled by inductor with its defaults
Each call runs cold (a 2x-L2 buffer overwritten before it, then ~0.1 ms of GPU sleep so that the
host's launch cost stays out of the events), timed by CUDA events on one stream; the figure is the
median of --reps calls. Every implementation's output is first checked against
eager torch in fp32 (a mismatch is printed and marked in the JSON). Prints a table and writes
bench/results/peers-<gpu>-<time>.json (device, versions, command, every figure).

FlashInfer's headers come from its wheel; nothing of it enters git. On a machine with nvcc:
    pip download --no-deps flashinfer-python==0.7.2.post1 -d /tmp/fi
    python bench/peers.py headers /tmp/fi/flashinfer_python-0.7.2.post1-py3-none-any.whl .peers
then, on the GPU machine (carry .peers):
    python bench/peers.py run --include .peers [--reps 100] [--kernels silu_and_mul,...]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KERNELS = ["silu_and_mul", "fused_add_rmsnorm", "merge_attn_states_lse"]
WRAPPER = REPO / "bench" / "peers" / "flashinfer_ops.cu"
# Headers FlashInfer's norm.cuh pulls in for kernels the bench does not use; empty stand-ins where the
# toolkit lacks them (a CUDA install without cuBLAS or cuRAND headers).
STUBS = ["cublasLt.h", "cublas_v2.h", "curand_kernel.h"]
EPS = 1e-6  # kopt's fused_add_rmsnorm (kernel.toml summary)
# Issue #15's model shapes, beside each package's bench and held-out shapes: (dims, dtype).
MODEL_SHAPES = {
    "silu_and_mul": [({"T": 512, "D": 14336}, "bfloat16"), ({"T": 16384, "D": 14336}, "bfloat16"),
                     ({"T": 1, "D": 11008}, "float16"), ({"T": 777, "D": 3420}, "bfloat16")],
    "fused_add_rmsnorm": [({"T": 1, "H": 4096}, "bfloat16"), ({"T": 333, "H": 3584}, "bfloat16"),
                          ({"T": 2048, "H": 5120}, "float16")],
    "merge_attn_states_lse": [({"T": 4096, "NH": 8, "D": 64}, "bfloat16"), ({"T": 3, "NH": 64, "D": 128}, "float16")],
}  # fmt: skip
IMPLEMENTATIONS = ("baseline", "best", "flashinfer", "torch.compile")  # the order of a case's columns
BENCH_DTYPE = {"silu_and_mul": "bfloat16", "fused_add_rmsnorm": "bfloat16", "merge_attn_states_lse": "float16"}


def headers(wheel: Path, dest: Path) -> None:
    """Copy the FlashInfer headers the wrapper includes (found by nvcc -M) from the wheel to dest."""
    from containment.build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        sys.exit("peers headers: nvcc not found (it lists the headers the wrapper includes)")
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("flashinfer/data/include/")])
        include = Path(tmp) / "flashinfer" / "data" / "include"
        stubs = dest / "stub"
        stubs.mkdir(parents=True, exist_ok=True)
        for h in STUBS:
            (stubs / h).write_text("// empty: the FlashInfer kernels in bench/peers use nothing of it\n")
        deps = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", f"-I{include}", f"-I{stubs}", "-M", str(WRAPPER)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        used = {Path(p).resolve() for p in re.findall(r"(\S+\.(?:cuh|h|hpp))", deps) if p.startswith(str(include))}
        for src in sorted(used):
            rel = src.relative_to(include.resolve())
            (dest / "include" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / "include" / rel)
    version = re.search(r"flashinfer_python-([^-]+)-", wheel.name)
    (dest / "VERSION").write_text((version.group(1) if version else "unknown") + "\n")
    print(f"{len(used)} headers of FlashInfer {version.group(1) if version else '?'} in {dest / 'include'}")


# --- implementations -------------------------------------------------------------------------------


def torch_ops():
    import torch

    def silu_and_mul(x):
        d = x.shape[-1] // 2
        return (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)

    def fused_add_rmsnorm(x, r, w):
        s = x.float() + r.float()
        r.copy_(s.to(r.dtype))
        x.copy_((s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype))

    def merge(v_a, s_a, v_b, s_b):
        m = torch.maximum(s_a, s_b)
        ea, eb = torch.exp(s_a - m), torch.exp(s_b - m)
        v = (v_a.float() * ea[..., None] + v_b.float() * eb[..., None]) / (ea + eb)[..., None]
        return v.to(v_a.dtype), torch.log(ea + eb) + m

    return {"silu_and_mul": silu_and_mul, "fused_add_rmsnorm": fused_add_rmsnorm, "merge_attn_states_lse": merge}


class Case:
    """One kernel at one shape and dtype: fresh inputs per implementation, each implementation's
    call as a closure over its own tensors, and its output checked against eager torch."""

    def __init__(self, kernel: str, dims: dict[str, int], dtype: str, libs: dict, fi, compiled) -> None:
        import torch

        dt_ = getattr(torch, dtype)
        dev, stream = "cuda", torch.cuda.current_stream().cuda_stream
        gen = torch.Generator(device=dev).manual_seed(0)
        code = 1 if dtype == "bfloat16" else 0

        def randn(*shape, dtype=dt_):
            return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

        self.calls, self.check = {}, {}
        self.libs = libs
        names = [n for n in IMPLEMENTATIONS if n in libs or n == "torch.compile" or (n == "flashinfer" and fi)]
        eager = torch_ops()[kernel]
        if kernel == "silu_and_mul":
            t, d = dims["T"], dims["D"]
            x = randn(t, 2 * d)
            want = eager(x).float()
            for name in names:
                out, held = torch.empty(t, d, device=dev, dtype=dt_), {}

                def tc(x=x, held=held):
                    held["out"] = compiled(x)  # its own output tensor: no copy in the timed region

                def result(out=out, held=held, name=name):
                    return (held["out"] if name == "torch.compile" else out).float()

                self._add(name, [x, out], result, want,
                          fi_call=lambda x=x, out=out: fi.fi_silu_and_mul(code, ptr(out), ptr(x), t, d, stream),
                          tc_call=tc)  # fmt: skip
        elif kernel == "fused_add_rmsnorm":
            t, h = dims["T"], dims["H"]
            x0, r0, w = randn(t, h), randn(t, h), randn(h)
            xe, re_ = x0.clone(), r0.clone()
            eager(xe, re_, w)
            want = torch.cat([xe.float(), re_.float()])
            for name in names:
                x, r = x0.clone(), r0.clone()
                first = (x.clone(), r.clone())  # outputs are checked after the first call only

                def result(x=x, r=r, first=first):
                    got = torch.cat([x.float(), r.float()])
                    x.copy_(first[0]), r.copy_(first[1])
                    return got

                self._add(name, [x, r, w], result, want,
                          fi_call=lambda x=x, r=r: fi.fi_fused_add_rmsnorm(code, ptr(x), ptr(r), ptr(w), t, h,
                                                                           ctypes.c_float(EPS), stream),
                          tc_call=lambda x=x, r=r: compiled(x, r, w))  # fmt: skip
        else:
            t, nh, d = dims["T"], dims["NH"], dims["D"]
            v_a, v_b = randn(t, nh, d), randn(t, nh, d)
            s_a, s_b = randn(t, nh, dtype=torch.float32) * 3, randn(t, nh, dtype=torch.float32) * 3
            l2e = 1.0 / math.log(2.0)
            s_a2, s_b2 = s_a * l2e, s_b * l2e  # FlashInfer's LSEs are base 2
            wv, ws = eager(v_a, s_a, v_b, s_b)
            want = torch.cat([wv.float().flatten(), ws.flatten()])
            for name in names:
                v_out = torch.empty(t, nh, d, device=dev, dtype=dt_)
                s_out = torch.empty(t, nh, device=dev, dtype=torch.float32)
                scale = l2e if name == "flashinfer" else 1.0

                held = {}

                def result(v_out=v_out, s_out=s_out, scale=scale, held=held, name=name):
                    v, s = held["out"] if name == "torch.compile" else (v_out, s_out)
                    return torch.cat([v.float().flatten(), s.flatten() / scale])

                def tc(held=held):
                    held["out"] = compiled(v_a, s_a, v_b, s_b)

                self._add(name, [v_a, s_a, v_b, s_b, v_out, s_out], result, want,
                          fi_call=lambda v_out=v_out, s_out=s_out: fi.fi_merge_state(
                              code, ptr(v_a), ptr(s_a2), ptr(v_b), ptr(s_b2), ptr(v_out), ptr(s_out), t, nh, d,
                              stream),
                          tc_call=tc)  # fmt: skip

    def _add(self, name, tensors, result, want, fi_call, tc_call) -> None:
        from gpu_worker.abi import Packed

        if name in ("baseline", "best"):
            kernel, packed = self.libs[name], Packed(tensors)

            def call(kernel=kernel, packed=packed):
                rc = kernel(packed)
                if rc:
                    raise RuntimeError(f"{name}: kopt entry returned {rc}")

        elif name == "flashinfer":

            def call():
                rc = fi_call()
                if rc:
                    raise RuntimeError(f"flashinfer: cudaError {rc}")

        else:
            call = tc_call
        self.calls[name] = call
        self.check[name] = (result, want)

    def verify(self) -> dict[str, float]:
        """Each implementation's largest error against eager torch, relative to the output's scale."""
        import torch

        errors = {}
        for name, call in self.calls.items():
            call()
            torch.cuda.synchronize()
            result, want = self.check[name]
            got = result()
            errors[name] = float(((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
        return errors


def ptr(t) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def build_kopt(kernel: str, tunables: dict[str, int], flags: list[str], out: Path, source: str | None = None) -> Path:
    """The package's kernel.cu with these tunables, or a run's best source as it is (a shape-specialized
    best is more than kernel.cu with other values)."""
    from containment.build import compile_command, detect_toolchain
    from kopt.package import apply_tunables

    src = out.with_suffix(".cu")
    src.write_text(source or apply_tunables((REPO / "kernels" / kernel / "kernel.cu").read_text(), tunables))
    subprocess.run(compile_command(detect_toolchain("cuda"), src, out, flags), check=True, capture_output=True)
    return out


def build_flashinfer(include: Path, out: Path) -> Path:
    from containment.build import find_nvcc

    subprocess.run([find_nvcc(), "-std=c++17", "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                    f"-I{include / 'include'}", f"-I{include / 'stub'}", "-o", str(out), str(WRAPPER)],
                   check=True, capture_output=True)  # fmt: skip
    return out


def newest_report(kernel: str) -> Path | None:
    found = sorted((REPO / "bench" / "results").glob(f"astra-report-{kernel}-*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


SLEEP_CYCLES = 200_000  # ~0.1 ms of GPU sleep ahead of each call: the host's launch cost (torch.compile's
# guards, ctypes) is then hidden behind it, and the start event is not recorded before the call is queued


def time_case(case: Case, reps: int, cold) -> dict[str, float]:
    """Median event time (us) per implementation, calls interleaved in a rotating order."""
    import torch

    names = list(case.calls)
    for name in names:  # warm: module loads, autotuning, first-launch costs
        for _ in range(3):
            case.calls[name]()
    torch.cuda.synchronize()
    events = {n: [] for n in names}
    for i in range(reps):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cold.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            case.calls[name]()
            end.record()
            events[name].append((start, end))
        if i % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {n: statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev) for n, ev in events.items()}


def run(args) -> None:
    import torch

    from gpu_worker.abi import Kernel
    from kopt.package import load_spec

    kernels = args.kernels.split(",")
    bests = dict(b.split("=", 1) for b in args.best)
    tmp = Path(tempfile.mkdtemp(prefix="kopt-peers-"))
    plan, jobs = {}, {}
    with ThreadPoolExecutor(8) as pool:
        if args.include:
            jobs["flashinfer"] = pool.submit(build_flashinfer, Path(args.include), tmp / "flashinfer_ops.so")
        for k in kernels:
            spec = load_spec(REPO / "kernels" / k)
            report = Path(bests[k]).resolve() if k in bests else newest_report(k)
            best = json.loads(report.read_text())["best"] if report else None
            plan[k] = {"spec": spec, "report": str(report.relative_to(REPO)) if report and report.is_relative_to(REPO)
                       else str(report), "best": best}  # fmt: skip
            jobs[(k, "baseline")] = pool.submit(build_kopt, k, {}, spec.build["cuda"].flags, tmp / f"{k}-baseline.so")
            if best:
                written = report.parent / "best_kernel.cu"  # beside a run's report.json (frontend.report)
                jobs[(k, "best")] = pool.submit(build_kopt, k, best["tunables"], best["flags"], tmp / f"{k}-best.so",
                                                written.read_text() if written.is_file() else None)
        built = {key: job.result() for key, job in jobs.items()}
    fi = None
    if "flashinfer" in built:
        fi = ctypes.CDLL(str(built["flashinfer"]))
        fi.fi_silu_and_mul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                       ctypes.c_void_p]  # fmt: skip
        fi.fi_fused_add_rmsnorm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int,
                                                                                     ctypes.c_float, ctypes.c_void_p]
        fi.fi_merge_state.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    stream = torch.cuda.current_stream().cuda_stream
    cold = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    compiled_ops = {k: torch.compile(f) for k, f in torch_ops().items()}
    rows = []
    for k in kernels:
        spec = plan[k]["spec"]
        libs = {role: Kernel(str(built[(k, role)]), spec.entry, stream, role) for role in ("baseline", "best")
                if (k, role) in built}  # fmt: skip
        shapes = [(s.dims, BENCH_DTYPE[k], "bench") for s in spec.shapes["cuda"].bench]
        shapes += [(s.dims, BENCH_DTYPE[k], "holdout") for s in spec.shapes["cuda"].holdout]
        shapes += [(d, t, "model") for d, t in MODEL_SHAPES[k]]
        seen = set()
        for dims, dtype, kind in shapes:
            key = (tuple(dims.items()), dtype)
            if key in seen:
                continue
            seen.add(key)
            case = Case(k, dims, dtype, libs, fi, compiled_ops[k])
            errors = case.verify()
            us = time_case(case, args.reps, cold)
            peers = [us[n] for n in ("flashinfer", "torch.compile") if n in us]
            kopt = us.get("best", us["baseline"])
            row = {"kernel": k, "shape": ",".join(f"{a}={b}" for a, b in dims.items()), "dtype": dtype, "kind": kind,
                   "us": {n: round(v, 3) for n, v in us.items()}, "max_rel_error": errors,
                   "kopt_over_best_peer": round(min(peers) / kopt, 4) if peers else None}  # fmt: skip
            rows.append(row)
            print(f"{k:22} {row['shape']:20} {dtype:8} {kind:7} " + "  ".join(f"{n} {v:8.2f}" for n, v in us.items())
                  + f"  best peer / kopt {row['kopt_over_best_peer']}" + ("" if max(errors.values()) < 0.05 else
                  f"  MISMATCH {errors}"), flush=True)  # fmt: skip
    gpu = torch.cuda.get_device_name(0)
    version = (Path(args.include) / "VERSION").read_text().strip() if args.include else None
    result = {
        "device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "flashinfer": version,
        "command": " ".join(["python", "bench/peers.py", *sys.argv[1:]]), "reps": args.reps,
        "method": "one process, cold L2 (2x L2 zeroed before each call, then a GPU sleep), CUDA events, implementations interleaved, "
                  "median of reps; ratio = best peer time / kopt time (>1: kopt faster)",
        "bests": {k: {"report": plan[k]["report"], "tunables": (plan[k]["best"] or {}).get("tunables"),
                      "flags": (plan[k]["best"] or {}).get("flags")} for k in kernels},
        "rows": rows,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"peers-{gpu.lower().replace(' ', '-')}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    ratios = [r["kopt_over_best_peer"] for r in rows if r["kopt_over_best_peer"]]
    if ratios:
        print(f"best peer / kopt: geomean {math.exp(statistics.fmean(map(math.log, ratios))):.3f}, "
              f"worst {min(ratios):.3f}; within 2% or faster at {sum(r >= 0.98 for r in ratios)} of {len(ratios)}")
    print("wrote", path)
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("headers", help="copy the FlashInfer headers the wrapper needs out of its wheel")
    h.add_argument("wheel", type=Path)
    h.add_argument("dest", type=Path)
    r = sub.add_parser("run", help="time the implementations side by side (GPU)")
    r.add_argument("--include", help="what `headers` wrote (without it: no FlashInfer column)")
    r.add_argument("--kernels", default=",".join(KERNELS))
    r.add_argument("--best", action="append", default=[], metavar="KERNEL=REPORT.json",
                   help="a run's report.json whose best to time (default: newest bench/results/astra-report-KERNEL-*)")
    r.add_argument("--reps", type=int, default=100)
    r.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    if args.cmd == "headers":
        headers(args.wheel, args.dest)
    else:
        started = time.time()
        run(args)
        print(f"{time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
