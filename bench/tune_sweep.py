#!/usr/bin/env python3
"""Sweep the CUDA baselines' tuning space on one GPU: build, check, time (cold L2), compare.

One device call runs everything (docs/tuning-notes.md says why and what came out):
  1. nvcc builds every variant in parallel (the kopt compile command, kopt/build.py), while the main
     thread measures the copy bandwidth and compiles and times torch.compile's version of each op;
  2. per kernel, each variant is loaded with ctypes (the kopt C ABI), checked against the package's
     reference.py (test shapes incl. odd sizes, a padded-row or misaligned layout, both dtypes, NaN-
     poisoned outputs, bit-exact residual) and timed at the bench shapes: cold-L2 median (a 2x-L2
     buffer overwritten before each call, CUDA events, a sleep kernel ahead of each batch of 10 so
     host launch gaps never land inside the events);
  3. a compact table goes to stdout and everything to $OUT/tune_sweep-<set>.json (or --out).

Variants are `#define NAME VALUE` overrides of kernels/<kernel>/kernel.cu (tunables and the fixed
macros beside them) plus optional extra nvcc flags. Of kopt it imports only kopt.expr (standard
library only), so it runs on a device machine with torch and none of kopt's dependencies.

  python3 bench/tune_sweep.py --dry-run [--limit 3]     # here: compile a few variants only
  python3 bench/tune_sweep.py --compile-all             # here: every declared tunable combination
  /tmp/kv/bin/python bench/tune_sweep.py --cpu-check    # here: the checking logic, CPU baselines
  python3 bench/tune_sweep.py --set final               # on the GPU machine (sweep1, sweep2: the
                                                        # two measured runs, on the sources of their day)
  python3 bench/tune_sweep.py --set rmsnorm3 --kernels fused_add_rmsnorm   # GPU: rmsnorm's new paths
  compute-sanitizer --tool racecheck python3 bench/tune_sweep.py --set rmsnorm3 --kernels fused_add_rmsnorm \
      --check-only --only c3_t256,c4_t128_cl2               # GPU: correctness only, under a sanitizer
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kopt import expr as kopt_expr  # noqa: E402 - kernel.toml's safe evaluator; standard library only
KERNELS_DIR = ROOT / "kernels"
NVCC_BASE = ["-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",
             "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-O3"]
DEFINE = r"^[ \t]*#define[ \t]+{name}[ \t]+(-?\d+)\b"

ENTRY = {"silu_and_mul": "kopt_silu_and_mul", "fused_add_rmsnorm": "kopt_fused_add_rmsnorm",
         "merge_attn_states_lse": "kopt_merge_attn_states_lse"}
TIMED_DTYPE = {"silu_and_mul": "bfloat16", "fused_add_rmsnorm": "bfloat16", "merge_attn_states_lse": "float16"}
# Reference numbers of docs/measurement.md (H100, cold L2): FlashInfer and torch.compile, per bench shape.
FLASHINFER = {"silu_and_mul": [23.1, 127.5, 476.6], "fused_add_rmsnorm": [17.5, 96.1, 363.8],
              "merge_attn_states_lse": [12.1, 19.6, 140.3]}
TORCH_COMPILE_REF = {"silu_and_mul": [19.8, 120.5, 459.4], "fused_add_rmsnorm": [16.6, 93.7, 356.5],
                     "merge_attn_states_lse": [None, 21.5, 142.1]}


# ----------------------------------------------------------------------------- variant sets


def V(name: str, flags: list[str] | None = None, both: bool = False, **defs: int) -> dict:
    """A variant: `#define` overrides and extra nvcc flags; both=True also times the other dtype."""
    return {"name": name, "defs": defs, "flags": flags or [], "both": both}


def sweep1() -> dict[str, list[dict]]:
    """First call: a broad look at every dimension (tunables and the fixed macros)."""
    silu = [V("default")]
    for vec in (8, 16, 32):
        for th in (128, 256, 512, 1024):
            for bpr in (1, 2, 0):
                if (vec, th, bpr) != (8, 256, 1):
                    silu.append(V(f"v{vec}_t{th}_b{bpr}", VEC=vec, THREADS=th, BLOCKS_PER_ROW=bpr))
    silu += [V("v8_t256_b4", BLOCKS_PER_ROW=4), V("v8_t256_b8", BLOCKS_PER_ROW=8)]
    for vec, th, bpr in ((16, 256, 0), (32, 256, 0), (16, 512, 1), (32, 128, 0)):
        for lh, sh in ((0, 1), (2, 0), (2, 1), (3, 0), (3, 1), (4, 1)):
            silu.append(V(f"v{vec}_t{th}_b{bpr}_lh{lh}_sh{sh}", VEC=vec, THREADS=th, BLOCKS_PER_ROW=bpr,
                          LOAD_HINT=lh, STORE_HINT=sh))
    for vec, th, bpr in ((8, 256, 1), (16, 256, 0), (32, 256, 0), (16, 512, 1), (32, 128, 0), (16, 128, 0)):
        silu.append(V(f"v{vec}_t{th}_b{bpr}_fx", VEC=vec, THREADS=th, BLOCKS_PER_ROW=bpr, FAST_EXP=1))
    for vec, th, bpr in ((8, 256, 1), (16, 256, 0), (32, 256, 0)):
        silu.append(V(f"v{vec}_t{th}_b{bpr}_ufm", ["--use_fast_math"], VEC=vec, THREADS=th, BLOCKS_PER_ROW=bpr))
    for vec, th in ((16, 256), (32, 256), (16, 512)):
        for waves in (1, 2, 4):
            silu.append(V(f"v{vec}_t{th}_b0_w{waves}", VEC=vec, THREADS=th, BLOCKS_PER_ROW=0, GRID_WAVES=waves))

    rms = [V("default")]
    for cr in (0, 1, 2):
        for th in (128, 256, 512, 1024):
            if (cr, th) != (1, 256):
                rms.append(V(f"c{cr}_t{th}", CACHE_ROW=cr, THREADS=th))
    for th in (256, 512, 1024):
        for rpb in (2, 4):
            rms.append(V(f"c2_t{th}_r{rpb}", CACHE_ROW=2, THREADS=th, ROWS_PER_BLOCK=rpb))
    for th in (128, 256, 512):
        rms.append(V(f"c2_t{th}_we", CACHE_ROW=2, THREADS=th, W_EARLY=1))
    rms += [V("c2_t256_we_mb4", CACHE_ROW=2, THREADS=256, W_EARLY=1, MIN_BLOCKS=4),
            V("c2_t256_mb4", CACHE_ROW=2, THREADS=256, MIN_BLOCKS=4),
            V("c2_t128_mb8", CACHE_ROW=2, THREADS=128, MIN_BLOCKS=8)]
    for cr, th, waves in ((2, 256, 1), (2, 256, 2), (2, 512, 1), (2, 512, 2), (0, 512, 2), (1, 256, 2)):
        rms.append(V(f"c{cr}_t{th}_w{waves}", CACHE_ROW=cr, THREADS=th, GRID_WAVES=waves))
    for cr, th in ((2, 256), (2, 512), (1, 256), (0, 512)):
        for lh, sh in ((1, 0), (2, 0), (0, 1), (1, 1), (2, 1)):
            rms.append(V(f"c{cr}_t{th}_lh{lh}_sh{sh}", CACHE_ROW=cr, THREADS=th, LOAD_HINT=lh, STORE_HINT=sh))

    merge = [V("default")]
    for mode in (0, 1):
        for th in (64, 128, 256, 512):
            for ppt in (1, 2, 4):
                if (mode, th, ppt) != (0, 128, 2):
                    merge.append(V(f"m{mode}_t{th}_p{ppt}", LSE_MODE=mode, THREADS=th, PACKS_PER_THREAD=ppt))
    merge += [V("m1_t128_p8", LSE_MODE=1, THREADS=128, PACKS_PER_THREAD=8),
              V("m1_t256_p8", LSE_MODE=1, THREADS=256, PACKS_PER_THREAD=8)]
    for th, ppt in ((128, 2), (256, 4), (512, 1)):
        for waves in (1, 2, 4):
            merge.append(V(f"m1_t{th}_p{ppt}_w{waves}", LSE_MODE=1, THREADS=th, PACKS_PER_THREAD=ppt, GRID_WAVES=waves))
    for mode, th, ppt in ((0, 128, 2), (1, 128, 2), (1, 256, 2), (1, 256, 4)):
        merge.append(V(f"m{mode}_t{th}_p{ppt}_fx", LSE_MODE=mode, THREADS=th, PACKS_PER_THREAD=ppt, FAST_EXP=1))
    for mode, th, ppt in ((1, 128, 2), (1, 256, 4), (1, 512, 1)):
        for lh, sh in ((1, 0), (2, 0), (0, 1), (1, 1), (2, 1)):
            merge.append(V(f"m{mode}_t{th}_p{ppt}_lh{lh}_sh{sh}", LSE_MODE=mode, THREADS=th, PACKS_PER_THREAD=ppt,
                           LOAD_HINT=lh, STORE_HINT=sh))
    return {"silu_and_mul": silu, "fused_add_rmsnorm": rms, "merge_attn_states_lse": merge}


def sweep2() -> dict[str, list[dict]]:
    """Second call: the reworked sources (flat-mode and size-dispatched hints, residual stored early,
    per-thread LSE with one pack), the candidate search paths in both dtypes, and what is left open."""
    silu = [V("default", both=True)]
    # Flat mode (BLOCKS_PER_ROW 0) with the small-problem load hint candidates; the path steps.
    for slh in (0, 2, 3, 5):
        for vec, th in ((8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (8, 128)):
            both = slh == 2 and (vec, th) in ((8, 256), (16, 256), (8, 512), (8, 1024), (16, 512))
            silu.append(V(f"v{vec}_t{th}_b0_s{slh}", both=both, VEC=vec, THREADS=th, BLOCKS_PER_ROW=0,
                          SMALL_LOAD_HINT=slh))
    for slh in (0, 2):
        silu.append(V(f"v8_t256_b0_s{slh}_ss1", VEC=8, THREADS=256, BLOCKS_PER_ROW=0, SMALL_LOAD_HINT=slh,
                      SMALL_STORE_HINT=1))
        for vec, th in ((8, 256), (16, 256), (8, 1024)):
            silu.append(V(f"v{vec}_t{th}_b0_s{slh}_ufm", ["--use_fast_math"], both=slh == 2, VEC=vec, THREADS=th,
                          BLOCKS_PER_ROW=0, SMALL_LOAD_HINT=slh))
    for lh, sh in ((6, 0), (5, 0), (0, 1)):
        silu.append(V(f"v8_t256_b0_s2_l{lh}_st{sh}", VEC=8, THREADS=256, BLOCKS_PER_ROW=0, SMALL_LOAD_HINT=2,
                      LOAD_HINT=lh, STORE_HINT=sh))
    # Neighbours of the default along the other dimensions (the first rounds of the search).
    for name, defs in (("v16_t256_b1", dict(VEC=16)), ("v8_t512_b1", dict(THREADS=512)),
                       ("v8_t256_b2", dict(BLOCKS_PER_ROW=2))):
        silu.append(V(name, **defs))
    silu.append(V("v8_t256_b1_ufm", ["--use_fast_math"]))

    rms = [V("default", both=True)]
    hints = {"h0": {}, "h31": dict(SMALL_LOAD_HINT=3, SMALL_STORE_HINT=1),
             "h21": dict(SMALL_LOAD_HINT=2, SMALL_STORE_HINT=1), "h20": dict(SMALL_LOAD_HINT=2),
             "h50": dict(SMALL_LOAD_HINT=5), "h01": dict(SMALL_STORE_HINT=1)}
    for hn, h in hints.items():
        for re_ in (0, 1):
            if (hn, re_) != ("h0", 0):
                rms.append(V(f"c1_t256_re{re_}_{hn}", both=hn in ("h0", "h31") and re_ == 1, RES_EARLY=re_, **h))
    for th in (128, 256, 512):
        for re_ in (0, 1):
            for we in (0, 1):
                for hn in ("h0", "h31", "h20"):
                    both = th == 256 and we == 0 and hn in ("h0", "h31")
                    rms.append(V(f"c2_t{th}_re{re_}_we{we}_{hn}", both=both, CACHE_ROW=2, THREADS=th, RES_EARLY=re_,
                                 W_EARLY=we, **hints[hn]))
    rms.append(V("c2_t1024_re1_h0", CACHE_ROW=2, THREADS=1024, RES_EARLY=1))
    rms.append(V("c2_t256_re1_we1_mb4_h31", CACHE_ROW=2, THREADS=256, RES_EARLY=1, W_EARLY=1, MIN_BLOCKS=4,
                 **hints["h31"]))
    for th in (256, 512):
        for frh in (0, 6):
            for lh in (0, 5):
                rms.append(V(f"c0_t{th}_fr{frh}_l{lh}_h01", CACHE_ROW=0, THREADS=th, FIRST_READ_HINT=frh, LOAD_HINT=lh,
                             SMALL_STORE_HINT=1))
    for lh, sh in ((5, 0), (6, 0), (2, 0), (0, 1), (5, 1)):
        rms.append(V(f"c2_t256_re1_h31_l{lh}_st{sh}", CACHE_ROW=2, THREADS=256, RES_EARLY=1, LOAD_HINT=lh,
                     STORE_HINT=sh, **hints["h31"]))
        rms.append(V(f"c1_t256_re1_h31_l{lh}_st{sh}", CACHE_ROW=1, THREADS=256, RES_EARLY=1, LOAD_HINT=lh,
                     STORE_HINT=sh, **hints["h31"]))
    # Neighbours of the default (first rounds of the search).
    for name, defs in (("c1_t512", dict(THREADS=512)), ("c1_t128", dict(THREADS=128)), ("c2_t256", dict(CACHE_ROW=2)),
                       ("c0_t256", dict(CACHE_ROW=0)), ("c1_t256_r2", dict(ROWS_PER_BLOCK=2))):
        rms.append(V(name, **defs))

    merge = [V("default", both=True)]
    mh = {"h0": {}, "h20": dict(SMALL_LOAD_HINT=2), "h21": dict(SMALL_LOAD_HINT=2, SMALL_STORE_HINT=1),
          "h30": dict(SMALL_LOAD_HINT=3), "h50": dict(SMALL_LOAD_HINT=5)}
    for th in (64, 128, 256, 512):
        for hn, h in mh.items():
            for st in (0, 1):
                both = th in (128, 256) and hn in ("h0", "h20") and st == 0
                merge.append(V(f"m1_t{th}_{hn}_st{st}", both=both, LSE_MODE=1, THREADS=th, STORE_HINT=st, **h))
    for th, ppt in ((128, 2), (256, 2), (128, 4), (64, 2)):
        merge.append(V(f"m2_t{th}_p{ppt}_h20", LSE_MODE=2, THREADS=th, PACKS_PER_THREAD=ppt, SMALL_LOAD_HINT=2))
    merge.append(V("m1_t128_h20_fx", LSE_MODE=1, THREADS=128, SMALL_LOAD_HINT=2, FAST_EXP=1))
    merge.append(V("m1_t128_h20_l6", LSE_MODE=1, THREADS=128, SMALL_LOAD_HINT=2, LOAD_HINT=6))
    for name, defs in (("m0_t256_p2", dict(THREADS=256)), ("m0_t128_p1", dict(PACKS_PER_THREAD=1)),
                       ("m0_t128_p4", dict(PACKS_PER_THREAD=4)), ("m0_t64_p2", dict(THREADS=64))):
        merge.append(V(name, **defs))
    return {"silu_and_mul": silu, "fused_add_rmsnorm": rms, "merge_attn_states_lse": merge}


def final() -> dict[str, list[dict]]:
    """The committed sources as they stand: each default, the search's first step (the fast
    configuration) and its next neighbours, both dtypes for the first two. sweep1 and sweep2 ran
    against the sources of their day (their JSON holds each build's source hash): since then the
    fixed hint macros of silu and merge default to SMALL_LOAD_HINT 2 / LOAD_HINT 6, and rmsnorm's
    CACHE_ROW 2 always stores the residual and loads the weight early."""
    silu = [V("default", both=True), V("flat", both=True, BLOCKS_PER_ROW=0),
            V("flat_v16", BLOCKS_PER_ROW=0, VEC=16), V("flat_t512", BLOCKS_PER_ROW=0, THREADS=512),
            V("flat_ufm", ["--use_fast_math"], BLOCKS_PER_ROW=0)]
    rms = [V("default", both=True), V("regs", both=True, CACHE_ROW=2),
           V("regs_t512", CACHE_ROW=2, THREADS=512), V("regs_r2", CACHE_ROW=2, ROWS_PER_BLOCK=2),
           V("regs_v4", CACHE_ROW=2, VEC=4)]
    merge = [V("default", both=True), V("per_thread", both=True, LSE_MODE=1),
             V("per_thread_t256", LSE_MODE=1, THREADS=256), V("per_thread_v4", LSE_MODE=1, VEC=4),
             V("per_thread_p4", LSE_MODE=2, PACKS_PER_THREAD=4)]
    return {"silu_and_mul": silu, "fused_add_rmsnorm": rms, "merge_attn_states_lse": merge}


def rmsnorm3() -> dict[str, list[dict]]:
    """fused_add_rmsnorm only (issue 5, not yet measured): the new paths of kernel.cu against the
    default and the current best (CACHE_ROW 2, 256 threads). CACHE_ROW 4 = mode 2 on the new kernel
    (16-byte weight loads; mode 2's compile to byte loads); CACHE_ROW 3 = persistent, the next row's
    loads in flight across this row's barrier (PIPE_DEPTH 2), weight loaded once, optional L2 bulk
    prefetch (PIPE_PREFETCH) and k rows per block (PIPE_ROWS); CLUSTER 2 / 4 = the row split over a
    thread block cluster (CLUSTER_XCHG 1: st.async + mbarrier, 0: cluster barrier + DSMEM loads).
    MIN_BLOCKS 4 (8 at 128 threads) keeps 4 blocks of 256 per SM (<= 64 registers) where ptxas
    would take a few more. The names say: c<CACHE_ROW>_t<THREADS>[_cl<CLUSTER>][_x0][_d1]
    [_pf<PIPE_PREFETCH>][_r<PIPE_ROWS>][_w2][_mb<MIN_BLOCKS>]."""
    rms = [V("default", both=True), V("c2_t256", both=True, CACHE_ROW=2), V("c2_t512", CACHE_ROW=2, THREADS=512),
           V("c2_t256_mb4", CACHE_ROW=2, MIN_BLOCKS=4)]
    # Mode 4: mode 2 with vector weight loads; with clusters.
    rms += [V("c4_t256", both=True, CACHE_ROW=4), V("c4_t256_mb4", CACHE_ROW=4, MIN_BLOCKS=4),
            V("c4_t512", CACHE_ROW=4, THREADS=512), V("c4_t128", CACHE_ROW=4, THREADS=128),
            V("c4_t256_h31", CACHE_ROW=4, SMALL_LOAD_HINT=3, SMALL_STORE_HINT=1),
            V("c4_t256_cl2", CACHE_ROW=4, CLUSTER=2), V("c4_t256_cl2_x0", CACHE_ROW=4, CLUSTER=2, CLUSTER_XCHG=0),
            V("c4_t128_cl2", CACHE_ROW=4, THREADS=128, CLUSTER=2),
            V("c4_t128_cl2_mb8", CACHE_ROW=4, THREADS=128, CLUSTER=2, MIN_BLOCKS=8),
            V("c4_t256_cl4", CACHE_ROW=4, CLUSTER=4), V("c4_t128_cl4", CACHE_ROW=4, THREADS=128, CLUSTER=4),
            V("c4_t128_cl4_x0", CACHE_ROW=4, THREADS=128, CLUSTER=4, CLUSTER_XCHG=0),
            V("c4_t512_cl2", CACHE_ROW=4, THREADS=512, CLUSTER=2)]
    # Mode 3: persistent (one wave), two rows in registers (PIPE_DEPTH 2) unless _d1.
    rms += [V("c3_t256", both=True, CACHE_ROW=3), V("c3_t512", CACHE_ROW=3, THREADS=512),
            V("c3_t1024", CACHE_ROW=3, THREADS=1024), V("c3_t256_w2", CACHE_ROW=3, PIPE_WEIGHT=2),
            V("c3_t256_pf2", CACHE_ROW=3, PIPE_PREFETCH=2), V("c3_t256_pf4", CACHE_ROW=3, PIPE_PREFETCH=4),
            V("c3_t512_pf2", CACHE_ROW=3, THREADS=512, PIPE_PREFETCH=2),
            V("c3_t256_d1_mb4", CACHE_ROW=3, PIPE_DEPTH=1, MIN_BLOCKS=4),
            V("c3_t256_d1_pf1_mb4", CACHE_ROW=3, PIPE_DEPTH=1, PIPE_PREFETCH=1, MIN_BLOCKS=4),
            V("c3_t256_d1_pf2_mb4", CACHE_ROW=3, PIPE_DEPTH=1, PIPE_PREFETCH=2, MIN_BLOCKS=4),
            V("c3_t256_d1_pf4_mb4", CACHE_ROW=3, PIPE_DEPTH=1, PIPE_PREFETCH=4, MIN_BLOCKS=4),
            V("c3_t256_r4", CACHE_ROW=3, PIPE_ROWS=4), V("c3_t256_r8", CACHE_ROW=3, PIPE_ROWS=8),
            V("c3_t512_r4", CACHE_ROW=3, THREADS=512, PIPE_ROWS=4),
            V("c3_t256_d1_r4_mb4", CACHE_ROW=3, PIPE_DEPTH=1, PIPE_ROWS=4, MIN_BLOCKS=4),
            V("c3_t256_cl2", CACHE_ROW=3, CLUSTER=2), V("c3_t256_cl2_x0", CACHE_ROW=3, CLUSTER=2, CLUSTER_XCHG=0),
            V("c3_t128_cl2", CACHE_ROW=3, THREADS=128, CLUSTER=2),
            V("c3_t256_cl2_pf2", CACHE_ROW=3, CLUSTER=2, PIPE_PREFETCH=2),
            V("c3_t128_cl4", CACHE_ROW=3, THREADS=128, CLUSTER=4),
            V("c3_t512_cl2", CACHE_ROW=3, THREADS=512, CLUSTER=2)]
    rms.append(V("c4_t256_cl2_mb6", CACHE_ROW=4, CLUSTER=2, MIN_BLOCKS=6))
    # The two controls again at the end (an unused -D makes a separate build): drift within the run.
    rms += [V("c2_t256_again", ["-DKOPT_SWEEP_AGAIN=1"], CACHE_ROW=2),
            V("c4_t256_again", ["-DKOPT_SWEEP_AGAIN=1"], CACHE_ROW=4)]
    return {"fused_add_rmsnorm": rms}


SETS = {"sweep1": sweep1, "sweep2": sweep2, "final": final, "rmsnorm3": rmsnorm3}


# ----------------------------------------------------------------------------- building


def apply_defs(source: str, defs: dict[str, int]) -> str:
    for name, value in defs.items():
        pattern = re.compile(DEFINE.format(name=re.escape(name)), flags=re.M)
        source, count = pattern.subn(lambda m, v=value: m.group(0).replace(m.group(1), str(v)), source)
        if count != 1:
            raise ValueError(f"#define {name}: expected one line, found {count}")
    return source


def find_nvcc() -> str:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("nvcc not found")


def build(nvcc: str, kernel: str, variant: dict, build_dir: Path) -> dict:
    source = apply_defs((KERNELS_DIR / kernel / "kernel.cu").read_text(), variant["defs"])
    key = hashlib.sha256((source + "\0" + " ".join(variant["flags"])).encode()).hexdigest()[:16]
    work = build_dir / kernel / key
    work.mkdir(parents=True, exist_ok=True)
    src, lib = work / "kernel.cu", work / "kernel.so"
    src.write_text(source)
    cmd = [nvcc, *NVCC_BASE, *variant["flags"], f"-I{KERNELS_DIR}", "-o", str(lib), str(src)]
    t0 = time.monotonic()
    if lib.exists():
        proc, log = None, (work / "log.txt").read_text() if (work / "log.txt").exists() else ""
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        log = proc.stdout + proc.stderr
        (work / "log.txt").write_text(log)
    ok = lib.exists() and (proc is None or proc.returncode == 0)
    regs = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            regs[current] = int(m.group(1))
    spills = sorted({int(x) for x in re.findall(r"(\d+) bytes spill stores", log)})
    sass = {}
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None and Path("/usr/local/cuda/bin/cuobjdump").exists():
        cuobjdump = "/usr/local/cuda/bin/cuobjdump"
    if ok and cuobjdump:
        try:
            text = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, timeout=60).stdout
            for op in re.findall(r"\b((?:LDG|STG|LDL|STL)[.A-Z0-9_]*)", text):
                sass[op] = sass.get(op, 0) + 1
        except Exception:  # noqa: BLE001
            pass
    warnings = [ln for ln in log.splitlines() if "warning" in ln.lower()]
    return {"lib": str(lib), "ok": ok, "seconds": round(time.monotonic() - t0, 2), "key": key,
            "max_regs": max(regs.values()) if regs else None, "regs": regs, "spill_stores": spills,
            "warnings": warnings[:5], "sass_mem_ops": sass, "log": log[-2000:] if not ok else ""}


# ----------------------------------------------------------------------------- GPU side


def load_reference(kernel: str):
    spec = importlib.util.spec_from_file_location(f"ref_{kernel}", KERNELS_DIR / kernel / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def package(kernel: str) -> dict:
    return tomllib.loads((KERNELS_DIR / kernel / "kernel.toml").read_text())


class Abi:
    """kopt_tensor of kernels/kopt_abi.h and one library's entry point."""

    class T(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64))]

    def __init__(self, lib: str, entry: str, torch) -> None:
        self.torch = torch
        self.codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
        self.lib = ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        fn = getattr(self.lib, entry)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(Abi.T), ctypes.c_int32, ctypes.c_void_p]
        self.fn = fn

    def pack(self, tensors) -> tuple:
        arr = (Abi.T * len(tensors))()
        keep = []
        for i, t in enumerate(tensors):
            shape = (ctypes.c_int64 * t.dim())(*t.shape)
            strides = (ctypes.c_int64 * t.dim())(*t.stride())
            keep += [shape, strides]
            arr[i] = Abi.T(t.data_ptr(), self.codes[t.dtype], t.dim(), shape, strides)
        return arr, len(tensors), keep

    def __call__(self, packed, stream: int) -> int:
        return self.fn(packed[0], packed[1], ctypes.c_void_p(stream))


