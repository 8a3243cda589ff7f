"""What the fake NVML library says of a device's state: memory, load, sensors, modes.

Memory and utilisation follow the fleet (and its load profile, and the ranks nbgpu
launched on a simulated GPU); temperature, power, compute and persistence mode, ECC,
remapped rows and retired pages answer as the driver would, failures included. Never
imports pynvml, psutil or IPython.
"""

from __future__ import annotations

import math
import time
from typing import Any

from nbgpu.devices.fleet import COMPUTE_MODES, SimGpu
from nbgpu.devices.sim_ranks import RankProcess, ranks_on_gpus
from nbgpu.devices.simulate_base import (
    NOT_SUPPORTED,
    SUCCESS,
    FakeLibraryBase,
    Handle,
    store,
    target,
)

__all__ = ["DeviceQueries"]


class DeviceQueries(FakeLibraryBase):
    """The sensor and mode queries of the fake library."""

    def _load(self, gpu: SimGpu) -> float:
        """0..1: where this GPU is in the fleet's load cycle now (0 without a profile)."""
        period = self.fleet.load_period_s
        if not period or gpu.fault is not None:
            return 0.0
        phase = 2 * math.pi * ((time.monotonic() - self._born) / period) + 1.3 * gpu.index
        return 0.5 + 0.5 * math.sin(phase)

    def _ranks(self, gpu: SimGpu) -> list[RankProcess]:
        """nbgpu's own ranks running "on" this simulated GPU (real processes, real RSS)."""
        if gpu.fault is not None:
            return []
        return ranks_on_gpus(self.fleet.name).get(gpu.index, [])

    def _memory(self, h: Handle) -> tuple[int, int, int]:
        if h.mig is not None:
            total = h.gpu.mig_devices[h.mig].memory_total_bytes or 0  # None: not captured
            return total, 0, 0
        gpu = h.gpu
        # A load profile fills up to 60 % of the memory nobody else holds, and back.
        free = max(0, gpu.memory_total_bytes - gpu.effective_used_bytes)
        extra = int(0.6 * free * self._load(gpu))
        extra += sum(r.rss_bytes for r in self._ranks(gpu))
        used = min(gpu.effective_used_bytes + extra, gpu.memory_total_bytes)
        return gpu.memory_total_bytes, gpu.memory_reserved_bytes, used

    def _nvmlDeviceGetMemoryInfo(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        total, _reserved, used = self._memory(h)
        mem = target(ref)
        mem.total = total
        # v1 folds the driver's reservation into "used", as real drivers do.
        mem.used = min(total, used)
        mem.free = total - mem.used
        return SUCCESS

    def _nvmlDeviceGetMemoryInfo_v2(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        total, reserved, used = self._memory(h)
        mem = target(ref)
        mem.total = total
        mem.reserved = reserved
        mem.used = max(0, used - reserved)
        mem.free = total - reserved - mem.used
        return SUCCESS

    def _nvmlDeviceGetUtilizationRates(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.mig_enabled:
            return NOT_SUPPORTED  # per-GPU utilisation is not reported under MIG
        util = target(ref)
        load = self._load(h.gpu)
        util.gpu = max(h.gpu.utilization_gpu_pct, round(95 * load))
        util.memory = max(h.gpu.utilization_memory_pct, round(60 * load))
        return SUCCESS

    def _nvmlDeviceGetTemperature(self, handle: Any, _sensor: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        store(ref, h.gpu.temperature_c)
        return SUCCESS

    def _nvmlDeviceGetTemperatureV(self, handle: Any, ref: Any) -> int:
        # The versioned call newer tools (nvitop) prefer; same reading, struct out.
        code, h = self._device(handle)
        if h is None:
            return code
        target(ref).temperature = h.gpu.temperature_c
        return SUCCESS

    def _nvmlDeviceGetPerformanceState(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        busy = h.gpu.utilization_gpu_pct > 0 or bool(h.gpu.processes)
        store(ref, 0 if busy else 8)  # P0 under load, P8 idle, as real boards report
        return SUCCESS

    def _nvmlDeviceGetPowerUsage(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        store(ref, round(h.gpu.power_w * 1000))
        return SUCCESS

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        store(ref, round(h.gpu.power_limit_w * 1000))
        return SUCCESS

    _nvmlDeviceGetPowerManagementLimit = _nvmlDeviceGetEnforcedPowerLimit

    def _nvmlDeviceGetComputeMode(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        store(ref, COMPUTE_MODES[h.gpu.compute_mode])
        return SUCCESS

    def _nvmlDeviceGetPersistenceMode(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        store(ref, 1 if h.gpu.persistence_mode else 0)
        return SUCCESS

    # -- health ------------------------------------------------------------------

    def _nvmlDeviceGetTotalEccErrors(self, handle: Any, _kind: Any, _counter: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.ecc_uncorrected_volatile is None:
            return NOT_SUPPORTED
        store(ref, h.gpu.ecc_uncorrected_volatile)
        return SUCCESS

    def _nvmlDeviceGetRemappedRows(
        self, handle: Any, corr: Any, unc: Any, pending: Any, failure: Any
    ) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        rows = h.gpu.remapped_rows
        if rows is None:
            return NOT_SUPPORTED
        store(corr, rows.correctable)
        store(unc, rows.uncorrectable)
        store(pending, int(rows.pending))
        store(failure, int(rows.failure))
        return SUCCESS

    def _nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.retired_pages_pending is None:
            return NOT_SUPPORTED
        store(ref, int(h.gpu.retired_pages_pending))
        return SUCCESS

    # -- MIG -----------------------------------------------------------------------
