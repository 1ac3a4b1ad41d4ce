"""GPU classes: the names of the device kinds a GPU task queue serves (kopt-gpu-<class>).

A class must separate parts that time differently: H100 SXM, PCIe and NVL are different classes.
gpu_worker.device names a local device's class with gpu_class_from_name; the CLI accepts exactly
KNOWN_GPU_CLASSES for --gpu-class, so every class a worker can serve can be asked for.
"""

from __future__ import annotations

import re

# First match wins: specific variants before their family, GH200 before H200, L40S before L40.
_CLASS_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bgh200\b", "gh200"),
    (r"\bh200\b.*\bnvl\b", "h200-nvl"),
    (r"\bh200\b", "h200"),
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),
    (r"\bh100\b.*\bnvl\b", "h100-nvl"),
    (r"\bh100\b", "h100"),
    (r"\bh800\b", "h800"),
    (r"\bgb200\b", "gb200"),
    (r"\bb200\b", "b200"),
    (r"\bb100\b", "b100"),
    (r"\ba100\b.*\bpcie\b", "a100-pcie"),
    (r"\ba100\b", "a100"),
    (r"\bl40s\b", "l40s"),
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
)

KNOWN_GPU_CLASSES: tuple[str, ...] = tuple(dict.fromkeys(cls for _, cls in _CLASS_PATTERNS))


def gpu_class_from_name(name: str) -> str:
    """Device class of a GPU name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H100 PCIe" -> "h100-pcie";
    unknown parts get a lowercase slug of the name without the vendor ("geforce-rtx-4090")."""
    low = name.lower().strip()
    for pattern, cls in _CLASS_PATTERNS:
        if re.search(pattern, low):
            return cls
    low = re.sub(r"^nvidia\s+", "", low)
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown"
