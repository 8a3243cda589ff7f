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

import ctypes
import math
import time
from collections.abc import Callable
from typing import Any

from nbgpu.devices.fleet import COMPUTE_MODES, INIT_ERRORS, Fleet, SimGpu, SimProcess
from nbgpu.devices.sim_ranks import RankProcess, ranks_on_gpus

__all__ = ["FakeNvmlLibrary"]

# NVML return codes (nvml.h); only those this fake returns.
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
GPU_IS_LOST = 15
UNKNOWN = 999

NOT_AVAILABLE_U64 = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long
NOT_MIG = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId when MIG is off

_ERROR_STRINGS = {
    SUCCESS: b"Success",
    UNINITIALIZED: b"Uninitialized",
    INVALID_ARGUMENT: b"Invalid Argument",
    NOT_SUPPORTED: b"Not Supported",
    NO_PERMISSION: b"Insufficient Permissions",
    NOT_FOUND: b"Not Found",
    INSUFFICIENT_SIZE: b"Insufficient Size",
    9: b"Driver Not Loaded",
    12: b"NVML Shared Library Not Found",
    GPU_IS_LOST: b"GPU is lost",
    18: b"RM has detected an NVML/RM version mismatch.",
    UNKNOWN: b"Unknown Error",
}


def _target(ref: Any) -> Any:
    """The ctypes object behind ``byref(obj)`` (or the object itself)."""
    return getattr(ref, "_obj", ref)


def _store(ref: Any, value: Any) -> None:
    _target(ref).value = value


def _write_pointer(ref: Any, address: int) -> None:
    # pynvml's device handle is a ctypes POINTER; write the raw address into it so
    # the wrapper hands our opaque token back to us on the next call.
    target = _target(ref)
    ctypes.memmove(
        ctypes.addressof(target),
        ctypes.byref(ctypes.c_void_p(address)),
        ctypes.sizeof(ctypes.c_void_p),
    )


def _address(handle: Any) -> int | None:
    if handle is None:
        return None
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class _Handle:
    """One device handle: a physical GPU, or one MIG instance of it."""

    def __init__(self, gpu: SimGpu, mig: int | None) -> None:
        self.gpu = gpu
        self.mig = mig
        # A real allocation gives each handle an address no other object shares.
        self.token = ctypes.create_string_buffer(8)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.token)


