"""The active health probe: one CUDA context per visible GPU, in a short-lived subprocess.

Only creating a CUDA context *reveals* "CUDA-capable device(s) is/are busy or unavailable"
(error 46), a lost GPU, a stub or mismatched driver; NVML can only predict them.
:func:`probe_devices` (``--probe``, ``nbgpu doctor``) runs this module as a child with the
caller's environment (``CUDA_VISIBLE_DEVICES``, ``NBGPU_SIMULATE``), in its own session,
against a deadline: drivers do hang, so past it the process group is killed and the report
names the step the child was in. CUDA's codes become outcomes (``busy``, ``lost``, ...), each
with what to do; devices are matched to NVML indices by UUID. Only the child loads libcuda:
a context in the Jupyter kernel would itself hold the GPU (in exclusive mode, locking the
user's own job out). Never imports torch, pynvml, psutil or IPython.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from nbgpu._children import Finished, die_with_parent, run_with_deadline, with_package_importable
from nbgpu._render import Block, Bullets, Result, Table, Title
from nbgpu._serial import from_data
from nbgpu.devices.cuda_driver import CudaCallError, CudaDriver
from nbgpu.devices.cuda_errors import LIBCUDA_SONAME, cuda_version, error_name, error_string
from nbgpu.devices.sim import simulation_source
from nbgpu.errors import ProbeError, UserInputError

__all__ = [
    "DOC_FORMAT", "INIT_OUTCOMES", "OUTCOMES", "PARENT_ENV", "PROGRESS", "ProbeReport",
    "ProbeResult", "load_cuda_library", "outcome_for", "probe_devices",
]  # fmt: skip

#: The version of the JSON document the child prints (the parent checks it).
DOC_FORMAT = 1
#: The prefix of the stderr lines naming the step the child is in.
PROGRESS = "nbgpu-probe: "
#: The pid the child must die with.
PARENT_ENV = "NBGPU_PROBE_PARENT"

#: Per-device outcomes, with what each means and what to do about it.
OUTCOMES: Mapping[str, str] = {
    "ok": "a CUDA context was created and released",
    "busy": (
        "another process holds this GPU (exclusive-process mode, possibly a dead or zombie "
        "holder), its compute mode is prohibited, or its memory is used up: `nbgpu doctor` "
        "names the holder"
    ),
    "no_device": (
        "CUDA sees no usable GPU: the kernel module is not loaded, /dev/nvidia* may not be "
        "opened (container, cgroup), or CUDA_VISIBLE_DEVICES hides every GPU"
    ),
    "lost": (
        "the GPU stopped answering (fallen off the bus, Xid 79): check "
        "`sudo dmesg | grep -i xid`, then reset the GPU or reboot"
    ),
    "driver_mismatch": (
        "the CUDA user-space driver does not match the loaded kernel module (driver upgraded "
        "without a reboot, or a forward-compatibility package on unsupported hardware): "
        "reboot, or reload the nvidia module"
    ),
    "stub_library": (
        "the CUDA toolkit's stub libcuda was loaded instead of the driver's: take "
        "`.../lib64/stubs` out of LD_LIBRARY_PATH"
    ),
    "not_permitted": "the driver refused the context: a container, MPS or policy restriction",
    "ecc": (
        "an uncorrectable ECC error: reset the GPU (`sudo nvidia-smi --gpu-reset -i N`) or "
        "reboot; drain the node if it recurs"
    ),
    "error": "an unexpected CUDA error: see its name and message",
}

#: Outcomes of the probe as a whole (``init_outcome``); cuInit's code maps as a device's would.
INIT_OUTCOMES: Mapping[str, str] = {
    "no_driver": (
        f"the NVIDIA driver library {LIBCUDA_SONAME} is not installed here (or a container "
        "was started without the NVIDIA runtime: `docker run --gpus all`)"
    ),
    "timeout": (
        "the driver did not answer in time (hung GPU or driver): check "
        "`sudo dmesg | grep -i xid`, then reset the GPU or reboot"
    ),
    # cuInit's "unknown error" is rarely a lost GPU: it is the classic symptom of a container
    # whose /dev/nvidia* access systemd revoked (nvidia-container-toolkit issue 48).
    "unknown": (
        "CUDA failed with 'unknown error' at initialisation: inside a container it has usually "
        "lost access to /dev/nvidia* (recreate the container); on a host, check "
        "`sudo dmesg | grep -i xid`"
    ),
}

_OUTCOME_BY_CODE: Mapping[int, str] = {
    0: "ok",
    46: "busy",  # CUDA_ERROR_DEVICE_UNAVAILABLE
    # Out of memory while creating a context: someone else fills the GPU, so for the user
    # it is as busy as an exclusive holder (error_name keeps the difference).
    2: "busy",
    100: "no_device",
    101: "no_device",  # INVALID_DEVICE: the ordinal disappeared between enumeration and use
    999: "lost",
    803: "driver_mismatch",
    804: "driver_mismatch",  # COMPAT_NOT_SUPPORTED_ON_DEVICE
    34: "stub_library",
    800: "not_permitted",
    214: "ecc",
}


def _sentences(fact: str, hint: str) -> str:
    """``fact. Hint.``: the fact keeps its case (it may start with ``cuda:1`` or ``cuInit``)."""
    fact = fact if fact.endswith(".") else fact + "."
    return f"{fact} {hint[0].upper()}{hint[1:]}." if hint else fact


def outcome_for(cuda_error: int) -> str:
    """The outcome for a CUresult from context creation: 46 -> ``"busy"``, etc."""
    return _OUTCOME_BY_CODE.get(cuda_error, "error")


@dataclass(frozen=True)
class ProbeResult:
    """What creating a context on one logical CUDA device gave."""

    cuda_index: int
    nvml_index: int | None  # matched back by UUID when possible
    uuid: str | None
    name: str | None
    outcome: str  # a key of OUTCOMES
    cuda_error: int  # 0 for ok
    error_name: str | None  # "CUDA_ERROR_DEVICE_UNAVAILABLE"
    message: str  # CUDA's own wording for the error; a plain sentence for ok
    elapsed_ms: float  # context creation and release
    pci_bus_id: str | None = None  # CUDA's form, 0000:18:00.0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(frozen=True)
class ProbeReport(Result):
    """The probe's outcome for every visible device, or why it could not run."""

    results: tuple[ProbeResult, ...]
    driver_version: int | None  # cuDriverGetVersion, e.g. 12040
    init_error: str | None  # set when the library, cuInit or the probe process failed
    init_outcome: str | None  # a key of INIT_OUTCOMES or OUTCOMES
    simulated: bool
    timed_out: bool
    elapsed_ms: float  # wall time, including starting the probe process

    @property
    def ok(self) -> bool:
        return self.init_error is None and all(r.ok for r in self.results)

    def for_nvml_index(self, nvml_index: int) -> ProbeResult | None:
        """The first result on physical GPU ``nvml_index`` (None: not probed or not matched)."""
        return next((r for r in self.results if r.nvml_index == nvml_index), None)

    def content(self) -> list[Block]:
        parts = ["CUDA probe"]
        if self.simulated:
            parts.append("SIMULATED")
        if self.driver_version:
            parts.append(f"CUDA driver {cuda_version(self.driver_version)}")
        if self.init_error is None:
            parts.append(f"{len(self.results)} device{'s' if len(self.results) != 1 else ''}")
        parts.append(f"{self.elapsed_ms / 1000:.2f} s")
        blocks: list[Block] = [Title(" · ".join(parts), simulated=self.simulated)]
        if self.init_error is None:
            table = Table(["cuda", "GPU", "name", "outcome", "detail"])
            for r in self.results:
                ms = f"{r.elapsed_ms:.1f}" if r.elapsed_ms < 10 else f"{r.elapsed_ms:.0f}"
                table.add(
                    f"cuda:{r.cuda_index}",
                    "-" if r.nvml_index is None else r.nvml_index,
                    r.name or "-",
                    r.outcome,
                    f"context in {ms} ms" if r.ok else str(r.error_name or r.cuda_error),
                    level="ok" if r.ok else "bad",
                )
            blocks.append(table)
        # One sentence per problem; UUIDs and error names are never broken.
        return [*blocks, Bullets(self.notes(), marker="! ", level="bad")]

    def notes(self) -> list[str]:
        """One sentence per problem: CUDA's words first, then what to do."""
        if self.init_error is not None:
            outcome = self.init_outcome or "error"
            hint = INIT_OUTCOMES.get(outcome) or OUTCOMES.get(outcome, "")
            return [_sentences(self.init_error, hint)]
        lines = []
        for r in (r for r in self.results if not r.ok):
            where = f"cuda:{r.cuda_index}"
            if r.nvml_index is not None:
                where += f" (GPU {r.nvml_index})"
            code = f"{r.error_name} ({r.cuda_error})" if r.error_name else str(r.cuda_error)
            lines.append(_sentences(f"{where}: {code}: {r.message}", OUTCOMES.get(r.outcome, "")))
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {**_renamed(asdict(self), "init_outcome", "init_verdict"), "results": self.records()}

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "probe JSON") -> ProbeReport:
        """The report :meth:`to_dict` wrote (a capture's ``probe``)."""
        if not isinstance(data, dict):
            raise UserInputError(f"{where}: probe is not an object")
        doc = _renamed(data, "init_verdict", "init_outcome")
        results = doc.get("results") or []
        doc["results"] = [
            _renamed(r, "verdict", "outcome") if isinstance(r, dict) else r for r in results
        ]
        return from_data(cls, doc, where="probe", prefix=where)

    def records(self) -> list[dict[str, Any]]:
        return [_renamed(asdict(r), "outcome", "verdict") for r in self.results]


