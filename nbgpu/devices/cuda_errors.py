"""CUDA's error codes and their words: the driver's, the runtime's and torch's.

The real driver binding (``cuda_driver.py``), its simulation (``sim/cuda.py``), the
probe and ``nbgpu.rank`` all speak these codes; keeping them here lets each of those
import the words without importing the others. Standard library only (ranks import it).
"""

from collections.abc import Mapping

__all__ = [
    "CUDA_ERRORS", "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA_ERROR_INVALID_CONTEXT",
    "CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_FOUND",
    "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    "CUDA_ERROR_UNKNOWN", "CUDA_SUCCESS", "LIBCUDA_SONAME", "cuda_version", "error_name",
    "error_string", "ordinal_hint", "torch_cuda_message", "visible_setting",
]  # fmt: skip

#: The driver's own soname, as the dynamic loader's errors quote it. Not the unversioned
#: ``libcuda.so``: in most images that name only exists as the CUDA toolkit's *stub*
#: (``lib64/stubs``), which fails every call.
LIBCUDA_SONAME = "libcuda.so.1"

# CUresult values (cuda.h) that nbgpu tells apart.
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEVICE_UNAVAILABLE = 46
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803
CUDA_ERROR_UNKNOWN = 999

#: ``code -> (cuGetErrorName, cuGetErrorString)`` exactly as the driver words them. Used
#: by the simulated library, and as a fallback when the real one cannot be asked (a stub
#: library answers every call with 34, a missing one not at all).
CUDA_ERRORS: Mapping[int, tuple[str, str]] = {
    CUDA_SUCCESS: ("CUDA_SUCCESS", "no error"),
    CUDA_ERROR_INVALID_VALUE: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    2: ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
    CUDA_ERROR_NOT_INITIALIZED: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    4: ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
    34: ("CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"),
    CUDA_ERROR_DEVICE_UNAVAILABLE: ("CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"),
    CUDA_ERROR_NO_DEVICE: ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
    CUDA_ERROR_INVALID_DEVICE: ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
    CUDA_ERROR_INVALID_CONTEXT: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
    214: ("CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"),
    304: ("CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"),
    CUDA_ERROR_NOT_FOUND: ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    800: ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
    801: ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
    802: ("CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"),
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: ("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"),
    804: ("CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "forward compatibility was attempted on non supported HW"),
    909: ("CUDA_ERROR_TIMEOUT", "wait operation timed out"),
    CUDA_ERROR_UNKNOWN: ("CUDA_ERROR_UNKNOWN", "unknown error"),
}  # fmt: skip

# cudaError_t names (cudaGetErrorName) of the codes a context creation can return. torch
# quotes the *runtime* name in its help line; the driver's CUDA_ERROR_* names differ.
_RUNTIME_ERROR_NAMES: Mapping[int, str] = {
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    46: "cudaErrorDevicesUnavailable",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    214: "cudaErrorECCUncorrectable",
    304: "cudaErrorOperatingSystem",
    800: "cudaErrorNotPermitted",
    801: "cudaErrorNotSupported",
    802: "cudaErrorSystemNotReady",
    803: "cudaErrorSystemDriverMismatch",
    999: "cudaErrorUnknown",
}


def error_name(code: int) -> str | None:
    """CUDA's name for ``code`` from the built-in table (no library needed)."""
    return CUDA_ERRORS.get(code, (None, None))[0]


def error_string(code: int) -> str | None:
    """CUDA's description of ``code`` from the built-in table (no library needed)."""
    return CUDA_ERRORS.get(code, (None, None))[1]


def cuda_version(version: int) -> str:
    """``12040`` (``cuDriverGetVersion``'s and NVML's integer) -> ``12.4``."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def torch_cuda_message(code: int) -> str:
    """The text torch 2.13 raises for a failed CUDA runtime call returning ``code``, as
    ``c10_cuda_check_implementation`` (c10/cuda/CUDAException.cpp) joins it: "CUDA error: "
    + cudaGetErrorString, ``get_cuda_error_help`` (its own sentence for an invalid device,
    else where to look the name up), ``get_cuda_async_error_suffix`` (the
    CUDA_LAUNCH_BLOCKING hint, for asynchronous kernel faults only: never for the context
    and ordinal errors nbgpu raises) and the device-side-assertion line (CUDA builds of 2.13
    always compile it in, disabled at runtime)."""
    # The runtime's strings equal the driver's for every code a context can return.
    text = error_string(code) or "unrecognized error code"
    if code == CUDA_ERROR_INVALID_DEVICE:
        help_line = "GPU device may be out of range, do you have enough GPUs?"
    else:
        name = _RUNTIME_ERROR_NAMES.get(code, "unrecognized error code")
        help_line = (
            f"Search for `{name}' in "
            "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html "
            "for more information."
        )
    return (
        f"CUDA error: {text}\n{help_line}\n"
        "For more detailed error information, run with CUDA_LOG_FILE=stderr\n"
        "Device-side assertion tracking was not enabled by user."
    )


def visible_setting(environ: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES=...`` as a rank's error names it (or that it is unset)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value}"


def ordinal_hint(ordinal: int, count: int, environ: Mapping[str, str]) -> str:
    """nbgpu's line under CUDA's "invalid device ordinal": which setting, what to launch."""
    return (
        f"[nbgpu] local_rank {ordinal} >= {count} visible devices ({visible_setting(environ)}): "
        f"launch at most {count} ranks per node, e.g. %%torchrun {count}"
    )
