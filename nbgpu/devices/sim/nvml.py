"""A fake NVML *library* that serves a :class:`~nbgpu.devices.sim.box.Fleet`.

pynvml calls the C library through ``pynvml.nvmlLib``, by symbol name, with ctypes
objects; :class:`FakeNvmlLibrary` answers those names the same way, so pynvml, nbgpu's
NVML module, gpustat and nvitop run unchanged on it: only the hardware is fake. Memory
and utilisation follow the fleet, its load profile and the ranks nbgpu launched on it
(``box.ranks_on_gpus``); failures answer as the driver does: a symbol the fleet removed
raises ``AttributeError`` (pynvml's FunctionNotFound), a lost GPU ``GPU_IS_LOST``, a
cgroup-restricted one ``NO_PERMISSION``, anything not modelled ``NOT_SUPPORTED``. Never
imports pynvml or IPython; psutil only when a GPU's processes are asked for.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from typing import Any

from nbgpu.devices.model import INIT_ERRORS, ProcessRecord
from nbgpu.devices.sim.box import (
    COMPUTE_MODES,
    Device,
    Fleet,
    RankProcess,
    SimGpu,
    deref,
    int_arg,
    ranks_on_gpus,
)

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

NOT_AVAILABLE_U64 = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long
NOT_MIG = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId when MIG is off

ERROR_STRINGS = {
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
}
# What NVML answers for a GPU the fleet marks faulty.
_FAULT_CODES: dict[str | None, int] = {"lost": GPU_IS_LOST, "no_permission": NO_PERMISSION}


def _write_pointer(ref: Any, address: int) -> None:
    # pynvml's device handle is a ctypes POINTER; write the raw address into it so
    # the wrapper hands our opaque token back to us on the next call.
    ctypes.c_void_p.from_address(ctypes.addressof(deref(ref))).value = address


@dataclass(frozen=True, eq=False)
class _Handle(Device):
    """An NVML device handle: a device at an address no other object shares."""

    token: Any = field(default_factory=lambda: ctypes.create_string_buffer(8))

    @property
    def address(self) -> int:
        return ctypes.addressof(self.token)


_Call = Callable[..., int]


def _on_device(method: Callable[..., int]) -> _Call:
    """An NVML call about one device: its handle resolved first, failures answered."""

    def call(self: FakeNvmlLibrary, handle: Any, *args: Any) -> int:
        code, h = self._device(handle)
        return code if h is None else method(self, h, *args)

    return call


def _number(read: Callable[[_Handle], int | tuple[int, ...] | None]) -> _Call:
    """A getter of numbers about a device, written through its last arguments
    (``nvmlDeviceGetX(handle, [...,] ref)``); None from *read*: NOT_SUPPORTED."""

    def query(_self: FakeNvmlLibrary, h: _Handle, *args: Any) -> int:
        value = read(h)
        if value is None:
            return NOT_SUPPORTED
        values = value if isinstance(value, tuple) else (value,)
        for ref, number in zip(args[-len(values) :], values, strict=True):
            deref(ref).value = number
        return SUCCESS

    return _on_device(query)


def _system(read: Callable[[FakeNvmlLibrary], Any]) -> _Call:
    """A getter of one fact about the driver, written through its first argument."""

    def query(self: FakeNvmlLibrary, ref: Any, *_args: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        deref(ref).value = read(self)
        return SUCCESS

    return query


def _mig_id(field: str) -> _Call:
    """A MIG instance's GPU or compute instance id; a whole GPU has none."""

    def query(_self: FakeNvmlLibrary, h: _Handle, ref: Any) -> int:
        if h.mig is None:
            return INVALID_ARGUMENT
        deref(ref).value = getattr(h.mig, field)
        return SUCCESS

    return _on_device(query)


