"""A fake NVML *library* that serves a :class:`~nbgpu.devices.fleet.Fleet`.

pynvml calls the C library through the module attribute ``pynvml.nvmlLib``, looking
each symbol up by name and passing ctypes objects (``byref(c_uint())``, string buffers,
arrays of process structs). :class:`FakeNvmlLibrary` has functions of the same names
that write into those same ctypes objects and return NVML return codes. Installed in
place of the real library (by ``nvml.use_library``), it drives the real pynvml
wrappers, nbgpu's NVML module, and other tools such as gpustat and nvitop unchanged:
only the hardware is fake.

Behaviour follows the real driver where the fleet asks for a failure: a missing
symbol raises ``AttributeError`` (pynvml turns it into FunctionNotFound, as with an
old driver), a lost GPU answers ``GPU_IS_LOST``, a cgroup-restricted one
``NO_PERMISSION``, and functions this fake does not model answer ``NOT_SUPPORTED``,
which every NVML client must handle anyway.

This module must never import pynvml (only ``nvml.py`` does), psutil, or IPython.
"""

from __future__ import annotations

from typing import Any

from nbgpu.devices.fleet import SimProcess
from nbgpu.devices.simulate_base import (
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_AVAILABLE_U64,
    NOT_FOUND,
    NOT_MIG,
    NOT_SUPPORTED,
    SUCCESS,
    store,
    target,
    write_pointer,
)
from nbgpu.devices.simulate_device import DeviceQueries

__all__ = ["FakeNvmlLibrary"]


class FakeNvmlLibrary(DeviceQueries):
    """Stands in for ``CDLL("libnvidia-ml.so.1")``; see the module docstring."""

    def _nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.mig_enabled is None:
            return NOT_SUPPORTED
        store(current, int(h.gpu.mig_enabled))
        store(pending, int(h.gpu.mig_enabled))
        return SUCCESS

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.mig_enabled is None:
            return NOT_SUPPORTED
        store(ref, len(h.gpu.mig_devices))
        return SUCCESS

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

    def _nvmlDeviceIsMigDeviceHandle(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        store(ref, int(h.mig is not None))
        return SUCCESS

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
            procs += [SimProcess(r.pid, r.rss_bytes) for r in self._ranks(h.gpu)]
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
