"""Read-only NVML through ctypes (pynvml may be missing): clocks, temperature, slowdown reasons.

kopt never changes clocks, power limits or any other device setting (docs/measurement.md, timing 9);
it only reads them around each timed block, so samples taken during a thermal or power slowdown
can be dropped and counted. Everything degrades to "unknown" when NVML is not there.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
# Slowdown reasons that make a sample unrepresentative (nvmlClocksEventReasons): SW power cap,
# HW slowdown, SW thermal, HW thermal, HW power brake. Idle, app clocks, sync boost are harmless.
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class Reading:
    sm_mhz: int | None
    mem_mhz: int | None
    temp_c: int | None
    reasons: int  # clocks event reasons bitmask (0 when unknown)

    @property
    def throttled(self) -> bool:
        return bool(self.reasons & THROTTLE_MASK)


class Nvml:
    """One device's NVML handle, found by PCI bus id (CUDA_VISIBLE_DEVICES renumbers indices)."""

    def __init__(self, pci_bus_id: str | None, index: int = 0) -> None:
        self.lib = None
        self.handle = ctypes.c_void_p()
        self.error: str | None = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as exc:
            self.error = f"NVML not available ({exc})"
            return
        if lib.nvmlInit_v2() != 0:
            self.error = "nvmlInit failed"
            return
        rc = -1
        if pci_bus_id:
            rc = lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(self.handle))
        if rc != 0:
            rc = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle))
        if rc != 0:
            self.error = f"NVML has no handle for the device (error {rc})"
            return
        self.lib = lib
        reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or lib.nvmlDeviceGetCurrentClocksThrottleReasons

    def read(self) -> Reading:
        if self.lib is None:
            return Reading(None, None, None, 0)
        sm, mem, temp, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        ok_sm = self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(sm)) == 0
        ok_mem = self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_MEM, ctypes.byref(mem)) == 0
        ok_t = self.lib.nvmlDeviceGetTemperature(self.handle, NVML_TEMPERATURE_GPU, ctypes.byref(temp)) == 0
        ok_r = self._reasons(self.handle, ctypes.byref(reasons)) == 0
        return Reading(
            sm.value if ok_sm else None, mem.value if ok_mem else None, temp.value if ok_t else None,
            reasons.value if ok_r else 0,
        )  # fmt: skip


class Monitor:
    """Readings around timed blocks: is a block clean, and what clocks did the clean ones see."""

    def __init__(self, nvml: Nvml | None) -> None:
        self.nvml = nvml if nvml is not None and nvml.lib is not None else None
        self.readings: list[Reading] = []

    def begin(self) -> Reading | None:
        return self.nvml.read() if self.nvml else None

    def clean(self, before: Reading | None) -> bool:
        """True when neither end of the block saw a slowdown; keeps the readings of clean blocks."""
        if self.nvml is None or before is None:
            return True
        after = self.nvml.read()
        if before.throttled or after.throttled:
            return False
        self.readings += [before, after]
        return True

    def summary(self) -> tuple[float | None, float | None, float | None]:
        """Median SM clock, memory clock (MHz) and temperature (C) over the clean blocks."""

        def med(xs: list[int | None]) -> float | None:
            vals = sorted(x for x in xs if x is not None)
            return float(vals[len(vals) // 2]) if vals else None

        r = self.readings
        return med([x.sm_mhz for x in r]), med([x.mem_mhz for x in r]), med([x.temp_c for x in r])

    def reset(self) -> None:
        self.readings = []