def arg_order(kernel: str) -> list[tuple[str, str]]:
    return [(a["name"], a["role"]) for a in package(kernel)["arguments"]]


def out_shapes(kernel: str, dims: dict, inputs: dict) -> dict:
    if kernel == "silu_and_mul":
        return {"out": (dims["T"], dims["D"])}
    if kernel == "merge_attn_states_lse":
        return {"v_out": (dims["T"], dims["NH"], dims["D"]), "s_out": (dims["T"], dims["NH"])}
    return {}


class Cases:
    """Correctness cases of one kernel: inputs from reference.make_inputs and the float32 reference,
    computed once (CPU) and kept on the GPU; each variant gets fresh NaN-poisoned buffers per case.
    layout: 'dense'; 'padded' (row stride + 8 elements: rows stay dense and 16-byte aligned; silu and
    rmsnorm only); 'shifted' (every 16-bit tensor one element off its 16-byte alignment: the scalar
    paths)."""

    def __init__(self, torch, kernel: str, ref, specs: list[tuple[dict, str, str]], device: str = "cuda") -> None:
        self.torch, self.kernel, self.device = torch, kernel, device
        self.items = []
        dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
        for ci, (dims, dname, layout) in enumerate(specs):
            dt = dtypes[dname]
            pristine = ref.make_inputs(dims, dt, 17 + ci, "cpu")
            want = ref.reference({k: v.clone() for k, v in pristine.items()})
            want = {k: v.to(device) for k, v in want.items()}
            pristine = {k: v.to(device) for k, v in pristine.items()}
            self.items.append((dims, dname, layout, pristine, want))

    def place(self, t, layout: str):
        torch = self.torch
        if layout == "padded" and t.dim() == 2 and self.kernel != "merge_attn_states_lse":
            buf = torch.full((t.shape[0], t.shape[1] + 8), float("nan"), dtype=t.dtype, device=self.device)
            view = buf[:, : t.shape[1]]
            view.copy_(t)
            return view
        if layout == "shifted" and t.dtype != torch.float32:
            buf = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=self.device)
            view = buf[1:].view(t.shape)
            view.copy_(t)
            return view
        return t.clone()

    def tensors(self, i: int) -> dict:
        torch = self.torch
        dims, dname, layout, pristine, want = self.items[i]
        tensors = {name: self.place(t, layout) for name, t in pristine.items()}
        for name, shape in out_shapes(self.kernel, dims, pristine).items():
            dt = torch.float32 if name == "s_out" else pristine[next(iter(pristine))].dtype
            tensors[name] = self.place(torch.full(shape, float("nan"), dtype=dt, device=self.device), layout)
        return tensors


