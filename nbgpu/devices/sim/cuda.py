"""A fake CUDA driver *library* serving a :class:`~nbgpu.devices.sim.box.Fleet`, and
what CUDA answers nbgpu's ranks on a simulated fleet.

:class:`SimulatedCudaLibrary` has the symbols and C calling shape of
``ctypes.CDLL("libcuda.so.1")``, so :class:`~nbgpu.devices.cuda_driver.CudaDriver` and the
probe run unchanged on it. It enumerates only what ``CUDA_VISIBLE_DEVICES`` /
``CUDA_DEVICE_ORDER`` make visible, never a cgroup-restricted GPU (so SLURM jobs see
``cuda:0`` upwards); ``_v2`` symbols an older driver lacks are missing here too.
:func:`simulated_device` is what CUDA answers a rank (``nbgpu.rank.device()``): CUDA's
code and one ``[nbgpu]`` line naming the physical GPU that refused, or a label for
computing on the CPU. Never imports torch, pynvml or IPython.
"""

from __future__ import annotations

import contextlib
import ctypes
import uuid as uuidlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partialmethod
from typing import Any

from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_DEVICE_UNAVAILABLE,
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
    error_name,
    ordinal_hint,
)
from nbgpu.devices.sim import simulated_node
from nbgpu.devices.sim.box import Device, Fleet, SimGpu, deref, int_arg
from nbgpu.devices.sim.fleet import load_fleet
from nbgpu.devices.visible import GpuIdentity, resolve_visible

__all__ = ["SimulatedCudaLibrary", "SimulatedDevice", "load_simulated_cuda", "simulated_device"]

