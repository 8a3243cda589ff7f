"""The probe's child process: ``python -m nbgpu.devices.health_child``.

It loads the driver (the real ``libcuda.so.1``, or the simulated fleet's library when
``NBGPU_SIMULATE`` is set), creates and at once releases the primary context of each
visible device, and prints one JSON document on stdout. Before each call that can hang it
names the step on stderr, so a parent that kills it at the deadline can say where it hung.
It dies with the process that started it. Never torch, pynvml, psutil or IPython.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from nbgpu._children import die_with_parent
from nbgpu.devices.cuda_driver import CudaCallError, CudaDriver
from nbgpu.devices.cuda_errors import LIBCUDA_SONAME
from nbgpu.devices.sim import simulation_source
from nbgpu.errors import UserInputError

__all__ = ["DOC_FORMAT", "PARENT_ENV", "PROGRESS", "load_cuda_library"]

#: The version of the JSON document the child prints (the parent checks it).
DOC_FORMAT = 1
#: The prefix of the stderr lines naming the step the child is in.
PROGRESS = "nbgpu-probe: "
#: The pid the child must die with.
PARENT_ENV = "NBGPU_PROBE_PARENT"


def load_cuda_library(environ: Mapping[str, str]) -> object:
    """The driver library to call: the simulated one for ``NBGPU_SIMULATE`` (it honours
    *environ*'s ``CUDA_VISIBLE_DEVICES`` as the driver would), else ``libcuda.so.1`` (which
    reads this process's own environment). ``OSError`` when it cannot be loaded (no
    driver), real or simulated; ``FleetSpecError`` for a malformed ``NBGPU_SIMULATE``."""
    source = simulation_source(environ)
    if source is None:
        return ctypes.CDLL(LIBCUDA_SONAME)
    # Imported here: the fleet and CUDA_VISIBLE_DEVICES machinery is only needed simulated.
    from nbgpu.devices.sim.cuda import load_simulated_cuda  # noqa: PLC0415

    return load_simulated_cuda(source, environ)


def _progress(step: str) -> None:
    sys.stderr.write(f"{PROGRESS}{step}\n")
    sys.stderr.flush()


def _probe_in_process(environ: Mapping[str, str]) -> dict[str, Any]:
    """The probe itself: load the driver, init, one context per device. Child only."""
    doc: dict[str, Any] = {
        "format": DOC_FORMAT,
        "simulated": simulation_source(environ) is not None,
        "driver_version": None,
        "init": None,
        "devices": [],
    }
    _progress("loading " + LIBCUDA_SONAME)
    try:
        library = load_cuda_library(environ)
    except OSError as exc:
        doc["init"] = {"stage": "load", "detail": str(exc)}
        return doc
    except UserInputError as exc:  # a bad NBGPU_SIMULATE; the parent checks first
        doc["init"] = {"stage": "NBGPU_SIMULATE", "detail": str(exc)}
        return doc
    return _probe_library(CudaDriver(library), doc)


def _probe_library(driver: CudaDriver, doc: dict[str, Any]) -> dict[str, Any]:
    with contextlib.suppress(CudaCallError):  # a stub answers 34 here too; cuInit says so
        doc["driver_version"] = driver.driver_version()
    _progress("cuInit")
    try:
        driver.init()
        count = driver.device_count()
    except CudaCallError as exc:
        doc["init"] = {
            "stage": exc.function,
            "code": exc.code,
            "name": driver.error_name(exc.code),
            "message": driver.error_string(exc.code),
        }
        return doc
    doc["devices"] = [_probe_device(driver, ordinal) for ordinal in range(count)]
    return doc


def _optional(read: Any, device: int) -> str | None:
    try:
        return str(read(device))
    except CudaCallError:
        return None


def _probe_device(driver: CudaDriver, ordinal: int) -> dict[str, Any]:
    _progress(f"cuda:{ordinal} context")
    record: dict[str, Any] = {"cuda_index": ordinal, "name": None, "uuid": None, "pci_bus_id": None}
    elapsed_ms = 0.0
    try:
        device = driver.device(ordinal)
        record["name"] = _optional(driver.name, device)
        record["uuid"] = _optional(driver.uuid, device)
        record["pci_bus_id"] = _optional(driver.pci_bus_id, device)
        started = time.perf_counter()
        try:
            driver.retain_primary_context(device)
            # Released at once: in exclusive mode the probe itself would otherwise lock the
            # GPU. A failed release is harmless; the context dies with this process.
            with contextlib.suppress(CudaCallError):
                driver.release_primary_context(device)
        finally:
            elapsed_ms = (time.perf_counter() - started) * 1000
        code = 0
    except CudaCallError as exc:
        code = exc.code
    record.update(
        cuda_error=code,
        error_name=driver.error_name(code) if code else None,
        message=(driver.error_string(code) or "") if code else "CUDA context created and released",
        elapsed_ms=round(elapsed_ms, 3),
    )
    return record


def _die_with_parent() -> None:
    """Die with the prober (a kernel killed with -9 while the probe hangs in the driver)."""
    expected = os.environ.get(PARENT_ENV, "")
    # Nowhere to record a refusal: the probe's answer is one JSON line on stdout.
    die_with_parent(signal.SIGKILL, int(expected) if expected.isdigit() else None)


if __name__ == "__main__":
    _die_with_parent()
    sys.stdout.write(json.dumps(_probe_in_process(os.environ)) + "\n")
    sys.stdout.flush()