def _renamed(doc: dict[str, Any], key: str, json_key: str) -> dict[str, Any]:
    """A copy of ``doc`` with ``key`` spelled ``json_key``: the JSON keeps the name users
    parse (``verdict``) while the code says what it is (the probe's outcome)."""
    return {json_key if k == key else k: v for k, v in doc.items()}


def probe_devices(
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    nvml_index_by_uuid: Mapping[str, int] | None = None,
) -> ProbeReport:
    """The probe in *environ* (default ``os.environ``); ``nvml_index_by_uuid`` matches
    results back to physical GPUs (simulated, the fleet gives it). GPU and driver problems
    are outcomes: it raises only ``FleetSpecError`` for a malformed ``NBGPU_SIMULATE``,
    ``UserInputError`` for a bad timeout, ``ProbeError`` if the probe cannot start."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise UserInputError(f"probe timeout {timeout_s!r}; expected a positive number of seconds")
    env = dict(os.environ if environ is None else environ)
    from nbgpu.devices.nvml import backend_for  # noqa: PLC0415  (loads pynvml)

    # It validates NBGPU_SIMULATE too: a typo is a one-line FleetSpecError, not a failed child.
    backend = backend_for(env)
    uuids = backend.nvml_index_by_uuid() if nvml_index_by_uuid is None else nvml_index_by_uuid
    child_env = {**with_package_importable(env), PARENT_ENV: str(os.getpid())}
    run = _run_child([sys.executable, "-m", "nbgpu.devices.health"], child_env, timeout_s=timeout_s)
    return _report(run, timeout_s, simulated=backend.simulated, uuids=uuids)


def _run_child(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float) -> Finished:
    try:
        return run_with_deadline(argv, env, timeout_s=timeout_s)
    except OSError as exc:
        raise ProbeError(
            f"cannot start the CUDA probe process {argv[0]!r}: {exc.strerror or exc}"
        ) from None


def _report(
    run: Finished, timeout_s: float, *, simulated: bool, uuids: Mapping[str, int]
) -> ProbeReport:
    base = ProbeReport((), None, None, None, simulated, timed_out=False, elapsed_ms=run.elapsed_ms)
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
        return replace(base, init_error=message, init_outcome="timeout", timed_out=True)
    doc = _last_json(run.stdout)
    if doc is None or doc.get("format") != DOC_FORMAT:
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        how = (
            f"was killed by {_signal_name(-run.returncode)}"
            if run.returncode is not None and run.returncode < 0
            else f"exited with code {run.returncode} without a report"
        )
        message = f"the CUDA probe process {how}: {last.strip() or 'no output'}"
        return replace(base, init_error=message, init_outcome="error")
    base = replace(base, driver_version=doc.get("driver_version"))
    if doc.get("init") is not None:
        message, outcome = _init_failure(doc["init"])
        return replace(base, init_error=message, init_outcome=outcome)
    by_body = {
        (full[4:] if full[:4] in ("GPU-", "MIG-") else full).lower(): (full, index)
        for full, index in uuids.items()
    }
    results = []
    for device in doc.get("devices", []):
        uuid, nvml_index = None, None
        if device.get("uuid"):
            # CUDA gives bare UUID bytes; NVML's prefix tells a GPU from a MIG instance.
            uuid, nvml_index = by_body.get(device["uuid"].lower(), ("GPU-" + device["uuid"], None))
        # The child's record holds every other field, in the dataclass's words.
        fields = {**device, "uuid": uuid, "nvml_index": nvml_index}
        results.append(ProbeResult(**fields, outcome=outcome_for(device["cuda_error"])))
    return replace(base, results=tuple(results))


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
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


# -- the child side: the driver, one context per device, one JSON line ------------


def load_cuda_library(environ: Mapping[str, str]) -> object:
    """The simulated library for ``NBGPU_SIMULATE`` (honouring *environ*'s
    ``CUDA_VISIBLE_DEVICES``), else ``libcuda.so.1`` (reading this process's environment).
    ``OSError`` when it cannot be loaded; ``FleetSpecError`` for a bad ``NBGPU_SIMULATE``."""
    source = simulation_source(environ)
    if source is None:
        return ctypes.CDLL(LIBCUDA_SONAME)
    # Imported here: the fleet and CUDA_VISIBLE_DEVICES machinery is only needed simulated.
    from nbgpu.devices.sim.cuda import load_simulated_cuda  # noqa: PLC0415

    return load_simulated_cuda(source, environ)


def _progress(step: str) -> None:
    print(PROGRESS + step, file=sys.stderr, flush=True)


def _probe_in_process(environ: Mapping[str, str]) -> dict[str, Any]:
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
    except (OSError, UserInputError) as exc:  # UserInputError: a bad NBGPU_SIMULATE
        stage = "load" if isinstance(exc, OSError) else "NBGPU_SIMULATE"  # the parent checks first
        doc["init"] = {"stage": stage, "detail": str(exc)}
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


def _probe_device(driver: CudaDriver, ordinal: int) -> dict[str, Any]:
    _progress(f"cuda:{ordinal} context")
    record: dict[str, Any] = {"cuda_index": ordinal, "name": None, "uuid": None, "pci_bus_id": None}
    elapsed_ms = 0.0
    try:
        device = driver.device(ordinal)
        for key in ("name", "uuid", "pci_bus_id"):  # each stays None if the driver refuses
            with contextlib.suppress(CudaCallError):
                record[key] = str(getattr(driver, key)(device))
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
    print(json.dumps(_probe_in_process(os.environ)), flush=True)
