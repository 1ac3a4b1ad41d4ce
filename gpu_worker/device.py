"""Device discovery and naming, without torch (the worker process must not create a CUDA context).

A GPU worker polls the task queue of its device class (kopt-gpu-<class>), so the class must
separate parts that time differently: H100 SXM, PCIe and NVL are different classes.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import NamedTuple

from kopt.gpu_classes import gpu_class_from_name

class LocalGpu(NamedTuple):
    index: int  # nvidia-smi index (physical; CUDA_VISIBLE_DEVICES does not renumber it)
    name: str
    gpu_class: str
    uuid: str = ""


def local_gpus(timeout_s: float = 20.0) -> list[LocalGpu]:
    """GPUs nvidia-smi sees, as (index, name, class, uuid); empty when nvidia-smi is missing or fails."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,uuid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    gpus = []
    for line in proc.stdout.splitlines():
        index, _, rest = line.partition(",")
        name, _, uuid = rest.rpartition(",") if rest.count(",") else (rest, "", "")
        if not index.strip().isdigit() or not name.strip():
            continue
        gpus.append(LocalGpu(int(index), name.strip(), gpu_class_from_name(name), uuid.strip()))
    return gpus


def visible_gpus(gpus: list[LocalGpu], cuda_visible_devices: str | None) -> list[LocalGpu]:
    """The GPUs of `gpus` that CUDA_VISIBLE_DEVICES lets this process use, in its order: all where it is
    unset. Its entries are nvidia-smi indices or UUIDs (a prefix is enough); as in CUDA, the list ends at
    the first entry that names no GPU or repeats one, and an empty value hides every GPU."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[LocalGpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            found = [g for g in gpus if g.index == int(entry)]
        else:
            found = [g for g in gpus if entry and g.uuid.startswith(entry)]
        if len(found) != 1 or found[0] in chosen:
            break
        chosen.append(found[0])
    return chosen


def cpu_name() -> str:
    """CPU model name from /proc/cpuinfo (platform fallbacks elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


# Instruction-set extensions a CPU kernel's author chooses code paths by (the /proc/cpuinfo flag names).
CPU_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                 "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "neon", "asimd", "sve")


def cpu_facts() -> list[str]:
    """What a CPU kernel's author needs to know of this machine, one fact a line: the model, the
    instruction-set extensions (of CPU_ISA_FLAGS), the cores, and cpu0's caches."""
    facts = [f"CPU: {cpu_name()}"]
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    flags = next((line.partition(":")[2].split() for line in info.splitlines()
                  if line.split(":")[0].strip() in ("flags", "Features")), [])  # fmt: skip
    have = [f for f in CPU_ISA_FLAGS if f in flags]
    facts.append(f"instruction sets: {' '.join(have) if have else '(none of ' + ' '.join(CPU_ISA_FLAGS) + ')'}")
    facts.append(f"cores available to the process: {len(os.sched_getaffinity(0))}; single-threaded kernels only")
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / n).read_text().strip() for n in ("level", "type", "size"))
        except OSError:
            continue
        caches.append(f"L{level} {kind.lower()} {size}")
    if caches:
        facts.append("caches (per core or shared, cpu0's view): " + ", ".join(caches))
    return facts


# Datasheet peak memory bandwidth, GB/s, by GPU class (the physical limit: a cold-L2 result implying
# more is a measurement fault). Where a class has variants, the fastest one, so no honest result
# is ever rejected; an unknown class falls back to UNKNOWN_PEAK_FACTOR x the measured copy bandwidth.
PEAK_BANDWIDTH_GBS: dict[str, float] = {
    "h100": 3350.0,  # H100 SXM5 80GB HBM3
    "h100-pcie": 2039.0,
    "h100-nvl": 3900.0,
    "h800": 3350.0,
    "h200": 4800.0,
    "h200-nvl": 4800.0,
    "gh200": 4900.0,  # 144 GB HBM3e variant
    "b100": 8000.0,
    "b200": 8000.0,
    "gb200": 8000.0,
    "a100": 2039.0,  # 80GB SXM4
    "a100-pcie": 1935.0,
    "l40s": 864.0,
    "l40": 864.0,
    "l4": 300.0,
    "a10g": 600.0,
    "a10": 600.0,
}
UNKNOWN_PEAK_FACTOR = 1.2
CPU_SANITY_FACTOR = 20.0  # CPU (hot caches): above 20x the DRAM copy bandwidth is not a kernel doing work


def peak_bandwidth_gbs(target: str, device_name: str, copy_bandwidth_gbs: float) -> tuple[float, str]:
    """(bound, what it is) above which a measured bandwidth is rejected as a measurement fault."""
    if target == "cpu":
        what = f"{CPU_SANITY_FACTOR:g}x the measured copy bandwidth (CPU sanity bound)"
        return CPU_SANITY_FACTOR * copy_bandwidth_gbs, what
    cls = gpu_class_from_name(device_name)
    if cls in PEAK_BANDWIDTH_GBS:
        return PEAK_BANDWIDTH_GBS[cls], f"the {cls} datasheet peak"
    what = f"{UNKNOWN_PEAK_FACTOR:g}x the measured copy bandwidth ({cls}: no datasheet entry)"
    return UNKNOWN_PEAK_FACTOR * copy_bandwidth_gbs, what