def _process_list(kind: str) -> _Call:
    """``nvmlDeviceGet{Compute,Graphics}RunningProcesses``: NVML's two-call protocol."""

    def query(self: FakeNvmlLibrary, h: _Handle, count_ref: Any, array: Any) -> int:
        procs = [p for p in h.gpu.processes if p.kind == kind] if h.mig is None else []
        if kind == "compute" and h.mig is None:
            procs += [ProcessRecord(r.pid, r.rss_bytes) for r in self._ranks(h.gpu)]
        count = deref(count_ref)
        if procs and (array is None or count.value < len(procs)):
            count.value = len(procs)  # report the size, ask for a bigger buffer
            return INSUFFICIENT_SIZE
        for slot, proc in zip(array or (), procs, strict=False):
            slot.pid = proc.pid
            # Under MIG, an unprivileged caller gets no per-process memory figure.
            hidden = proc.used_bytes is None or bool(h.gpu.mig_enabled)
            slot.usedGpuMemory = NOT_AVAILABLE_U64 if hidden else proc.used_bytes
            if hasattr(slot, "gpuInstanceId"):
                slot.gpuInstanceId = NOT_MIG
                slot.computeInstanceId = NOT_MIG
        count.value = len(procs)
        return SUCCESS

    return _on_device(query)