def check(torch, kernel: str, tensors: dict, pristine: dict, want: dict, tol: dict) -> tuple[str | None, float]:
    """First failure or None, and the max |err| over all outputs (all on the GPU)."""
    max_err = 0.0
    for name, ref_t in want.items():
        raw = tensors[name]
        got = raw.float()
        ref_t = ref_t.float()
        if raw.dtype in (torch.float16, torch.bfloat16):
            stored = ref_t.to(raw.dtype).float()
            ref_t = torch.where(torch.isinf(stored) & torch.isfinite(ref_t), stored, ref_t)
        finite = torch.isfinite(ref_t)
        if bool((~torch.isfinite(got) & finite).any()):
            return f"{name}: NaN/Inf (unwritten?) where the reference is finite", max_err
        if bool((~finite & ~((torch.isnan(got) & torch.isnan(ref_t)) | (got == ref_t))).any()):
            return f"{name}: special values differ", max_err
        diff = torch.where(finite, (got - ref_t).abs(), torch.zeros_like(ref_t))
        if diff.numel():
            max_err = max(max_err, float(diff.max()))
        if kernel == "fused_add_rmsnorm" and name == "residual":
            exact = want[name].to(raw.dtype).contiguous().view(torch.int16)
            if not torch.equal(raw.contiguous().view(torch.int16), exact):
                return "residual: not bit-exact", max_err
            continue
        bad = diff > tol["atol"] + tol["rtol"] * torch.where(finite, ref_t.abs(), torch.zeros_like(ref_t))
        if bool(bad.any()):
            return f"{name}: {int(bad.sum())} elements out of tolerance (max |err| {float(diff.max()):.3g})", max_err
    ints = {2: torch.int16, 4: torch.int32}
    for name, t in pristine.items():  # inputs that are not in-place must be unchanged, bit for bit
        if name in want:
            continue
        now = tensors[name].contiguous().view(ints[t.element_size()])
        if not torch.equal(now, t.contiguous().view(ints[t.element_size()])):
            return f"{name}: input modified", max_err
    return None, max_err


