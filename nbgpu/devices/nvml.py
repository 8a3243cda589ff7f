"""The one module that imports pynvml (ruff's banned-api rule enforces it).

It chooses the library (the real ``libnvidia-ml.so.1``, or the simulated one when
``NBGPU_SIMULATE`` is set: the seam where ``devices/sim/`` is imported, and only then),
initialises lazily, maps NVML errors to nbgpu's exceptions, says "N/A" per capability,
falls back for old drivers without ``_v2``/``_v3`` symbols, and reads one snapshot of every
GPU into :mod:`nbgpu.devices.model` types. No pynvml object leaves this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pynvml  # noqa: TID251  (this is the one allowed importer)

from nbgpu.devices.model import Gpu, GpuProcess, MigDevice, ObservedProcess, RemappedRows
from nbgpu.devices.sim import simulated_node, simulation_source
from nbgpu.errors import GpuLostError, NvmlError, NvmlPermissionError, NvmlUnavailable

if TYPE_CHECKING:  # the simulation loads only when a fleet is asked for
    from nbgpu.devices.sim.box import Fleet

__all__ = ["Backend", "SystemSnapshot", "activate", "read_system", "reset"]

T = TypeVar("T")

_COMPUTE_MODE_NAMES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

# Codes that mean "NVML as a whole is unusable here", with what a user should read.
_UNAVAILABLE = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "the NVIDIA driver library libnvidia-ml.so.1 was not found",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "driver/library version mismatch: the NVIDIA userspace library was upgraded but the "
        "kernel module was not reloaded"
    ),
    pynvml.NVML_ERROR_UNKNOWN: "NVML failed to initialise (Unknown Error)",
}
_NOT_THERE = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


@dataclass(frozen=True)
class Backend:
    """Which NVML library answers: real hardware or a named simulated fleet."""

    simulated: bool
    fleet: Fleet | None

    # What NVML itself cannot say. On hardware the process table and the inventory
    # answer; a simulated fleet answers from its file, so callers never ask which it is.

    def recorded_process(self, pid: int) -> ObservedProcess | None:
        """What the fleet recorded of *pid* where it was captured; None: look it up here."""
        gpus = self.fleet.gpus if self.fleet is not None else ()
        found = (p.observed for g in gpus for p in g.processes if p.pid == pid and p.observed)
        return next(found, None)

    def nvml_index_by_uuid(self) -> dict[str, int]:
        """NVML index by GPU or MIG UUID, as the fleet knows it (empty on hardware)."""
        gpus = self.fleet.gpus if self.fleet is not None else ()
        uuids = {gpu.uuid: gpu.index for gpu in gpus}
        uuids.update({mig.uuid: gpu.index for gpu in gpus for mig in gpu.mig_devices})
        return uuids


@dataclass(frozen=True)
class SystemSnapshot:
    backend: Backend
    driver_version: str | None
    cuda_driver_version: int | None  # NVML's integer: 12040 means CUDA 12.4
    nvml_version: str | None
    device_count: int
    gpus: tuple[Gpu, ...]


_lock = threading.Lock()
_state: dict[str, Any] = {"key": None, "backend": None, "initialised": False}


def _translate(exc: pynvml.NVMLError, what: str) -> NvmlError:
    code = exc.value
    text = str(exc)
    if code in _UNAVAILABLE:
        return NvmlUnavailable(f"{_UNAVAILABLE[code]} ({what})", code)
    if code in (pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVML_ERROR_OPERATING_SYSTEM):
        return NvmlPermissionError(
            f"NVML refused access ({text}) while reading {what}: the process may lack "
            "permission on /dev/nvidia* (cgroup or container device rules)",
            code,
        )
    if code == pynvml.NVML_ERROR_GPU_IS_LOST:
        return GpuLostError(f"{what}: GPU is lost (fell off the bus, Xid 79)", code)
    return NvmlError(f"NVML error while reading {what}: {text}", code)


def _install(library: Any) -> None:
    # pynvml caches symbols per name; a different library needs a clean cache.
    pynvml.nvmlLib = library
    pynvml._nvmlGetFunctionPointer_cache.clear()
    pynvml._nvmlLib_refcount = 0


def _shutdown() -> None:
    if _state["initialised"]:
        with contextlib.suppress(pynvml.NVMLError):  # a library already gone is fine
            pynvml.nvmlShutdown()


def reset() -> None:
    """Forget the current library and initialisation (tests switch fleets with it)."""
    with _lock:
        _shutdown()
        _state.update(key=None, backend=None, initialised=False)
        _install(None)


def backend_for(environ: Mapping[str, str]) -> Backend:
    """The backend *environ* selects (its ``NBGPU_SIMULATE``; a change of it switches
    library), installed but not initialised. ``FleetSpecError`` for a malformed value."""
    with _lock:
        return _select(environ)


def _select(environ: Mapping[str, str]) -> Backend:
    # Called with _lock held.
    source = simulation_source(environ)
    node = simulated_node(environ) if source else None  # a cluster file: this node's fleet
    if _state["key"] != (source, node):
        _shutdown()
        fleet, library = None, None
        if source:  # the seam: the fake library and its fleet are imported for a simulation only
            from nbgpu.devices.sim.fleet import load_fleet  # noqa: PLC0415
            from nbgpu.devices.sim.nvml import FakeNvmlLibrary  # noqa: PLC0415

            fleet = load_fleet(source, node=node)
            library = FakeNvmlLibrary(fleet)
        _install(library)
        new = Backend(simulated=fleet is not None, fleet=fleet)
        _state.update(key=(source, node), backend=new, initialised=False)
    return cast("Backend", _state["backend"])


def activate(environ: Mapping[str, str]) -> Backend:
    """Initialise NVML once for this environment; raise NvmlError if unusable."""
    with _lock:
        backend = _select(environ)
        if not _state["initialised"]:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                # Leave uninitialised so the next call retries (driver may come back).
                if not backend.simulated:
                    _install(None)
                raise _translate(exc, "initialisation") from None
            _state["initialised"] = True
        return backend


def _query(missing: list[str], name: str, fn: Callable[..., T], *args: Any) -> T | None:
    """Call an NVML getter; NotSupported/absent symbol → None, *name* recorded in *missing*."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        if exc.value in _NOT_THERE:
            missing.append(name)
            return None
        raise


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _ProcessInfoV1(ctypes.Structure):
    # The pre-R470 struct (pid, usedGpuMemory); pynvml no longer defines it.
    _fields_ = (("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong))


def _read_processes_v1(symbol: str, handle: Any) -> list[tuple[int, int | None]]:
    fn = pynvml._nvmlGetFunctionPointer(symbol)
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == pynvml.NVML_SUCCESS:
        return []
    if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
        raise pynvml.NVMLError(ret)
    count.value = count.value * 2 + 5  # room for processes that start meanwhile
    array = (_ProcessInfoV1 * count.value)()
    pynvml._nvmlCheckReturn(fn(handle, ctypes.byref(count), array))
    return [(int(array[i].pid), _used(array[i].usedGpuMemory)) for i in range(count.value)]


def _used(value: int | None) -> int | None:
    if value is None or value == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return int(value)


def _processes(handle: Any, fallbacks: list[str], missing: list[str]) -> tuple[GpuProcess, ...]:
    out: list[GpuProcess] = []
    for kind, symbol in (
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        found: list[tuple[int, int | None]] | None = None
        # Newest struct first; an old driver lacks the symbol (FunctionNotFound).
        for suffix in ("_v3", "_v2", ""):
            try:
                if suffix:
                    procs = getattr(pynvml, symbol + suffix)(handle)
                    found = [(int(p.pid), _used(p.usedGpuMemory)) for p in procs]
                else:
                    found = _read_processes_v1(symbol, handle)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    missing.append(f"{kind} processes")
                    found = []
                    break
                raise
            if suffix != "_v3":
                fallbacks.append(f"{kind} processes via {symbol}{suffix or ' (v1 struct)'}")
            break
        out.extend(GpuProcess(pid=pid, used_bytes=used, kind=kind) for pid, used in found or [])
    return tuple(out)


def _memory(handle: Any, fallbacks: list[str]) -> tuple[int, int, int, int | None]:
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return int(mem.total), int(mem.used), int(mem.free), int(mem.reserved)
    except pynvml.NVMLError as exc:
        if exc.value not in _NOT_THERE:
            raise
    fallbacks.append("memory via nvmlDeviceGetMemoryInfo (v1: reserved memory counted as used)")
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(mem.total), int(mem.used), int(mem.free), None


def _pci_bus_id(handle: Any, fallbacks: list[str]) -> str:
    try:
        return _text(pynvml.nvmlDeviceGetPciInfo_v3(handle).busId)
    except pynvml.NVMLError as exc:
        if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
    for symbol in ("nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo"):
        try:
            fn = pynvml._nvmlGetFunctionPointer(symbol)
        except pynvml.NVMLError:
            continue
        # The v3 struct is a superset of the older layouts, so it is a safe buffer.
        info = pynvml.nvmlPciInfo_t()
        pynvml._nvmlCheckReturn(fn(handle, ctypes.byref(info)))
        fallbacks.append(f"PCI info via {symbol}")
        return _text(info.busId)
    raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def _mig(handle: Any, missing: list[str]) -> tuple[bool | None, tuple[MigDevice, ...]]:
    mode = _query(missing, "MIG", pynvml.nvmlDeviceGetMigMode, handle)
    if mode is None:
        return None, ()
    if not mode[0]:
        return False, ()
    children = []
    count = _query(missing, "MIG", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
    for i in range(count):
        try:
            child = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_NOT_FOUND:
                continue  # an unpopulated slot
            raise
        sub: list[str] = []
        mem = _query(sub, "memory", pynvml.nvmlDeviceGetMemoryInfo, child)
        children.append(
            MigDevice(
                uuid=_text(pynvml.nvmlDeviceGetUUID(child)),
                name=_text(pynvml.nvmlDeviceGetName(child)),
                memory_total_bytes=int(mem.total) if mem is not None else None,
                gpu_instance_id=_query(sub, "gi", pynvml.nvmlDeviceGetGpuInstanceId, child),
                compute_instance_id=_query(sub, "ci", pynvml.nvmlDeviceGetComputeInstanceId, child),
            )
        )
    return True, tuple(children)


def _read_gpu(index: int) -> Gpu:
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            return Gpu(nvml_index=index, error="lost")
        if exc.value in (pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVML_ERROR_OPERATING_SYSTEM):
            return Gpu(nvml_index=index, error="no_permission")
        return Gpu(nvml_index=index, error=str(exc))
    missing: list[str] = []
    fallbacks: list[str] = []

    def ask(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        return _query(missing, name, fn, handle, *args)

    try:
        total, used, free, reserved = _memory(handle, fallbacks)
        util = ask("utilisation", pynvml.nvmlDeviceGetUtilizationRates)
        temp = ask("temperature", pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
        power = ask("power", pynvml.nvmlDeviceGetPowerUsage)
        limit = ask("power limit", pynvml.nvmlDeviceGetEnforcedPowerLimit)
        mode = ask("compute mode", pynvml.nvmlDeviceGetComputeMode)
        persistence = ask("persistence", pynvml.nvmlDeviceGetPersistenceMode)
        uncorrected = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        ecc = ask("ECC", pynvml.nvmlDeviceGetTotalEccErrors, *uncorrected)
        rows = ask("remapped rows", pynvml.nvmlDeviceGetRemappedRows)
        retired = ask("retired pages", pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
        cc = ask("compute capability", pynvml.nvmlDeviceGetCudaComputeCapability)
        mig_enabled, migs = _mig(handle, missing)
        return Gpu(
            nvml_index=index,
            name=_text(pynvml.nvmlDeviceGetName(handle)),
            uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            pci_bus_id=_pci_bus_id(handle, fallbacks),
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            memory_reserved_bytes=reserved,
            utilization_gpu_pct=None if util is None else int(util.gpu),
            utilization_memory_pct=None if util is None else int(util.memory),
            temperature_c=temp,
            power_w=None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0,
            compute_mode=None if mode is None else _COMPUTE_MODE_NAMES.get(mode, f"mode {mode}"),
            persistence_mode=None if persistence is None else bool(persistence),
            mig_enabled=mig_enabled,
            mig_devices=migs,
            ecc_uncorrected_volatile=ecc,
            remapped_rows=None
            if rows is None
            else RemappedRows(int(rows[0]), int(rows[1]), bool(rows[2]), bool(rows[3])),
            retired_pages_pending=None if retired is None else bool(retired),
            compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
            processes=_processes(handle, fallbacks, missing),
            unsupported=tuple(dict.fromkeys(missing)),
            fallbacks=tuple(dict.fromkeys(fallbacks)),
        )
    except pynvml.NVMLError as exc:
        # A GPU can be lost between calls; report it instead of failing the snapshot.
        if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
            return Gpu(nvml_index=index, error="lost")
        return Gpu(nvml_index=index, error=str(exc))


def read_system(environ: Mapping[str, str]) -> SystemSnapshot:
    """One snapshot of the driver and every GPU. Raises NvmlError if NVML is unusable."""
    backend = activate(environ)
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        raise _translate(exc, "the driver") from None
    # Very old drivers cannot say these: they are then simply unknown.
    cuda: int | None = None
    nvml_version: str | None = None
    with contextlib.suppress(pynvml.NVMLError):
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
    with contextlib.suppress(pynvml.NVMLError):
        nvml_version = _text(pynvml.nvmlSystemGetNVMLVersion())
    gpus = tuple(_read_gpu(i) for i in range(count))
    return SystemSnapshot(backend, driver, cuda, nvml_version, count, gpus)