# What ``cuInit`` returns for each fleet ``init_error`` (``library_not_found`` never gets
# that far: the library does not load).
_INIT_ERRORS: Mapping[str, int] = {
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


def _write_text(buffer: Any, length: Any, text: str) -> int:
    size = int_arg(length)
    if buffer is None or size <= 0:
        return CUDA_ERROR_INVALID_VALUE
    data = text.encode("utf-8")[: size - 1]  # the driver truncates and NUL-terminates
    ctypes.memmove(buffer, data + b"\0", len(data) + 1)
    return CUDA_SUCCESS


def _uuid_bytes(text: str) -> bytes:
    """16 bytes of an NVML UUID (``GPU-…`` / ``MIG-…``), as cuDeviceGetUuid writes them."""
    body = text.split("-", 1)[1] if text[:4] in ("GPU-", "MIG-") else text
    with contextlib.suppress(ValueError):
        return uuidlib.UUID(body).bytes
    # A hand-written fleet UUID that is not hex: still give a stable, distinct id.
    return uuidlib.uuid5(uuidlib.NAMESPACE_URL, "nbgpu:" + text).bytes


def _cuda_bus_id(nvml_bus_id: str) -> str:
    """``00000000:18:00.0`` (NVML) -> ``0000:18:00.0`` (cuDeviceGetPCIBusId)."""
    domain, sep, rest = nvml_bus_id.partition(":")
    if not sep:
        return nvml_bus_id
    with contextlib.suppress(ValueError):
        return f"{int(domain, 16):04x}:{rest}"
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


def _visible_devices(fleet: Fleet, environ: Mapping[str, str]) -> tuple[Device, ...]:
    openable = [g for g in fleet.gpus if g.fault != "no_permission"]
    visible = resolve_visible([_identity(g) for g in openable], environ)
    by_uuid = {g.uuid: g for g in openable}
    migs = {m.uuid: m for g in openable for m in g.mig_devices}
    return tuple(Device(by_uuid[e.uuid], migs.get(e.mig_uuid or "")) for e in visible.devices)


def _on_device(method: Callable[..., int]) -> Callable[..., int]:
    """A driver call about one device, its last argument: after cuInit, a real ordinal."""

    def call(self: SimulatedCudaLibrary, *args: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        ordinal = int_arg(args[-1])
        if not 0 <= ordinal < len(self.devices):
            return CUDA_ERROR_INVALID_DEVICE
        return method(self, self.devices[ordinal], ordinal, *args[:-1])

    return call


class SimulatedCudaLibrary:
    def __init__(self, fleet: Fleet, environ: Mapping[str, str]) -> None:
        self.fleet = fleet
        # The real driver reads CUDA_VISIBLE_DEVICES once, when the process initialises it.
        self.devices = _visible_devices(fleet, environ)
        self.initialized = False
        self.calls: Counter[str] = Counter()  # per symbol: tests check what the probe did
        self.retained: Counter[int] = Counter()  # primary-context references per ordinal

    def _exports(self, name: str) -> bool:
        """Whether this driver has symbol *name* (``_v2`` ones by the fleet's CUDA version)."""
        fleet: Fleet | None = self.__dict__.get("fleet")  # not yet set while unpickling
        return (
            fleet is not None
            and hasattr(type(self), "_" + name)
            and name.startswith("cu")
            and name not in fleet.missing_functions
            and fleet.cuda_driver_version >= _SYMBOL_SINCE.get(name, 0)
        )

    def __getattr__(self, name: str) -> Callable[..., int]:
        # Only reached for the C symbols (not attributes), each served by ``_<name>``.
        if not self._exports(name):
            raise AttributeError(f"{LIBCUDA_SONAME}: undefined symbol: {name}")
        function = getattr(self, "_" + name)

        def call(*args: Any) -> int:
            self.calls[name] += 1
            return int(function(*args))

        call.__name__ = name
        return call

    def _cuInit(self, flags: Any) -> int:
        if self.fleet.init_error is not None:
            return _INIT_ERRORS.get(self.fleet.init_error, CUDA_ERROR_UNKNOWN)
        if int_arg(flags) != 0:
            return CUDA_ERROR_INVALID_VALUE
        if not self.devices:
            return CUDA_ERROR_NO_DEVICE
        self.initialized = True
        return CUDA_SUCCESS

    def _cuDriverGetVersion(self, version: Any) -> int:
        # Answers before cuInit and without a working kernel module, as the real one does:
        # it is the version of the user-space library.
        if version is None:
            return CUDA_ERROR_INVALID_VALUE
        deref(version).value = self.fleet.cuda_driver_version
        return CUDA_SUCCESS

    def _cuDeviceGetCount(self, count: Any) -> int:
        if not self.initialized:
            return CUDA_ERROR_NOT_INITIALIZED
        deref(count).value = len(self.devices)
        return CUDA_SUCCESS

    @_on_device
    def _cuDeviceGet(self, _found: Device, ordinal: int, device: Any) -> int:
        deref(device).value = ordinal  # a CUdevice is the ordinal, as in the driver
        return CUDA_SUCCESS

    @_on_device
    def _cuDeviceGetName(self, found: Device, _ordinal: int, buffer: Any, length: Any) -> int:
        return _write_text(buffer, length, found.name)

    @_on_device
    def _cuDeviceGetPCIBusId(self, found: Device, _ordinal: int, buffer: Any, length: Any) -> int:
        return _write_text(buffer, length, _cuda_bus_id(found.gpu.pci_bus_id))

    @_on_device
    def _cuDeviceGetUuid(self, found: Device, _ordinal: int, uuid: Any) -> int:
        if uuid is None:
            return CUDA_ERROR_INVALID_VALUE
        ctypes.memmove(ctypes.addressof(deref(uuid)), _uuid_bytes(found.uuid), 16)
        return CUDA_SUCCESS

    @_on_device
    def _cuDevicePrimaryCtxRetain(self, found: Device, ordinal: int, context: Any) -> int:
        error = found.gpu.effective_cuda_error
        if error != CUDA_SUCCESS:
            return error
        self.retained[ordinal] += 1
        deref(context).value = 0x5EED0000 + ordinal  # opaque and non-null; never read
        return CUDA_SUCCESS

    @_on_device
    def _cuDevicePrimaryCtxRelease(self, _found: Device, ordinal: int) -> int:
        if self.retained[ordinal] <= 0:
            return CUDA_ERROR_INVALID_CONTEXT
        self.retained -= Counter([ordinal])  # drops the ordinal at zero
        return CUDA_SUCCESS

    _cuDeviceGetUuid_v2 = _cuDeviceGetUuid
    _cuDevicePrimaryCtxRelease_v2 = _cuDevicePrimaryCtxRelease

    def _error_text(self, code: Any, text: Any, which: int) -> int:
        # Like the driver: works without cuInit; unknown codes get NULL and INVALID_VALUE.
        entry = CUDA_ERRORS.get(int_arg(code))
        deref(text).value = entry[which].encode("ascii") if entry else None
        return CUDA_SUCCESS if entry else CUDA_ERROR_INVALID_VALUE

    _cuGetErrorName = partialmethod(_error_text, which=0)
    _cuGetErrorString = partialmethod(_error_text, which=1)


def load_simulated_cuda(source: str, environ: Mapping[str, str]) -> SimulatedCudaLibrary:
    """The simulated driver for fleet ``source`` (an ``NBGPU_SIMULATE`` value); ``OSError``
    worded as the dynamic loader words it when the fleet has no driver library."""
    fleet = load_fleet(source, node=simulated_node(environ))
    if fleet.init_error == "library_not_found":
        raise OSError(
            f"{LIBCUDA_SONAME}: cannot open shared object file: No such file or directory"
        )
    return SimulatedCudaLibrary(fleet, environ)


@dataclass(frozen=True)
class SimulatedDevice:
    """CUDA's answer for one rank: a refusal to raise, or a label for running on CPU."""

    cuda_error: int | None  # the CUresult torch would raise for; None: compute on CPU
    line: str  # the [nbgpu] line: under the error, or the label said once on stderr


def simulated_device(source: str, ordinal: int, environ: Mapping[str, str]) -> SimulatedDevice:
    """What creating the context of ``cuda:ordinal`` gives on fleet ``source``."""
    try:
        library = load_simulated_cuda(source, environ)
    except OSError as exc:
        # No libcuda: torch.cuda.is_available() is False and torch runs on the CPU.
        return _on_cpu(f"simulated fleet {source!r}: no CUDA driver ({exc})")
    fleet = library.fleet
    said = f"[nbgpu] simulated fleet {fleet.name!r}:"
    code = library.cuInit(0)
    if code != CUDA_SUCCESS:
        # cuInit failing makes torch.cuda.is_available() False: torch falls back to CPU.
        return _on_cpu(
            f"simulated fleet {fleet.name!r}: CUDA is unavailable ({error_name(code) or code})"
        )
    count = len(library.devices)
    if ordinal >= count:
        hint = ordinal_hint(ordinal, count, environ)
        return SimulatedDevice(CUDA_ERROR_INVALID_DEVICE, hint.replace("[nbgpu]", said, 1))
    target = library.devices[ordinal]
    code = library.cuDevicePrimaryCtxRetain(ctypes.c_void_p(), ordinal)
    if code != CUDA_SUCCESS:
        gpu = target.gpu
        what = f"cuda:{ordinal} is physical GPU {gpu.index} ({gpu.uuid})"
        if target.mig is not None:
            what += f" as MIG instance {target.mig.uuid}"
        return SimulatedDevice(code, f"{said} {what}, {_refusal(gpu, code)}: see %gpu_doctor")
    return _on_cpu(
        f"simulated fleet {fleet.name!r}: cuda:{ordinal} -> GPU {target.gpu.index} ({target.name})"
    )


def _on_cpu(what: str) -> SimulatedDevice:
    return SimulatedDevice(None, f"[nbgpu] {what}; computing on CPU")


def _refusal(gpu: SimGpu, code: int) -> str:
    """Why a simulated GPU refuses a context, in the words of nvidia-smi's columns."""
    if code == CUDA_ERROR_DEVICE_UNAVAILABLE and gpu.compute_mode == "prohibited":
        return "compute mode prohibited"
    if code == CUDA_ERROR_DEVICE_UNAVAILABLE and gpu.processes:
        holders = ", ".join(
            f"{p.pid} ({p.observed.state})" if p.observed else str(p.pid) for p in gpu.processes
        )
        mode = gpu.compute_mode.replace("_", "-")
        return f"{mode}, held by pid{'s' if len(gpu.processes) > 1 else ''} {holders}"
    if code == CUDA_ERROR_UNKNOWN and gpu.fault == "lost":
        return "which has fallen off the bus (Xid 79)"
    return f"which refuses a CUDA context (CUDA error {code})"