def test_specs(kernel: str, test_shapes: list[dict]) -> list[tuple[dict, str, str]]:
    """The correctness cases: every test shape x both dtypes dense, plus the largest test shape
    shifted (scalar paths) and, where rows may be strided, padded rows (largest and odd shapes)."""
    specs = [(dims, dname, "dense") for dims in test_shapes for dname in ("float16", "bfloat16")]
    # One call larger than the L2 (50 MiB on an H100): the paths that size-dispatched hints take.
    big = {"silu_and_mul": {"T": 1024, "D": 14336}, "fused_add_rmsnorm": {"T": 2048, "H": 8192},
           "merge_attn_states_lse": {"T": 4096, "NH": 32, "D": 128}}
    if kernel in big and max(max(d.values()) for d in test_shapes) > 600:  # not in --cpu-check
        specs.append((big[kernel], "bfloat16", "dense"))
    for dname in ("float16", "bfloat16"):
        specs.append((test_shapes[-1], dname, "shifted"))
        if kernel != "merge_attn_states_lse":
            specs.append((test_shapes[-1], dname, "padded"))
            specs.append((test_shapes[3], dname, "padded"))
    return specs


def run_cases(torch, kernel: str, abi, cases, tols: dict, stream) -> tuple[str | None, dict]:
    fail, errs = None, {}
    for ci, (dims, dname, layout, pristine, want) in enumerate(cases.items):
        tensors = cases.tensors(ci)  # fresh, NaN-poisoned; the candidate runs first
        order = [tensors[n] for n, _ in arg_order(kernel)]
        rc = abi(abi.pack(order), stream)
        if cases.device == "cuda":
            torch.cuda.synchronize()
        if rc != 0:
            return f"{dims} {dname} {layout}: rc {rc}", errs
        msg, err = check(torch, kernel, tensors, pristine, want, tols[dname])
        errs[f"{dims}|{dname}|{layout}"] = err
        if msg:
            return f"{dims} {dname} {layout}: {msg}", errs
    return fail, errs


