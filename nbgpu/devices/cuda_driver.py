"""A thin ctypes binding of the CUDA *driver* API (``libcuda.so.1``), for the health probe.

:class:`CudaDriver` makes the probe's few C-shaped calls on a library object: the real
``ctypes.CDLL("libcuda.so.1")`` or the fake of ``sim/cuda.py``, which it never imports.
The contexts it creates hold a GPU: it is for the probe's short-lived child, never for the
Jupyter kernel. Never imports torch, pynvml, psutil or IPython.
"""

import ctypes
import uuid as uuidlib
from typing import Any

from nbgpu.devices.cuda_errors import CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, error_name, error_string

__all__ = ["CUuuid", "CudaCallError", "CudaDriver"]

# Large enough for any device name / bus id the driver writes (cuda.h uses 256 / 13+).
_NAME_BYTES = 256
_BUS_ID_BYTES = 64


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CudaCallError(Exception):
    """A driver call returned a CUresult other than CUDA_SUCCESS. Caught inside the probe
    process, which reports codes as outcomes: never a user's, so not in ``nbgpu.errors``."""

    def __init__(self, function: str, code: int) -> None:
        super().__init__(f"{function} returned {code} ({error_name(code) or 'unknown code'})")
        self.function = function
        self.code = code


class CudaDriver:
    """Python-shaped calls on a driver library; :class:`CudaCallError` when the driver refuses."""

    def __init__(self, library: object) -> None:
        self.library = library

    def _newest(self, function: str) -> str:
        """``function``'s ``_v2`` when the library exports it (old drivers lack it)."""
        return function + "_v2" if hasattr(self.library, function + "_v2") else function

    def _call(self, function: str, *args: Any) -> None:
        try:
            entry = getattr(self.library, function)
        except AttributeError:
            raise CudaCallError(function, CUDA_ERROR_NOT_FOUND) from None
        code = int(entry(*args))
        if code != CUDA_SUCCESS:
            raise CudaCallError(function, code)

    def init(self) -> None:
        self._call("cuInit", ctypes.c_uint(0))

    def driver_version(self) -> int:
        """The CUDA version the driver supports, e.g. 12040; works before ``cuInit``."""
        version = ctypes.c_int(0)
        self._call("cuDriverGetVersion", ctypes.byref(version))
        return version.value

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def device(self, ordinal: int) -> int:
        """The ``CUdevice`` handle (an int in cuda.h) of logical device ``ordinal``."""
        device = ctypes.c_int(-1)
        self._call("cuDeviceGet", ctypes.byref(device), ctypes.c_int(ordinal))
        return device.value

    def name(self, device: int) -> str:
        buffer = ctypes.create_string_buffer(_NAME_BYTES)
        self._call("cuDeviceGetName", buffer, ctypes.c_int(_NAME_BYTES), ctypes.c_int(device))
        return buffer.value.decode("utf-8", errors="replace")

    def pci_bus_id(self, device: int) -> str:
        """CUDA's form, ``0000:18:00.0`` (NVML writes an 8-digit domain)."""
        buffer = ctypes.create_string_buffer(_BUS_ID_BYTES)
        self._call("cuDeviceGetPCIBusId", buffer, ctypes.c_int(_BUS_ID_BYTES), ctypes.c_int(device))
        return buffer.value.decode("ascii", errors="replace")

    def uuid(self, device: int) -> str:
        """The 16 UUID bytes as ``xxxxxxxx-xxxx-...``, without NVML's ``GPU-``/``MIG-``;
        ``_v2`` (CUDA 11.4+) when exported, which gives a MIG instance's own UUID."""
        raw = CUuuid()
        self._call(self._newest("cuDeviceGetUuid"), ctypes.byref(raw), ctypes.c_int(device))
        return str(uuidlib.UUID(bytes=bytes(raw.bytes)))

    def retain_primary_context(self, device: int) -> None:
        """Create (or share) the device's primary context: what torch's first CUDA call does."""
        context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), ctypes.c_int(device))

    def release_primary_context(self, device: int) -> None:
        # cuda.h maps the unversioned name to _v2 since CUDA 11; older drivers have only v1.
        self._call(self._newest("cuDevicePrimaryCtxRelease"), ctypes.c_int(device))

    def error_name(self, code: int) -> str | None:
        return self._error_text("cuGetErrorName", code) or error_name(code)

    def error_string(self, code: int) -> str | None:
        return self._error_text("cuGetErrorString", code) or error_string(code)

    def _error_text(self, function: str, code: int) -> str | None:
        text = ctypes.c_char_p()
        try:
            self._call(function, ctypes.c_int(code), ctypes.byref(text))
        except CudaCallError:
            return None
        return text.value.decode("utf-8", errors="replace") if text.value else None