class FakeNvmlLibrary:
    """Stands in for ``CDLL("libnvidia-ml.so.1")``: NVML's ``nvmlX`` is served by ``_nvmlX``."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._born = time.monotonic()  # the load profile's clock
        self.initialised = 0
        self.calls = 0  # how many NVML calls were made: benchmarks and tests read it
        self._handles = [
            _Handle(gpu, mig) for gpu in fleet.gpus for mig in (None, *gpu.mig_devices)
        ]
        self._by_address = {h.address: h for h in self._handles}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only called for names that are not real attributes: the NVML symbols.
        if not name.startswith("nvml"):
            raise AttributeError(name)
        if name in self.fleet.missing_functions:
            raise AttributeError(f"undefined symbol: {name}")
        impl = getattr(type(self), "_" + name, FakeNvmlLibrary._not_supported)
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
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value if handle is not None else None
        except (TypeError, ctypes.ArgumentError):
            address = None
        found = self._by_address.get(address or -1)
        if found is None:
            return INVALID_ARGUMENT, None
        return _FAULT_CODES.get(found.gpu.fault, SUCCESS), found

    def _load(self, gpu: SimGpu) -> float:
        """0..1: where this GPU is in the fleet's load cycle now (0 without a profile)."""
        period = self.fleet.load_period_s
        if not period or gpu.fault is not None:
            return 0.0
        phase = 2 * math.pi * ((time.monotonic() - self._born) / period) + 1.3 * gpu.index
        return 0.5 + 0.5 * math.sin(phase)

    def _ranks(self, gpu: SimGpu) -> list[RankProcess]:
        """nbgpu's own ranks running "on" this simulated GPU (real processes, real RSS)."""
        return [] if gpu.fault is not None else ranks_on_gpus(self.fleet.name).get(gpu.index, [])

    def _memory(self, h: _Handle) -> tuple[int, int, int]:
        """(total, reserved, used) of a device."""
        if h.mig is not None:
            total = h.mig.memory_total_bytes or 0  # None: not captured
            return total, 0, 0
        gpu = h.gpu
        # A load profile fills up to 60 % of the memory nobody else holds, and back.
        free = max(0, gpu.memory_total_bytes - gpu.effective_used_bytes)
        extra = int(0.6 * free * self._load(gpu))
        extra += sum(r.rss_bytes for r in self._ranks(gpu))
        used = min(gpu.effective_used_bytes + extra, gpu.memory_total_bytes)
        return gpu.memory_total_bytes, gpu.memory_reserved_bytes, used

    def _nvmlInitWithFlags(self, _flags: Any = 0) -> int:
        if self.fleet.init_error is not None:
            return INIT_ERRORS[self.fleet.init_error]
        self.initialised += 1
        return SUCCESS

    _nvmlInit_v2 = _nvmlInitWithFlags

    def _nvmlShutdown(self) -> int:
        if not self.initialised:
            return UNINITIALIZED
        self.initialised -= 1
        return SUCCESS

    def _nvmlErrorString(self, code: Any) -> bytes:
        return ERROR_STRINGS.get(int_arg(code), b"Unknown Error")

    _nvmlSystemGetDriverVersion = _system(lambda lib: lib.fleet.driver_version.encode())
    _nvmlSystemGetCudaDriverVersion = _system(lambda lib: lib.fleet.cuda_driver_version)
    _nvmlSystemGetCudaDriverVersion_v2 = _nvmlSystemGetCudaDriverVersion

    def _nvmlSystemGetNVMLVersion(self, buf: Any, _size: Any) -> int:
        buf.value = self.fleet.nvml_version.encode()
        return SUCCESS

    def _nvmlSystemGetProcessName(self, pid: Any, buf: Any, _size: Any) -> int:
        wanted = int_arg(pid)
        for gpu in self.fleet.gpus:
            for proc in gpu.processes:
                if proc.pid == wanted and proc.observed and proc.observed.command:
                    buf.value = proc.observed.command.split()[0].encode()
                    return SUCCESS
        return NOT_FOUND

    # v2 counts every GPU, even those we may not open (cgroup-restricted).
    _nvmlDeviceGetCount_v2 = _system(lambda lib: len(lib.fleet.gpus))
    _nvmlDeviceGetCount = _system(
        lambda lib: sum(1 for g in lib.fleet.gpus if g.fault != "no_permission")
    )

    def _nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        i = int_arg(index)
        physical = [h for h in self._handles if h.mig is None]
        if not 0 <= i < len(physical):
            return INVALID_ARGUMENT
        code = _FAULT_CODES.get(physical[i].gpu.fault, SUCCESS)
        if code == SUCCESS:
            _write_pointer(ref, physical[i].address)
        return code

    _nvmlDeviceGetHandleByIndex = _nvmlDeviceGetHandleByIndex_v2

    def _nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        wanted = (uuid.value if hasattr(uuid, "value") else uuid) or b""
        for handle in self._handles:
            if handle.uuid.encode() == wanted and handle.gpu.fault is None:
                _write_pointer(ref, handle.address)
                return SUCCESS
        return NOT_FOUND

    _nvmlDeviceGetIndex = _number(lambda h: h.gpu.index)

    @_on_device
    def _nvmlDeviceGetName(self, h: _Handle, buf: Any, _size: Any) -> int:
        buf.value = h.name.encode()
        return SUCCESS

    @_on_device
    def _nvmlDeviceGetUUID(self, h: _Handle, buf: Any, _size: Any) -> int:
        buf.value = h.uuid.encode()
        return SUCCESS

    @_on_device
    def _nvmlDeviceGetPciInfo_v3(self, h: _Handle, ref: Any) -> int:
        info = deref(ref)
        bus_id = h.gpu.pci_bus_id
        domain, bus, rest = bus_id.split(":")
        info.busIdLegacy = bus_id[4:].encode()
        info.busId = bus_id.encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        info.pciDeviceId = h.gpu.pci_device_id
        info.pciSubSystemId = 0x145A10DE
        return SUCCESS

    _nvmlDeviceGetPciInfo_v2 = _nvmlDeviceGetPciInfo_v3
    _nvmlDeviceGetPciInfo = _nvmlDeviceGetPciInfo_v3

    _nvmlDeviceGetCudaComputeCapability = _number(lambda h: h.gpu.compute_capability)

    @_on_device
    def _nvmlDeviceGetMemoryInfo(self, h: _Handle, ref: Any) -> int:
        total, _reserved, used = self._memory(h)
        mem = deref(ref)
        mem.total = total
        # v1 folds the driver's reservation into "used", as real drivers do.
        mem.used = min(total, used)
        mem.free = total - mem.used
        return SUCCESS

    @_on_device
    def _nvmlDeviceGetMemoryInfo_v2(self, h: _Handle, ref: Any) -> int:
        total, reserved, used = self._memory(h)
        mem = deref(ref)
        mem.total = total
        mem.reserved = reserved
        mem.used = max(0, used - reserved)
        mem.free = total - reserved - mem.used
        return SUCCESS

    @_on_device
    def _nvmlDeviceGetUtilizationRates(self, h: _Handle, ref: Any) -> int:
        if h.gpu.mig_enabled:
            return NOT_SUPPORTED  # per-GPU utilisation is not reported under MIG
        util = deref(ref)
        load = self._load(h.gpu)
        util.gpu = max(h.gpu.utilization_gpu_pct, round(95 * load))
        util.memory = max(h.gpu.utilization_memory_pct, round(60 * load))
        return SUCCESS

    _nvmlDeviceGetTemperature = _number(lambda h: h.gpu.temperature_c)

    @_on_device
    def _nvmlDeviceGetTemperatureV(self, h: _Handle, ref: Any) -> int:
        # The versioned call newer tools (nvitop) prefer; same reading, struct out.
        deref(ref).temperature = h.gpu.temperature_c
        return SUCCESS

    # P0 under load, P8 idle, as real boards report.
    _nvmlDeviceGetPerformanceState = _number(
        lambda h: 0 if h.gpu.utilization_gpu_pct > 0 or h.gpu.processes else 8
    )
    _nvmlDeviceGetPowerUsage = _number(lambda h: round(h.gpu.power_w * 1000))
    _nvmlDeviceGetEnforcedPowerLimit = _number(lambda h: round(h.gpu.power_limit_w * 1000))
    _nvmlDeviceGetPowerManagementLimit = _nvmlDeviceGetEnforcedPowerLimit
    _nvmlDeviceGetComputeMode = _number(lambda h: COMPUTE_MODES[h.gpu.compute_mode])
    _nvmlDeviceGetPersistenceMode = _number(lambda h: h.gpu.persistence_mode)

    _nvmlDeviceGetTotalEccErrors = _number(lambda h: h.gpu.ecc_uncorrected_volatile)
    _nvmlDeviceGetRetiredPagesPendingStatus = _number(lambda h: h.gpu.retired_pages_pending)
    _nvmlDeviceGetRemappedRows = _number(
        lambda h: None if h.gpu.remapped_rows is None else astuple(h.gpu.remapped_rows)
    )

    # (current, pending): nothing is ever pending here.
    _nvmlDeviceGetMigMode = _number(
        lambda h: None if h.gpu.mig_enabled is None else (h.gpu.mig_enabled,) * 2
    )
    _nvmlDeviceGetMaxMigDeviceCount = _number(
        lambda h: None if h.gpu.mig_enabled is None else len(h.gpu.mig_devices)
    )

    @_on_device
    def _nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, index: Any, ref: Any) -> int:
        i, migs = int_arg(index), h.gpu.mig_devices
        for candidate in self._handles:
            if candidate.gpu is h.gpu and 0 <= i < len(migs) and candidate.mig is migs[i]:
                _write_pointer(ref, candidate.address)
                return SUCCESS
        return NOT_FOUND

    _nvmlDeviceIsMigDeviceHandle = _number(lambda h: h.mig is not None)
    _nvmlDeviceGetGpuInstanceId = _mig_id("gpu_instance_id")
    _nvmlDeviceGetComputeInstanceId = _mig_id("compute_instance_id")

    _nvmlDeviceGetComputeRunningProcesses_v3 = _process_list("compute")
    _nvmlDeviceGetComputeRunningProcesses_v2 = _nvmlDeviceGetComputeRunningProcesses_v3
    _nvmlDeviceGetComputeRunningProcesses = _nvmlDeviceGetComputeRunningProcesses_v3
    _nvmlDeviceGetGraphicsRunningProcesses_v3 = _process_list("graphics")
    _nvmlDeviceGetGraphicsRunningProcesses_v2 = _nvmlDeviceGetGraphicsRunningProcesses_v3
    _nvmlDeviceGetGraphicsRunningProcesses = _nvmlDeviceGetGraphicsRunningProcesses_v3

    @_on_device
    def _nvmlDeviceGetMPSComputeRunningProcesses_v3(self, _h: _Handle, count: Any, _a: Any) -> int:
        deref(count).value = 0
        return SUCCESS

    _nvmlDeviceGetMPSComputeRunningProcesses_v2 = _nvmlDeviceGetMPSComputeRunningProcesses_v3