class FakeNvmlLibrary:
    """Stands in for ``CDLL("libnvidia-ml.so.1")``; see the module docstring."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._born = time.monotonic()  # the load profile's clock
        self.initialised = 0
        self.calls = 0  # how many NVML calls were made: benchmarks and tests read it
        self._handles: list[_Handle] = []
        self._by_address: dict[int, _Handle] = {}
        for gpu in fleet.gpus:
            self._add(_Handle(gpu, None))
            for mig_index in range(len(gpu.mig_devices)):
                self._add(_Handle(gpu, mig_index))

    def _add(self, handle: _Handle) -> None:
        self._handles.append(handle)
        self._by_address[handle.address] = handle

    # -- symbol lookup ----------------------------------------------------------

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only called for names that are not real attributes: the NVML symbols.
        if not name.startswith("nvml"):
            raise AttributeError(name)
        if name in self.fleet.missing_functions:
            raise AttributeError(f"undefined symbol: {name}")
        impl = getattr(type(self), "_" + name, None)
        if impl is None:
            impl = FakeNvmlLibrary._not_supported
        bound: Callable[..., Any] = impl.__get__(self, type(self))

        def call(*args: Any) -> Any:
            self.calls += 1
            return bound(*args)

        call.__name__ = name
        return call

    def _not_supported(self, *_args: Any) -> int:
        return NOT_SUPPORTED if self.initialised else UNINITIALIZED

    def _device(self, handle: Any) -> tuple[int, _Handle | None]:
        """Resolve a handle to (return code, handle); code != 0 means answer it."""
        if not self.initialised:
            return UNINITIALIZED, None
        found = self._by_address.get(_address(handle) or -1)
        if found is None:
            return INVALID_ARGUMENT, None
        fault = found.gpu.fault
        if fault == "lost":
            return GPU_IS_LOST, None
        if fault == "no_permission":
            return NO_PERMISSION, None
        return SUCCESS, found

    # -- init and system -----------------------------------------------------

    def _nvmlInitWithFlags(self, _flags: Any) -> int:
        if self.fleet.init_error is not None:
            return INIT_ERRORS[self.fleet.init_error]
        self.initialised += 1
        return SUCCESS

    def _nvmlInit_v2(self) -> int:
        return self._nvmlInitWithFlags(0)

    def _nvmlShutdown(self) -> int:
        if not self.initialised:
            return UNINITIALIZED
        self.initialised -= 1
        return SUCCESS

    def _nvmlErrorString(self, code: Any) -> bytes:
        value = code.value if hasattr(code, "value") else int(code)
        return _ERROR_STRINGS.get(value, b"Unknown Error")

    def _nvmlSystemGetDriverVersion(self, buf: Any, _size: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        buf.value = self.fleet.driver_version.encode()
        return SUCCESS

    def _nvmlSystemGetNVMLVersion(self, buf: Any, _size: Any) -> int:
        buf.value = self.fleet.nvml_version.encode()
        return SUCCESS

    def _nvmlSystemGetCudaDriverVersion(self, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        _store(ref, self.fleet.cuda_driver_version)
        return SUCCESS

    _nvmlSystemGetCudaDriverVersion_v2 = _nvmlSystemGetCudaDriverVersion

    def _nvmlSystemGetProcessName(self, pid: Any, buf: Any, _size: Any) -> int:
        wanted = pid.value if hasattr(pid, "value") else int(pid)
        for gpu in self.fleet.gpus:
            for proc in gpu.processes:
                if proc.pid == wanted and proc.observed and proc.observed.command:
                    buf.value = proc.observed.command.split()[0].encode()
                    return SUCCESS
        return NOT_FOUND

    # -- enumeration -----------------------------------------------------------

    def _nvmlDeviceGetCount_v2(self, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        # v2 counts every GPU, even those we may not open (cgroup-restricted).
        _store(ref, len(self.fleet.gpus))
        return SUCCESS

    def _nvmlDeviceGetCount(self, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        _store(ref, sum(1 for g in self.fleet.gpus if g.fault != "no_permission"))
        return SUCCESS

    def _nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        i = index.value if hasattr(index, "value") else int(index)
        physical = [h for h in self._handles if h.mig is None]
        if not 0 <= i < len(physical):
            return INVALID_ARGUMENT
        handle = physical[i]
        if handle.gpu.fault == "lost":
            return GPU_IS_LOST
        if handle.gpu.fault == "no_permission":
            return NO_PERMISSION
        _write_pointer(ref, handle.address)
        return SUCCESS

    _nvmlDeviceGetHandleByIndex = _nvmlDeviceGetHandleByIndex_v2

    def _nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        wanted = (uuid.value if hasattr(uuid, "value") else uuid) or b""
        for handle in self._handles:
            if self._uuid(handle).encode() == wanted and handle.gpu.fault is None:
                _write_pointer(ref, handle.address)
                return SUCCESS
        return NOT_FOUND

    def _nvmlDeviceGetIndex(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, h.gpu.index)
        return SUCCESS

    # -- identity ----------------------------------------------------------------

    @staticmethod
    def _uuid(handle: _Handle) -> str:
        if handle.mig is None:
            return handle.gpu.uuid
        return handle.gpu.mig_devices[handle.mig].uuid

    def _nvmlDeviceGetName(self, handle: Any, buf: Any, _size: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        name = h.gpu.name if h.mig is None else h.gpu.mig_devices[h.mig].name
        buf.value = name.encode()
        return SUCCESS

    def _nvmlDeviceGetUUID(self, handle: Any, buf: Any, _size: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        buf.value = self._uuid(h).encode()
        return SUCCESS

    def _nvmlDeviceGetPciInfo_v3(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        info = _target(ref)
        bus_id = h.gpu.pci_bus_id
        domain, bus, rest = bus_id.split(":")
        device = rest.split(".")[0]
        info.busIdLegacy = bus_id[4:].encode()
        info.busId = bus_id.encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(device, 16)
        info.pciDeviceId = h.gpu.pci_device_id
        info.pciSubSystemId = 0x145A10DE
        return SUCCESS

    _nvmlDeviceGetPciInfo_v2 = _nvmlDeviceGetPciInfo_v3
    _nvmlDeviceGetPciInfo = _nvmlDeviceGetPciInfo_v3

    def _nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(major, h.gpu.compute_capability[0])
        _store(minor, h.gpu.compute_capability[1])
        return SUCCESS

    # -- memory, utilisation, sensors ------------------------------------------

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

    def _memory(self, h: _Handle) -> tuple[int, int, int]:
        if h.mig is not None:
            total = h.gpu.mig_devices[h.mig].memory_total_bytes
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
        mem = _target(ref)
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
        mem = _target(ref)
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
        util = _target(ref)
        load = self._load(h.gpu)
        util.gpu = max(h.gpu.utilization_gpu_pct, round(95 * load))
        util.memory = max(h.gpu.utilization_memory_pct, round(60 * load))
        return SUCCESS

    def _nvmlDeviceGetTemperature(self, handle: Any, _sensor: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, h.gpu.temperature_c)
        return SUCCESS

    def _nvmlDeviceGetTemperatureV(self, handle: Any, ref: Any) -> int:
        # The versioned call newer tools (nvitop) prefer; same reading, struct out.
        code, h = self._device(handle)
        if h is None:
            return code
        _target(ref).temperature = h.gpu.temperature_c
        return SUCCESS

    def _nvmlDeviceGetPerformanceState(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        busy = h.gpu.utilization_gpu_pct > 0 or bool(h.gpu.processes)
        _store(ref, 0 if busy else 8)  # P0 under load, P8 idle, as real boards report
        return SUCCESS

    def _nvmlDeviceGetPowerUsage(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, round(h.gpu.power_w * 1000))
        return SUCCESS

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, round(h.gpu.power_limit_w * 1000))
        return SUCCESS

    _nvmlDeviceGetPowerManagementLimit = _nvmlDeviceGetEnforcedPowerLimit

    def _nvmlDeviceGetComputeMode(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, COMPUTE_MODES[h.gpu.compute_mode])
        return SUCCESS

    def _nvmlDeviceGetPersistenceMode(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, 1 if h.gpu.persistence_mode else 0)
        return SUCCESS

    # -- health ------------------------------------------------------------------

    def _nvmlDeviceGetTotalEccErrors(self, handle: Any, _kind: Any, _counter: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.ecc_uncorrected_volatile is None:
            return NOT_SUPPORTED
        _store(ref, h.gpu.ecc_uncorrected_volatile)
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
        _store(corr, rows.correctable)
        _store(unc, rows.uncorrectable)
        _store(pending, int(rows.pending))
        _store(failure, int(rows.failure))
        return SUCCESS

    def _nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.retired_pages_pending is None:
            return NOT_SUPPORTED
        _store(ref, int(h.gpu.retired_pages_pending))
        return SUCCESS

    # -- MIG -----------------------------------------------------------------------

    def _nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.mig_enabled is None:
            return NOT_SUPPORTED
        _store(current, int(h.gpu.mig_enabled))
        _store(pending, int(h.gpu.mig_enabled))
        return SUCCESS

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.gpu.mig_enabled is None:
            return NOT_SUPPORTED
        _store(ref, len(h.gpu.mig_devices))
        return SUCCESS

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        i = index.value if hasattr(index, "value") else int(index)
        for candidate in self._handles:
            if candidate.gpu is h.gpu and candidate.mig == i:
                _write_pointer(ref, candidate.address)
                return SUCCESS
        return NOT_FOUND

    def _nvmlDeviceIsMigDeviceHandle(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        _store(ref, int(h.mig is not None))
        return SUCCESS

    def _nvmlDeviceGetGpuInstanceId(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.mig is None:
            return INVALID_ARGUMENT
        _store(ref, h.gpu.mig_devices[h.mig].gpu_instance_id)
        return SUCCESS

    def _nvmlDeviceGetComputeInstanceId(self, handle: Any, ref: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        if h.mig is None:
            return INVALID_ARGUMENT
        _store(ref, h.gpu.mig_devices[h.mig].compute_instance_id)
        return SUCCESS

    # -- processes -----------------------------------------------------------------

    def _processes(self, handle: Any, count_ref: Any, array: Any, kind: str) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        procs = [p for p in h.gpu.processes if p.kind == kind] if h.mig is None else []
        if kind == "compute" and h.mig is None:
            procs += [SimProcess(r.pid, r.rss_bytes) for r in self._ranks(h.gpu)]
        count = _target(count_ref)
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
        _target(count_ref).value = 0
        return SUCCESS

    _nvmlDeviceGetMPSComputeRunningProcesses_v2 = _nvmlDeviceGetMPSComputeRunningProcesses_v3
