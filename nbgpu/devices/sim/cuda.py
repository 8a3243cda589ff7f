"""A fake CUDA driver *library* that serves a :class:`~nbgpu.devices.sim.fleet.Fleet`.

:class:`SimulatedCudaLibrary` stands in for ``ctypes.CDLL("libcuda.so.1")``: its functions
have the driver's names (``cuInit``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``, ...) and
its C calling shape. They receive ctypes objects and ``byref()`` pointers, write results
through them and return ``CUresult`` ints, so :class:`~nbgpu.devices.cuda_driver.CudaDriver`
and the health probe run unchanged on it. Only the hardware is fake.

It behaves as the driver does on that fleet:

- only the devices ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` make visible are
  enumerated, in CUDA order (``visible.resolve_visible``, non-strict: CUDA never complains,
  it just enumerates less); none visible makes ``cuInit`` fail with NO_DEVICE (100);
- GPUs NVML reports as ``no_permission`` (cgroup-restricted) are not enumerated at all:
  CUDA lists only the devices it may open, which is why SLURM jobs see ``cuda:0`` upwards;
- creating a context returns ``SimGpu.effective_cuda_error`` (46 busy, 999 lost, ...);
- the fleet's ``init_error`` makes the machine look driverless: ``library_not_found``
  means the library cannot be loaded at all (:func:`load_simulated_cuda` raises
  ``OSError``), ``driver_not_loaded`` and ``no_permission`` make ``cuInit`` answer
  NO_DEVICE (100), ``lib_rm_version_mismatch`` SYSTEM_DRIVER_MISMATCH (803) and
  ``unknown`` UNKNOWN (999, the container that lost its /dev/nvidia* access);
- ``_v2`` symbols missing from older drivers are missing here too (by the fleet's CUDA
  version, or named in ``missing_functions``): looking them up raises ``AttributeError``
  as ``CDLL`` does.

This module must never import torch, pynvml, psutil or IPython.
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    CUDA_ERROR_UNKNOWN,
    CUDA_ERRORS,
    CUDA_SUCCESS,
    LIBCUDA_SONAME,
)
from nbgpu.devices.model import MigDevice
from nbgpu.devices.sim import simulated_node
from nbgpu.devices.sim.fleet import Fleet, SimGpu
from nbgpu.devices.sim.spec import load_fleet
from nbgpu.devices.visible import GpuIdentity, resolve_visible

__all__ = ["INIT_CUDA_ERRORS", "SimulatedCudaLibrary", "load_simulated_cuda"]

#: What ``cuInit`` returns for each fleet ``init_error`` (``library_not_found`` never gets
#: that far: the library does not load).
INIT_CUDA_ERRORS: Mapping[str, int] = {
    # libcuda is there but /dev/nvidia* is not (module not loaded) or may not be opened:
    # the driver reports no device, the classic "cudaGetDeviceCount returned 100".
    "driver_not_loaded": CUDA_ERROR_NO_DEVICE,
    "no_permission": CUDA_ERROR_NO_DEVICE,
    "lib_rm_version_mismatch": CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    "unknown": CUDA_ERROR_UNKNOWN,
}

# CUDA driver version (cuDriverGetVersion form) that introduced each versioned symbol.
_SYMBOL_SINCE: Mapping[str, int] = {
    "cuDevicePrimaryCtxRelease_v2": 11000,
    "cuDeviceGetUuid_v2": 11040,
}


@dataclass(frozen=True)
class _Device:
    """One logical CUDA device: a whole GPU, or the MIG instance CUDA enumerates."""

    gpu: SimGpu
    mig: MigDevice | None

    @property
    def name(self) -> str:
        return self.mig.name if self.mig else self.gpu.name

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


def _target(ref: Any) -> Any:
    """The ctypes object behind ``byref(obj)`` / ``pointer(obj)``, or the object itself."""
    if hasattr(ref, "_obj"):  # byref() gives a CArgObject holding the original object
        return ref._obj
    if isinstance(ref, ctypes._Pointer):  # ctypes exposes no public pointer base class
        return ref.contents
    return ref


def _int(value: Any) -> int:
    """A C int argument: ``c_int(3)`` or plain ``3`` (CDLL accepts both)."""
    return int(getattr(value, "value", value))


def _write_text(buffer: Any, length: Any, text: str) -> int:
    size = _int(length)
    if buffer is None or size <= 0:
        return CUDA_ERROR_INVALID_VALUE
    data = text.encode("utf-8")[: size - 1]  # the driver truncates and NUL-terminates
    ctypes.memmove(buffer, data + b"\0", len(data) + 1)
    return CUDA_SUCCESS


def _uuid_bytes(text: str) -> bytes:
    """16 bytes of an NVML UUID (``GPU-…`` / ``MIG-…``), as cuDeviceGetUuid writes them."""
    body = text.split("-", 1)[1] if text[:4] in ("GPU-", "MIG-") else text
    try:
        return uuidlib.UUID(body).bytes
    except ValueError:
        # A hand-written fleet UUID that is not hex: still give a stable, distinct id.
        return uuidlib.uuid5(uuidlib.NAMESPACE_URL, "nbgpu:" + text).bytes


def _cuda_bus_id(nvml_bus_id: str) -> str:
    """``00000000:18:00.0`` (NVML) -> ``0000:18:00.0`` (cuDeviceGetPCIBusId)."""
    domain, sep, rest = nvml_bus_id.partition(":")
    if not sep:
        return nvml_bus_id
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return nvml_bus_id


def _identity(gpu: SimGpu) -> GpuIdentity:
    return GpuIdentity(
        nvml_index=gpu.index,
        uuid=gpu.uuid,
        pci_bus_id=gpu.pci_bus_id,
        compute_capability=gpu.compute_capability,
        mig_enabled=bool(gpu.mig_enabled),
        mig_uuids=tuple(m.uuid for m in gpu.mig_devices),
        mig_instance_ids=tuple(
            (m.gpu_instance_id or 0, m.compute_instance_id or 0) for m in gpu.mig_devices
        ),
    )


def _visible_devices(fleet: Fleet, environ: Mapping[str, str]) -> tuple[_Device, ...]:
    openable = [g for g in fleet.gpus if g.fault != "no_permission"]
    visible = resolve_visible([_identity(g) for g in openable], environ)
    by_uuid = {g.uuid: g for g in openable}
    devices = []
    for entry in visible.devices:
        gpu = by_uuid[entry.uuid]
        mig = next((m for m in gpu.mig_devices if m.uuid == entry.mig_uuid), None)
        devices.append(_Device(gpu, mig))
    return tuple(devices)


class SimulatedCudaLibrary:
    """Stands in for ``CDLL("libcuda.so.1")``; see the module docstring."""

    def __init__(self, fleet: Fleet, environ: Mapping[str, str]) -> None:
        self.fleet = fleet
        # The real driver reads CUDA_VISIBLE_DEVICES once, when the process initialises it.
        self.devices = _visible_devices(fleet, environ)
        self.initialized = False
        self.calls: Counter[str] = Counter()  # per symbol: tests check what the probe did
        self.retained: Counter[int] = Counter()  # primary-context references per ordinal
        functions: dict[str, Callable[..., int]] = {
            "cuInit": self._init,
            "cuDriverGetVersion": self._driver_get_version,
            "cuDeviceGetCount": self._device_get_count,
            "cuDeviceGet": self._device_get,
            "cuDeviceGetName": self._device_get_name,
            "cuDeviceGetPCIBusId": self._device_get_pci_bus_id,
            "cuDeviceGetUuid": self._device_get_uuid,
            "cuDeviceGetUuid_v2": self._device_get_uuid,
            "cuDevicePrimaryCtxRetain": self._primary_ctx_retain,
            "cuDevicePrimaryCtxRelease": self._primary_ctx_release,
            "cuDevicePrimaryCtxRelease_v2": self._primary_ctx_release,
            "cuGetErrorName": self._get_error_name,
            "cuGetErrorString": self._get_error_string,
        }
        self._functions = {
            name: function
            for name, function in functions.items()
            if name not in fleet.missing_functions
            and fleet.cuda_driver_version >= _SYMBOL_SINCE.get(name, 0)
        }

    # -- symbol lookup ----------------------------------------------------------

    def __getattr__(self, name: str) -> Callable[..., int]:
        # Only reached for names that are not attributes of the object: the C symbols.
        function = self.__dict__.get("_functions", {}).get(name)
        if function is None:
            raise AttributeError(f"{LIBCUDA_SONAME}: undefined symbol: {name}")

        def call(*args: Any) -> int:
            self.calls[name] += 1
            return int(function(*args))

        call.__name__ = name
        return call

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._functions})

    def _device(self, ordinal: Any) -> _Device | None:
        index = _int(ordinal)
        return self.devices[index] if 0 <= index < len(self.devices) else None

    # -- the driver API -------------------------------------------------------------

    def _init(self, flags: Any) -> int:
        if self.fleet.init_error is not None:
            return INIT_CUDA_ERRORS.get(self.fleet.init_error, CUDA_ERROR_UNKNOWN)
        if _int(flags) != 0:
            return CUDA_ERROR_INVALID_VALUE
        if not self.devices:
            return CUDA_ERROR_NO_DEVICE
        self.initialized = True
        return CUDA_SUCCESS

    def _driver_get_version(self, version: Any) -> int:
        # Answers before cuInit and without a working kernel module, as the real one does:
        # it is the version of the user-space library.
        if version is None:
            return CUDA_ERROR_INVALID_VALUE
        _target(version).value = self.fleet.cuda_driver_version
        return CUDA_SUCCESS

    def _device_get_count(self, count: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        _target(count).value = len(self.devices)
        return CUDA_SUCCESS

    def _device_get(self, device: Any, ordinal: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        if self._device(ordinal) is None:
            return CUDA_ERROR_INVALID_DEVICE
        _target(device).value = _int(ordinal)  # a CUdevice is the ordinal, as in the driver
        return CUDA_SUCCESS

    def _device_get_name(self, buffer: Any, length: Any, device: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        found = self._device(device)
        if found is None:
            return CUDA_ERROR_INVALID_DEVICE
        return _write_text(buffer, length, found.name)

    def _device_get_pci_bus_id(self, buffer: Any, length: Any, device: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        found = self._device(device)
        if found is None:
            return CUDA_ERROR_INVALID_DEVICE
        return _write_text(buffer, length, _cuda_bus_id(found.gpu.pci_bus_id))

    def _device_get_uuid(self, uuid: Any, device: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        found = self._device(device)
        if found is None:
            return CUDA_ERROR_INVALID_DEVICE
        if uuid is None:
            return CUDA_ERROR_INVALID_VALUE
        ctypes.memmove(ctypes.addressof(_target(uuid)), _uuid_bytes(found.uuid), 16)
        return CUDA_SUCCESS

    def _primary_ctx_retain(self, context: Any, device: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        found = self._device(device)
        if found is None:
            return CUDA_ERROR_INVALID_DEVICE
        error = found.gpu.effective_cuda_error
        if error != CUDA_SUCCESS:
            return error
        self.retained[_int(device)] += 1
        # An opaque non-null handle; nobody dereferences it.
        _target(context).value = 0x5EED0000 + _int(device)
        return CUDA_SUCCESS

    def _primary_ctx_release(self, device: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        ordinal = _int(device)
        if self._device(ordinal) is None:
            return CUDA_ERROR_INVALID_DEVICE
        if self.retained[ordinal] <= 0:
            return CUDA_ERROR_INVALID_CONTEXT
        self.retained[ordinal] -= 1
        if not self.retained[ordinal]:
            del self.retained[ordinal]
        return CUDA_SUCCESS

    def _get_error_name(self, code: Any, text: Any) -> int:
        return self._error_text(code, text, 0)

    def _get_error_string(self, code: Any, text: Any) -> int:
        return self._error_text(code, text, 1)

    @staticmethod
    def _error_text(code: Any, text: Any, which: int) -> int:
        # Like the driver: works without cuInit; unknown codes get NULL and INVALID_VALUE.
        entry = CUDA_ERRORS.get(_int(code))
        _target(text).value = entry[which].encode("ascii") if entry else None
        return CUDA_SUCCESS if entry else CUDA_ERROR_INVALID_VALUE


def load_simulated_cuda(source: str, environ: Mapping[str, str]) -> SimulatedCudaLibrary:
    """The simulated driver for fleet ``source`` (an ``NBGPU_SIMULATE`` value).

    Raises ``OSError`` worded as the dynamic loader words it when the fleet has no driver
    library (``init_error = library_not_found``), and ``FleetSpecError`` for a bad source.
    """
    fleet = load_fleet(source, node=simulated_node(environ))
    if fleet.init_error == "library_not_found":
        raise OSError(
            f"{LIBCUDA_SONAME}: cannot open shared object file: No such file or directory"
        )
    return SimulatedCudaLibrary(fleet, environ)