class Timer:
    """Cold-L2 event timing: flush (2x L2), start event, call, end event; a sleep kernel ahead of
    each batch of 10 keeps the host ahead of the device."""

    def __init__(self, torch) -> None:
        self.torch = torch
        props = torch.cuda.get_device_properties(0)
        self.l2 = props.L2_cache_size
        self.flush_buf = torch.empty(2 * self.l2, dtype=torch.uint8, device="cuda")
        self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]

    def run(self, call, samples: int, warmup: int = 10, sleep_cycles: int = 2_000_000) -> dict:
        torch = self.torch
        for _ in range(warmup):
            call(0)
        torch.cuda.synchronize()
        times = []
        stream = torch.cuda.current_stream()
        i = 0
        while len(times) < samples:
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            for k in range(10):
                self.flush_buf.zero_()
                self.events[k][0].record(stream)
                call(i)
                self.events[k][1].record(stream)
                i += 1
            self.events[9][1].synchronize()
            times += [s.elapsed_time(e) * 1e3 for s, e in self.events]
        times.sort()
        q = lambda p: times[min(len(times) - 1, int(p * (len(times) - 1) + 0.5))]  # noqa: E731
        return {"median_us": round(statistics.median(times), 3), "p10_us": round(q(0.1), 3),
                "p90_us": round(q(0.9), 3), "n": len(times)}


def model_bytes(kernel: str, dims: dict, elem: int) -> int:
    expr = package(kernel)["model"]["bytes"]
    return int(kopt_expr.evaluate(expr, {**dims, "elem": elem}))


