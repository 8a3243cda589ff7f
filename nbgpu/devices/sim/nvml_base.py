"""The fake NVML library's frame: return codes, ctypes plumbing, handles, the system.

pynvml looks each symbol up by name: unknown names answer ``NOT_SUPPORTED`` unless the
fleet removed them (an old driver), so :class:`FakeLibraryBase` dispatches by name. Here
too: initialisation (and its scenario failures), the driver's versions, device counts
and handles, names, UUIDs, PCI and compute capability. ``nvml.py`` adds the sensors,
modes, MIG and processes. Never imports pynvml, psutil or IPython.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

from nbgpu.devices.model import INIT_ERRORS
from nbgpu.devices.sim.fleet import Fleet, SimGpu

__all__ = [
    "ERROR_STRINGS",
    "GPU_IS_LOST",
    "INSUFFICIENT_SIZE",
    "INVALID_ARGUMENT",
    "NOT_AVAILABLE_U64",
    "NOT_FOUND",
    "NOT_MIG",
    "NOT_SUPPORTED",
    "NO_PERMISSION",
    "SUCCESS",
    "UNINITIALIZED",
    "UNKNOWN",
    "FakeLibraryBase",
    "Handle",
    "address_of",
    "device_number",
    "store",
    "target",
    "write_pointer",
]

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
    UNKNOWN: b"Unknown Error",
}


def target(ref: Any) -> Any:
    """The ctypes object behind ``byref(obj)`` (or the object itself)."""
    return getattr(ref, "_obj", ref)


def store(ref: Any, value: Any) -> None:
    target(ref).value = value


def write_pointer(ref: Any, address: int) -> None:
    # pynvml's device handle is a ctypes POINTER; write the raw address into it so
    # the wrapper hands our opaque token back to us on the next call.
    slot = target(ref)
    ctypes.memmove(
        ctypes.addressof(slot),
        ctypes.byref(ctypes.c_void_p(address)),
        ctypes.sizeof(ctypes.c_void_p),
    )


def address_of(handle: Any) -> int | None:
    if handle is None:
        return None
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class Handle:
    """One device handle: a physical GPU, or one MIG instance of it."""

    def __init__(self, gpu: SimGpu, mig: int | None) -> None:
        self.gpu = gpu
        self.mig = mig
        # A real allocation gives each handle an address no other object shares.
        self.token = ctypes.create_string_buffer(8)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.token)


def device_number(read: Callable[[Handle], int | None]) -> Callable[..., int]:
    """An NVML getter of one number about a device, written through its last argument
    (``nvmlDeviceGetX(handle, [...,] ref)``); None from *read*: NOT_SUPPORTED."""

    def query(self: FakeLibraryBase, handle: Any, *args: Any) -> int:
        code, h = self._device(handle)
        if h is None:
            return code
        value = read(h)
        if value is None:
            return NOT_SUPPORTED
        store(args[-1], value)
        return SUCCESS

    return query


class FakeLibraryBase:
    """Stands in for ``CDLL("libnvidia-ml.so.1")``; see the module docstring."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._born = time.monotonic()  # the load profile's clock
        self.initialised = 0
        self.calls = 0  # how many NVML calls were made: benchmarks and tests read it
        self._handles: list[Handle] = []
        self._by_address: dict[int, Handle] = {}
        for gpu in fleet.gpus:
            self._add(Handle(gpu, None))
            for mig_index in range(len(gpu.mig_devices)):
                self._add(Handle(gpu, mig_index))

    def _add(self, handle: Handle) -> None:
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
            impl = FakeLibraryBase._not_supported
        bound: Callable[..., Any] = impl.__get__(self, type(self))

        def call(*args: Any) -> Any:
            self.calls += 1
            return bound(*args)

        call.__name__ = name
        return call

    def _not_supported(self, *_args: Any) -> int:
        return NOT_SUPPORTED if self.initialised else UNINITIALIZED

    def _device(self, handle: Any) -> tuple[int, Handle | None]:
        """Resolve a handle to (return code, handle); code != 0 means answer it."""
        if not self.initialised:
            return UNINITIALIZED, None
        found = self._by_address.get(address_of(handle) or -1)
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
        return ERROR_STRINGS.get(value, b"Unknown Error")

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
        store(ref, self.fleet.cuda_driver_version)
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
        store(ref, len(self.fleet.gpus))
        return SUCCESS

    def _nvmlDeviceGetCount(self, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        store(ref, sum(1 for g in self.fleet.gpus if g.fault != "no_permission"))
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
        write_pointer(ref, handle.address)
        return SUCCESS

    _nvmlDeviceGetHandleByIndex = _nvmlDeviceGetHandleByIndex_v2

    def _nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        wanted = (uuid.value if hasattr(uuid, "value") else uuid) or b""
        for handle in self._handles:
            if self._uuid(handle).encode() == wanted and handle.gpu.fault is None:
                write_pointer(ref, handle.address)
                return SUCCESS
        return NOT_FOUND

    _nvmlDeviceGetIndex = device_number(lambda h: h.gpu.index)

    # -- identity ----------------------------------------------------------------

    @staticmethod
    def _uuid(handle: Handle) -> str:
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
        info = target(ref)
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
        store(major, h.gpu.compute_capability[0])
        store(minor, h.gpu.compute_capability[1])
        return SUCCESS

    # -- memory, utilisation, sensors ------------------------------------------
