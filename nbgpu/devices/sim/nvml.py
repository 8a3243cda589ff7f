"""A fake NVML *library* that serves a :class:`~nbgpu.devices.sim.fleet.Fleet`.

pynvml calls the C library through the module attribute ``pynvml.nvmlLib``, looking
each symbol up by name and passing ctypes objects (``byref(c_uint())``, string buffers,
arrays of process structs). :class:`FakeNvmlLibrary` has functions of the same names
that write into those same ctypes objects and return NVML return codes. Installed in
place of the real library (by ``devices/nvml.py``), it drives the real pynvml wrappers,
nbgpu's NVML module, and other tools such as gpustat and nvitop unchanged: only the
hardware is fake.

``nvml_base.py`` is its frame (dispatch by symbol name, init, handles, identity); here
is what it says of a device's state. Memory and utilisation follow the fleet (and its
load profile, and the ranks nbgpu launched on a simulated GPU: ``ranks.py``);
temperature, power, modes, ECC, remapped rows, MIG and processes answer as the driver
would, failures included. Where the fleet asks for a failure it behaves as the real
driver: a missing symbol raises ``AttributeError`` (pynvml turns it into
FunctionNotFound, as with an old driver), a lost GPU answers ``GPU_IS_LOST``, a
cgroup-restricted one ``NO_PERMISSION``, and functions this fake does not model answer
``NOT_SUPPORTED``, which every NVML client must handle anyway.

This module must never import pynvml (only ``devices/nvml.py`` does) or IPython.
"""

from __future__ import annotations

import math
import time
from typing import Any

from nbgpu.devices.model import ProcessRecord
from nbgpu.devices.sim.fleet import COMPUTE_MODES, SimGpu
from nbgpu.devices.sim.nvml_base import (
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_AVAILABLE_U64,
    NOT_FOUND,
    NOT_MIG,
    NOT_SUPPORTED,
    SUCCESS,
    FakeLibraryBase,
    Handle,
    device_number,
    store,
    target,
    write_pointer,
)
from nbgpu.devices.sim.ranks import RankProcess, ranks_on_gpus

__all__ = ["FakeNvmlLibrary"]


class FakeNvmlLibrary(FakeLibraryBase):
    """Stands in for ``CDLL("libnvidia-ml.so.1")``; see the module docstring."""

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

    _nvmlDeviceGetTemperature = device_number(lambda h: h.gpu.temperature_c)

    def _nvmlDeviceGetTemperatureV(self, handle: Any, ref: Any) -> int:
        # The versioned call newer tools (nvitop) prefer; same reading, struct out.
        code, h = self._device(handle)
        if h is None:
            return code
        target(ref).temperature = h.gpu.temperature_c
        return SUCCESS

    # P0 under load, P8 idle, as real boards report.
    _nvmlDeviceGetPerformanceState = device_number(
        lambda h: 0 if h.gpu.utilization_gpu_pct > 0 or h.gpu.processes else 8
    )
    _nvmlDeviceGetPowerUsage = device_number(lambda h: round(h.gpu.power_w * 1000))
    _nvmlDeviceGetEnforcedPowerLimit = device_number(lambda h: round(h.gpu.power_limit_w * 1000))
    _nvmlDeviceGetPowerManagementLimit = _nvmlDeviceGetEnforcedPowerLimit
    _nvmlDeviceGetComputeMode = device_number(lambda h: COMPUTE_MODES[h.gpu.compute_mode])
    _nvmlDeviceGetPersistenceMode = device_number(lambda h: int(h.gpu.persistence_mode))

    # -- health ------------------------------------------------------------------

    _nvmlDeviceGetTotalEccErrors = device_number(lambda h: h.gpu.ecc_uncorrected_volatile)

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

    _nvmlDeviceGetRetiredPagesPendingStatus = device_number(
        lambda h: None if h.gpu.retired_pages_pending is None else int(h.gpu.retired_pages_pending)
    )

    # -- MIG -----------------------------------------------------------------------

    def _nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.mig_enabled is None:
            return NOT_SUPPORTED
        store(current, int(h.gpu.mig_enabled))
        store(pending, int(h.gpu.mig_enabled))
        return SUCCESS

    _nvmlDeviceGetMaxMigDeviceCount = device_number(
        lambda h: None if h.gpu.mig_enabled is None else len(h.gpu.mig_devices)
    )

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        i = index.value if hasattr(index, "value") else int(index)
        for candidate in self._handles:
            if candidate.gpu is h.gpu and candidate.mig == i:
                write_pointer(ref, candidate.address)
                return SUCCESS
        return NOT_FOUND

    _nvmlDeviceIsMigDeviceHandle = device_number(lambda h: int(h.mig is not None))

    def _nvmlDeviceGetGpuInstanceId(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.mig is None:
            return INVALID_ARGUMENT
        store(ref, h.gpu.mig_devices[h.mig].gpu_instance_id)
        return SUCCESS

    def _nvmlDeviceGetComputeInstanceId(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.mig is None:
            return INVALID_ARGUMENT
        store(ref, h.gpu.mig_devices[h.mig].compute_instance_id)
        return SUCCESS

    # -- processes -----------------------------------------------------------------

    def _processes(self, handle: Any, count_ref: Any, array: Any, kind: str) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        procs = [p for p in h.gpu.processes if p.kind == kind] if h.mig is None else []
        if kind == "compute" and h.mig is None:
            procs += [ProcessRecord(r.pid, r.rss_bytes) for r in self._ranks(h.gpu)]
        count = target(count_ref)
        if not procs:
            count.value = 0
            return SUCCESS
        if array is None or count.value < len(procs):
            # NVML's two-call protocol: report the size, ask for a bigger buffer.
            count.value = len(procs)
            return INSUFFICIENT_SIZE
        for slot, proc in zip(array, procs, strict=False):
            slot.pid = proc.pid
            # Under MIG, an unprivileged caller gets no per-process memory figure.
            hidden = proc.used_bytes is None or bool(h.gpu.mig_enabled)
            slot.usedGpuMemory = NOT_AVAILABLE_U64 if hidden else proc.used_bytes
            if hasattr(slot, "gpuInstanceId"):
                slot.gpuInstanceId = NOT_MIG
                slot.computeInstanceId = NOT_MIG
        count.value = len(procs)
        return SUCCESS

    def _nvmlDeviceGetComputeRunningProcesses_v3(
        self, handle: Any, count_ref: Any, array: Any
    ) -> int:
        return self._processes(handle, count_ref, array, "compute")

    _nvmlDeviceGetComputeRunningProcesses_v2 = _nvmlDeviceGetComputeRunningProcesses_v3
    _nvmlDeviceGetComputeRunningProcesses = _nvmlDeviceGetComputeRunningProcesses_v3

    def _nvmlDeviceGetGraphicsRunningProcesses_v3(
        self, handle: Any, count_ref: Any, array: Any
    ) -> int:
        return self._processes(handle, count_ref, array, "graphics")

    _nvmlDeviceGetGraphicsRunningProcesses_v2 = _nvmlDeviceGetGraphicsRunningProcesses_v3
    _nvmlDeviceGetGraphicsRunningProcesses = _nvmlDeviceGetGraphicsRunningProcesses_v3

    def _nvmlDeviceGetMPSComputeRunningProcesses_v3(
        self, handle: Any, count_ref: Any, _array: Any
    ) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        target(count_ref).value = 0
        return SUCCESS

    _nvmlDeviceGetMPSComputeRunningProcesses_v2 = _nvmlDeviceGetMPSComputeRunningProcesses_v3