def bench_inputs(torch, kernel: str, dims: dict, dtype, sets: int) -> list[list]:
    """Timing inputs, generated on the GPU (random, never zeros), in ABI order; `sets` rotating copies."""
    out = []
    for s in range(sets):
        g = torch.Generator(device="cuda").manual_seed(1000 + s)
        if kernel == "silu_and_mul":
            x = torch.randn((dims["T"], 2 * dims["D"]), generator=g, device="cuda").mul_(2).to(dtype)
            out.append([x, torch.empty((dims["T"], dims["D"]), dtype=dtype, device="cuda")])
        elif kernel == "fused_add_rmsnorm":
            t, h = dims["T"], dims["H"]
            x = torch.randn((t, h), generator=g, device="cuda", dtype=torch.float32).to(dtype)
            r = torch.randn((t, h), generator=g, device="cuda", dtype=torch.float32).mul_(4).to(dtype)
            w = (1 + 0.5 * torch.randn(h, generator=g, device="cuda")).to(dtype)
            out.append([x, r, w])
        else:
            t, nh, d = dims["T"], dims["NH"], dims["D"]
            va = torch.randn((t, nh, d), generator=g, device="cuda").to(dtype)
            vb = torch.randn((t, nh, d), generator=g, device="cuda").to(dtype)
            sa = torch.randn((t, nh), generator=g, device="cuda") * 2 + 5
            sb = torch.randn((t, nh), generator=g, device="cuda") * 2 + 5
            out.append([va, sa, vb, sb, torch.empty_like(va), torch.empty_like(sa)])
        del g
    return out


def eager_fn(kernel: str, torch):
    F = torch.nn.functional
    if kernel == "silu_and_mul":
        def f(x):
            d = x.shape[-1] // 2
            return F.silu(x[..., :d]) * x[..., d:]
        return f
    if kernel == "fused_add_rmsnorm":
        def f(x, r, w):
            s = x.float() + r.float()
            out = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * w.float()
            return out.to(x.dtype), s.to(x.dtype)
        return f

    def f(v_a, s_a, v_b, s_b):
        inf = float("inf")
        a = torch.where(s_a == inf, -inf, s_a)
        b = torch.where(s_b == inf, -inf, s_b)
        m = torch.maximum(a, b)
        empty = m == -inf
        m = torch.where(empty, torch.zeros_like(m), m)
        wa, wb = torch.exp(a - m), torch.exp(b - m)
        total = wa + wb
        merged = (v_a.float() * wa[..., None] + v_b.float() * wb[..., None]) / total[..., None]
        v_out = torch.where(empty[..., None], v_a.float(), merged).to(v_a.dtype)
        s_out = torch.where(empty, torch.full_like(m, -inf), torch.log(total) + m)
        return v_out, s_out
    return f


def compile_args(kernel: str, inputs: list) -> list:
    return inputs[:1] if kernel == "silu_and_mul" else inputs[:3] if kernel == "fused_add_rmsnorm" else inputs[:4]


