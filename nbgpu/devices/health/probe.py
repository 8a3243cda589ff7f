"""The probe's parent side: start the child against a deadline, read its answer.

:func:`probe_devices` runs ``python -m nbgpu.devices.health.child`` with the caller's
environment (so ``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER`` and ``NBGPU_SIMULATE``
apply), in its own session, with a deadline (``nbgpu._deadline``). A hung driver is a real
failure mode: past the deadline the whole process group is killed and the report says so
in one line. Devices are matched back to NVML indices by UUID. The parent never loads
libcuda.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from nbgpu._deadline import Finished, run_with_deadline
from nbgpu._lineage import with_package_importable
from nbgpu.devices.cuda_errors import LIBCUDA_SONAME, error_name, error_string
from nbgpu.devices.health.child import DOC_FORMAT, PARENT_ENV, PROGRESS
from nbgpu.devices.health.report import ProbeReport, ProbeResult, outcome_for
from nbgpu.errors import ProbeError, UserInputError

__all__ = ["probe_devices"]

_CHILD_MODULE = "nbgpu.devices.health.child"


def probe_devices(
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    nvml_index_by_uuid: Mapping[str, int] | None = None,
) -> ProbeReport:
    """Create and release one CUDA context per visible device, in a subprocess.

    ``environ`` (default ``os.environ``) is the environment the probe runs in: its
    ``CUDA_VISIBLE_DEVICES`` decides which devices are probed, ``NBGPU_SIMULATE`` makes it
    probe a simulated fleet. ``nvml_index_by_uuid`` (NVML UUID -> NVML index, as an
    inventory knows it) matches results back to physical GPUs; simulated, the fleet gives it.

    Never raises for a GPU or driver problem: those are outcomes. Raises ``FleetSpecError``
    for a malformed ``NBGPU_SIMULATE``, ``UserInputError`` for a bad timeout, and
    ``ProbeError`` if the probe process cannot be started at all.
    """
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise UserInputError(f"probe timeout {timeout_s!r}; expected a positive number of seconds")
    env = dict(os.environ if environ is None else environ)
    from nbgpu.devices.nvml import backend_for  # noqa: PLC0415  (loads pynvml)

    # The backend also validates NBGPU_SIMULATE here, so a typo is a one-line
    # FleetSpecError, not a failed subprocess.
    backend = backend_for(env)
    if nvml_index_by_uuid is None:
        nvml_index_by_uuid = backend.nvml_index_by_uuid()
    run = _run_child(
        [sys.executable, "-m", _CHILD_MODULE], _child_environ(env), timeout_s=timeout_s
    )
    return _report(run, timeout_s, simulated=backend.simulated, uuids=nvml_index_by_uuid or {})


def _run_child(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float) -> Finished:
    """Run the probe process against the deadline; ``ProbeError`` if it cannot start."""
    try:
        return run_with_deadline(argv, env, timeout_s=timeout_s)
    except OSError as exc:
        raise ProbeError(
            f"cannot start the CUDA probe process {argv[0]!r}: {exc.strerror or exc}"
        ) from None


def _child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    env = with_package_importable(environ)
    env[PARENT_ENV] = str(os.getpid())
    return env


def _uuid_body(uuid: str) -> str:
    return (uuid[4:] if uuid[:4] in ("GPU-", "MIG-") else uuid).lower()


def _report(
    run: Finished, timeout_s: float, *, simulated: bool, uuids: Mapping[str, int]
) -> ProbeReport:
    def report(
        results: tuple[ProbeResult, ...] = (),
        *,
        driver_version: int | None = None,
        init_error: str | None = None,
        init_outcome: str | None = None,
        timed_out: bool = False,
    ) -> ProbeReport:
        return ProbeReport(
            results=results,
            driver_version=driver_version,
            init_error=init_error,
            init_outcome=init_outcome,
            simulated=simulated,
            timed_out=timed_out,
            elapsed_ms=run.elapsed_ms,
        )

    stderr = run.stderr.decode("utf-8", errors="replace")
    if run.timed_out:
        steps = [line[len(PROGRESS) :] for line in stderr.splitlines() if line.startswith(PROGRESS)]
        where = f" (stuck in {steps[-1]})" if steps else ""
        message = (
            f"the CUDA probe did not finish within {timeout_s:g} s{where}; its process group "
            "was killed"
        )
        if run.returncode is None:
            message += f", but pid {run.pid} is still in the driver (uninterruptible sleep)"
        return report(init_error=message, init_outcome="timeout", timed_out=True)
    doc = _last_json(run.stdout)
    if doc is None or doc.get("format") != DOC_FORMAT:
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        how = (
            f"was killed by {_signal_name(-run.returncode)}"
            if run.returncode is not None and run.returncode < 0
            else f"exited with code {run.returncode} without a report"
        )
        message = f"the CUDA probe process {how}: {last.strip() or 'no output'}"
        return report(init_error=message, init_outcome="error")
    init = doc.get("init")
    driver_version = doc.get("driver_version")
    if init is not None:
        message, outcome = _init_failure(init)
        return report(driver_version=driver_version, init_error=message, init_outcome=outcome)
    by_body = {_uuid_body(full): (full, index) for full, index in uuids.items()}
    results = []
    for device in doc.get("devices", []):
        uuid, nvml_index = None, None
        if device.get("uuid"):
            # CUDA gives bare UUID bytes; NVML's prefix tells a GPU from a MIG instance.
            uuid, nvml_index = by_body.get(device["uuid"].lower(), ("GPU-" + device["uuid"], None))
        code = int(device["cuda_error"])
        results.append(
            ProbeResult(
                cuda_index=int(device["cuda_index"]),
                nvml_index=nvml_index,
                uuid=uuid,
                name=device.get("name"),
                outcome=outcome_for(code),
                cuda_error=code,
                error_name=device.get("error_name"),
                message=device.get("message") or "",
                elapsed_ms=float(device.get("elapsed_ms", 0.0)),
                pci_bus_id=device.get("pci_bus_id"),
            )
        )
    return report(tuple(results), driver_version=driver_version)


def _init_failure(init: Mapping[str, Any]) -> tuple[str, str]:
    """(init_error, init_outcome) from the child's ``init`` record."""
    if init.get("stage") == "load":
        # The loader's message starts with the file name already: "libcuda.so.1: cannot open…"
        detail = str(init.get("detail", "")).removeprefix(f"{LIBCUDA_SONAME}: ")
        return f"cannot load {LIBCUDA_SONAME}: {detail}", "no_driver"
    code = init.get("code")
    if not isinstance(code, int):
        return str(init.get("detail") or "the CUDA driver could not be initialised"), "error"
    name = init.get("name") or error_name(code) or "unknown code"
    words = init.get("message") or error_string(code) or "no description"
    message = f"{init.get('stage', 'cuInit')} failed with {name} ({code}): {words}"
    return message, "unknown" if code == 999 else outcome_for(code)


def _last_json(stdout: bytes) -> dict[str, Any] | None:
    for line in reversed(stdout.decode("utf-8", errors="replace").splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                return value if isinstance(value, dict) else None
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