def cpu_check(kernels: list[str]) -> int:
    """Exercise the correctness machinery and the eager expressions on the CPU."""
    import torch

    bad = 0
    tmp = Path(tempfile.mkdtemp(prefix="tune-sweep-cpu-"))
    for kernel in kernels:
        pkg = package(kernel)
        ref = load_reference(kernel)
        lib = tmp / f"{kernel}.so"
        subprocess.run(["g++", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-O2", f"-I{KERNELS_DIR}",
                        "-o", str(lib), str(KERNELS_DIR / kernel / "kernel.cpp")], check=True)
        shapes = [{k: min(v, 600) for k, v in d.items()} for d in pkg["shapes"]["cuda"]["test"]]
        cases = Cases(torch, kernel, ref, test_specs(kernel, shapes), device="cpu")
        abi = Abi(str(lib), ENTRY[kernel], torch)
        fail, errs = run_cases(torch, kernel, abi, cases, pkg["tolerances"], None)
        print(f"{kernel}: cpu baseline {'OK' if fail is None else 'FAIL ' + fail}; {len(errs)} cases, "
              f"max err {max(errs.values()):.3g}")
        bad += fail is not None
        # A broken kernel must be caught: poison one output element after the call.
        class Broken:
            def __init__(self, inner):
                self.inner = inner

            def pack(self, tensors):
                self.last = tensors
                return self.inner.pack(tensors)

            def __call__(self, packed, stream):
                rc = self.inner(packed, stream)
                out = self.last[1] if kernel != "merge_attn_states_lse" else self.last[4]
                out.view(-1)[out.numel() // 2] += 1.0
                return rc
        fail2, _ = run_cases(torch, kernel, Broken(abi), cases, pkg["tolerances"], None)
        print(f"{kernel}: broken variant caught: {fail2}")
        bad += fail2 is None
        # The eager torch.compile expressions compute the reference's function.
        fn = eager_fn(kernel, torch)
        dims, dname, layout, pristine, want = cases.items[-5]
        outs = fn(*compile_args(kernel, [pristine[n] for n, r in arg_order(kernel) if n in pristine]))
        outs = outs if isinstance(outs, tuple) else (outs,)
        names = [n for n, r in arg_order(kernel) if r != "in"]
        for name, o in zip(names, outs):
            w = want[name].float()
            finite = torch.isfinite(w)
            same_special = bool(((o.float() == w) | finite).all())
            err = float(torch.where(finite, (o.float() - w).abs(), torch.zeros_like(w)).max())
            print(f"{kernel}: eager expression {name} max err {err:.3g}, specials match {same_special}")
            bad += not same_special or err > 0.05
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="sweep1", choices=sorted(SETS))
    ap.add_argument("--kernels", default=",".join(ENTRY))
    ap.add_argument("--dry-run", action="store_true", help="compile only (no GPU)")
    ap.add_argument("--cpu-check", action="store_true",
                    help="no GPU: run the correctness cases through the CPU baselines (kernel.cpp), and the "
                         "torch.compile expressions eagerly against reference.py (checks this script)")
    ap.add_argument("--compile-all", action="store_true",
                    help="no GPU: compile every combination of the declared CUDA tunables (kernel.toml)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many variants per kernel")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "kopt-tune-sweep"))
    ap.add_argument("--samples", type=int, default=150)
    ap.add_argument("--deadline-s", type=float, default=440.0, help="stop timing new variants after this")
    ap.add_argument("--compile-deadline-s", type=float, default=150.0, help="no torch.compile after this")
    ap.add_argument("--no-compile-ref", action="store_true", help="skip torch.compile")
    ap.add_argument("--only", default="", help="comma-separated variant names: run just these of the set")
    ap.add_argument("--check-only", action="store_true",
                    help="GPU: build and run the correctness cases only, no timing (e.g. under compute-sanitizer)")
    args = ap.parse_args()
    t_start = time.monotonic()
    kernels = [k for k in args.kernels.split(",") if k]
    variants = {k: v for k, v in SETS[args.set]().items() if k in kernels}
    if not (args.cpu_check or args.compile_all):  # a set may cover only some kernels (rmsnorm3)
        kernels = [k for k in kernels if k in variants]
    if args.limit:
        variants = {k: v[: args.limit] for k, v in variants.items()}
    if args.only:
        only = set(args.only.split(","))
        variants = {k: [v for v in vs if v["name"] in only] for k, vs in variants.items()}
    if args.cpu_check:
        return cpu_check(kernels)
    if args.compile_all:  # every combination of the declared CUDA tunables (kernel.toml), compile only
        variants = {}
        for k in kernels:
            tun = [t for t in package(k).get("tunables", []) if t["target"] == "cuda"]
            combos = itertools.product(*[t["values"] for t in tun])
            variants[k] = [V("_".join(f"{t['name']}{v}" for t, v in zip(tun, c)),
                             **{t["name"]: v for t, v in zip(tun, c)}) for c in combos]
        args.dry_run = True
    nvcc = find_nvcc()
    build_dir = Path(args.build_dir)
    pool = cf.ThreadPoolExecutor(max_workers=args.jobs)
    futures = {(k, v["name"]): pool.submit(build, nvcc, k, v, build_dir) for k in kernels for v in variants[k]}
    print(f"building {len(futures)} variants with {args.jobs} jobs", flush=True)
    if args.dry_run:
        bad = 0
        for (k, name), fut in futures.items():
            r = fut.result()
            bad += not r["ok"]
            print(f"{k:24s} {name:28s} ok={r['ok']} {r['seconds']:5.1f}s regs={r['max_regs']} "
                  f"spills={r['spill_stores']} warn={len(r['warnings'])}" + ("\n" + r["log"] if not r["ok"] else ""))
        warned = sum(bool(f.result()["warnings"]) for f in futures.values())
        print(f"built {len(futures)}: {bad} failed, {warned} with compiler warnings")
        return 1 if bad or warned else 0

    import torch

    if args.check_only:  # correctness cases only, one variant after another (sanitizer runs)
        bad = 0
        stream = torch.cuda.current_stream().cuda_stream
        for kernel in kernels:
            pkg = package(kernel)
            cases = Cases(torch, kernel, load_reference(kernel), test_specs(kernel, pkg["shapes"]["cuda"]["test"]))
            for v in variants[kernel]:
                b = futures[(kernel, v["name"])].result()
                if not b["ok"]:
                    print(f"{kernel} {v['name']}: BUILD FAILED", flush=True)
                    bad += 1
                    continue
                fail, errs = run_cases(torch, kernel, Abi(b["lib"], ENTRY[kernel], torch), cases, pkg["tolerances"], stream)
                bad += fail is not None
                print(f"{kernel:22s} {v['name']:26s} {'OK' if fail is None else 'FAIL ' + fail}  {len(errs)} cases, "
                      f"max err {max(errs.values(), default=0):.3g}  regs={b['max_regs']}", flush=True)
        return 1 if bad else 0

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_properties(0)
    result = {"set": args.set, "device": dev.name, "sms": dev.multi_processor_count, "l2_bytes": dev.L2_cache_size,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "kernels": {}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_json = out_dir / f"tune_sweep-{args.set}.json"

    def save() -> None:
        out_json.write_text(json.dumps(result, indent=1))

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        smi = f"nvidia-smi failed: {exc}"
    result["nvidia_smi_start"] = smi
    print("gpu:", smi, flush=True)
    timer = Timer(torch)

    # Copy bandwidth: 1 GiB device-to-device, bytes read + written.
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy_t = timer.run(lambda i: dst.copy_(src), 20, warmup=2)
    copy_bw = 2 * src.numel() * 4 / (copy_t["median_us"] * 1e-6) / 1e12
    result["copy_tbps"] = round(copy_bw, 4)
    del src, dst
    print(f"copy bandwidth {copy_bw:.3f} TB/s (1 GiB d2d, read+write)", flush=True)
    save()

    stream = torch.cuda.current_stream().cuda_stream
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    elem = 2

    # Phase 1 (while nvcc builds): timing inputs and torch.compile's version of each op.
    state = {}
    for kernel in kernels:
        pkg = package(kernel)
        bench_shapes = pkg["shapes"]["cuda"]["bench"]
        kres = {"bench_shapes": bench_shapes, "timed_dtype": TIMED_DTYPE[kernel], "flashinfer_us": FLASHINFER[kernel],
                "torch_compile_ref_us": TORCH_COMPILE_REF[kernel], "variants": [], "torch_compile": []}
        result["kernels"][kernel] = kres
        tdt = dtypes[TIMED_DTYPE[kernel]]
        floors = [model_bytes(kernel, s, elem) / (copy_bw * 1e12) * 1e6 for s in bench_shapes]
        kres["floor_us"] = [round(f, 2) for f in floors]
        inputs = [bench_inputs(torch, kernel, dims, tdt, 2 if model_bytes(kernel, dims, elem) < 256e6 else 1)
                  for dims in bench_shapes]
        other = None
        if any(v.get("both") for v in variants[kernel]):
            odt = torch.float16 if tdt == torch.bfloat16 else torch.bfloat16
            kres["other_dtype"] = str(odt).replace("torch.", "")
            other = [bench_inputs(torch, kernel, dims, odt, 2 if model_bytes(kernel, dims, elem) < 256e6 else 1)
                     for dims in bench_shapes]
        state[kernel] = (pkg, bench_shapes, floors, inputs, other)
        # A practical floor: a torch elementwise op moving the same bytes the same way (silu, merge:
        # c = a + b over the output's size; rmsnorm: a copy of [T, 2H], as many bytes read as written).
        kres["same_bytes_op"] = []
        for i, dims in enumerate(bench_shapes):
            nb = model_bytes(kernel, dims, elem)
            if kernel == "fused_add_rmsnorm":
                a = torch.randn(nb // 4, device="cuda").to(tdt)
                b = torch.empty_like(a)
                fn_ = lambda j, a=a, b=b: b.copy_(a)  # noqa: E731
            else:
                numel = nb // 6
                a, b2 = torch.randn(numel, device="cuda").to(tdt), torch.randn(numel, device="cuda").to(tdt)
                c = torch.empty_like(a)
                fn_ = lambda j, a=a, b2=b2, c=c: torch.add(a, b2, out=c)  # noqa: E731
            st = timer.run(fn_, args.samples)
            st["pct_floor"] = round(100 * floors[i] / st["median_us"], 1)
            kres["same_bytes_op"].append(st)
            del a
        print(f"{kernel} same-bytes torch op: {[t['median_us'] for t in kres['same_bytes_op']]}", flush=True)
        if args.no_compile_ref:
            continue
        fn = eager_fn(kernel, torch)
        for i, dims in enumerate(bench_shapes):
            if time.monotonic() - t_start > args.compile_deadline_s:
                kres["torch_compile"].append({"error": "skipped: deadline"})
                continue
            try:
                torch._dynamo.reset()
                cfn = torch.compile(fn, dynamic=False)
                cargs = [compile_args(kernel, s) for s in inputs[i]]
                t0 = time.monotonic()
                cfn(*cargs[0])
                torch.cuda.synchronize()
                ct = time.monotonic() - t0
                st = timer.run(lambda j, cfn=cfn, cargs=cargs: cfn(*cargs[j % len(cargs)]), args.samples,
                               sleep_cycles=8_000_000)
                st["compile_s"] = round(ct, 1)
                st["pct_floor"] = round(100 * floors[i] / st["median_us"], 1)
                st["no_sleep"] = timer.run(lambda j, cfn=cfn, cargs=cargs: cfn(*cargs[j % len(cargs)]),
                                           args.samples, sleep_cycles=0)["median_us"]
            except Exception as exc:  # noqa: BLE001
                st = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            kres["torch_compile"].append(st)
            print(f"{kernel} torch.compile {dims}: {st}", flush=True)
        save()

    # Phase 2: per kernel, every variant: correctness, then timing. The time left is shared among
    # the kernels in proportion to their variant counts, so a slow kernel cannot starve the rest.
    for ki, kernel in enumerate(kernels):
        left = args.deadline_s - (time.monotonic() - t_start)
        share = len(variants[kernel]) / sum(len(variants[k]) for k in kernels[ki:])
        kernel_deadline = time.monotonic() + max(0.0, left) * share
        pkg, bench_shapes, floors, inputs, other = state[kernel]
        kres = result["kernels"][kernel]
        ref = load_reference(kernel)
        test_shapes = pkg["shapes"]["cuda"]["test"]
        tols = pkg["tolerances"]
        cases = Cases(torch, kernel, ref, test_specs(kernel, test_shapes))
        base_err = {}
        for v in variants[kernel]:
            entry = {"name": v["name"], "defs": v["defs"], "flags": v["flags"]}
            kres["variants"].append(entry)
            b = futures[(kernel, v["name"])].result()
            entry["build"] = {k: b[k] for k in ("ok", "seconds", "max_regs", "spill_stores", "warnings", "key",
                                                "sass_mem_ops")}
            if not b["ok"]:
                entry["error"] = "build failed: " + b["log"][-500:]
                print(f"{kernel} {v['name']}: BUILD FAILED", flush=True)
                continue
            if time.monotonic() > kernel_deadline:
                entry["error"] = "skipped: deadline"
                continue
            try:
                abi = Abi(b["lib"], ENTRY[kernel], torch)
                fail, errs = run_cases(torch, kernel, abi, cases, tols, stream)
                if v["name"] == "default":
                    base_err = errs
                ratios = [errs[k] / base_err[k] for k in errs if base_err.get(k, 0) > 0]
                entry["correct"] = fail is None
                entry["fail"] = fail
                entry["max_err_vs_default"] = round(max(ratios), 3) if ratios else None
                if fail:
                    print(f"{kernel} {v['name']}: INCORRECT {fail}", flush=True)
                    continue
                entry["times"] = []
                for i, dims in enumerate(bench_shapes):
                    packs = [abi.pack(s) for s in inputs[i]]
                    rcs = []

                    def call(j, packs=packs, rcs=rcs):
                        rcs.append(abi(packs[j % len(packs)], stream))

                    n = args.samples if model_bytes(kernel, dims, elem) < 500e6 else max(60, args.samples * 2 // 3)
                    st = timer.run(call, n)
                    if any(rcs):
                        st["error"] = f"rc {set(rcs)}"
                    st["pct_floor"] = round(100 * floors[i] / st["median_us"], 1)
                    entry["times"].append(st)
                if v.get("both") and other is not None:
                    entry["times_other_dtype"], entry["times_no_sleep"] = [], []
                    for i, dims in enumerate(bench_shapes):
                        packs = [abi.pack(s) for s in other[i]]
                        st = timer.run(lambda j, packs=packs: abi(packs[j % len(packs)], stream),
                                       args.samples if model_bytes(kernel, dims, elem) < 500e6 else 100)
                        st["pct_floor"] = round(100 * floors[i] / st["median_us"], 1)
                        entry["times_other_dtype"].append(st)
                        packs = [abi.pack(s) for s in inputs[i]]
                        st = timer.run(lambda j, packs=packs: abi(packs[j % len(packs)], stream),
                                       args.samples if model_bytes(kernel, dims, elem) < 500e6 else 100, sleep_cycles=0)
                        entry["times_no_sleep"].append(st)
                line = " ".join(f"{t['median_us']:8.2f}" for t in entry["times"])
                print(f"{kernel:22s} {v['name']:26s} {line}  regs={b['max_regs']} "
                      f"err/def={entry['max_err_vs_default']}", flush=True)
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"{kernel} {v['name']}: ERROR {entry['error']}", flush=True)
            save()
        # The default again at the end: the run-to-run noise floor.
        try:
            b = futures[(kernel, "default")].result()
            abi = Abi(b["lib"], ENTRY[kernel], torch)
            again = []
            for i, dims in enumerate(bench_shapes):
                packs = [abi.pack(s) for s in inputs[i]]
                again.append(timer.run(lambda j, packs=packs: abi(packs[j % len(packs)], stream), args.samples))
            kres["default_again"] = again
            # And as the kopt harness times (no sleep kernel ahead of the batches).
            kres["default_no_sleep"] = [
                timer.run(lambda j, packs=[abi.pack(s) for s in inputs[i]]: abi(packs[j % len(packs)], stream),
                          args.samples, sleep_cycles=0) for i in range(len(bench_shapes))]
        except Exception as exc:  # noqa: BLE001
            kres["default_again"] = {"error": str(exc)[:300]}
        del cases
        state[kernel] = None
        torch.cuda.empty_cache()
        save()

    try:
        result["nvidia_smi_end"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    save()
    summary(result)
    return 0


def summary(result: dict) -> None:
    print(f"\n== {result['device']}  copy {result.get('copy_tbps')} TB/s  wall {result.get('wall_s')} s")
    for kernel, k in result["kernels"].items():
        ok = [v for v in k["variants"] if v.get("times")]
        if not ok:
            continue
        shapes = k["bench_shapes"]
        print(f"\n{kernel} ({k['timed_dtype']}); floor_us {k['floor_us']}")
        tc = [t.get("median_us") if isinstance(t, dict) else None for t in k.get("torch_compile", [])]
        print("  flashinfer(ref)   ", k["flashinfer_us"], " torch.compile(ref)", k["torch_compile_ref_us"],
              " torch.compile(here)", tc)
        default = next((v for v in ok if v["name"] == "default"), None)
        again = k.get("default_again")
        if default:
            print("  default           ", [t["median_us"] for t in default["times"]],
                  " again", [t.get("median_us") for t in again] if isinstance(again, list) else again,
                  " no-sleep", [t.get("median_us") for t in k.get("default_no_sleep", [])])
        for i, s in enumerate(shapes):
            best = sorted(ok, key=lambda v: v["times"][i]["median_us"])[:3]
            print(f"  best {s}: " + "; ".join(f"{v['name']} {v['times'][i]['median_us']:.2f}"
                                               f" ({v['times'][i]['pct_floor']}%)" for v in best))
        if default:
            def gm(v):
                return math.exp(statistics.fmean(
                    math.log(d["median_us"] / t["median_us"]) for d, t in zip(default["times"], v["times"])))
            top = sorted(ok, key=gm, reverse=True)[:8]
            print("  top geomean vs default: " + "; ".join(f"{v['name']} {gm(v):.3f}" for v in top))
        sb = [t.get("median_us") for t in k.get("same_bytes_op", [])]
        tcn = [t.get("no_sleep") if isinstance(t, dict) else None for t in k.get("torch_compile", [])]
        if sb or any(tcn):
            print("  same-bytes torch op", sb, " torch.compile no-sleep", tcn)
        for v in ok:
            if v.get("times_other_dtype"):
                print(f"  both dtypes {v['name']:28s} {[t['median_us'] for t in v['times']]} "
                      f"{k.get('other_dtype')} {[t['median_us'] for t in v['times_other_dtype']]} "
                      f"no-sleep {[t['median_us'] for t in v['times_no_sleep']]}")
        bad = [v["name"] for v in k["variants"] if v.get("correct") is False or v.get("error")]
        if bad:
            print("  failed/skipped:", bad)


if __name__ == "__main__":
    sys.exit(main())
