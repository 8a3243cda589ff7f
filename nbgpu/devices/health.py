"""The active health probe: one CUDA context per visible GPU, in a short-lived subprocess.

NVML can predict, but only creating a CUDA context *reveals*, "CUDA-capable device(s) is/are
busy or unavailable" (error 46), a lost GPU, a stub or mismatched driver. :func:`probe_devices`
(``--probe``, ``nbgpu doctor``) runs ``python -m nbgpu.devices.health_child`` with the
caller's environment (so ``CUDA_VISIBLE_DEVICES`` and ``NBGPU_SIMULATE`` apply), in its own
session, against a deadline: a hung driver is a real failure mode, so past it the process
group is killed and the report says so in one line. CUDA's codes become outcomes
(``busy``, ``lost``, ...), each with what to do; devices are matched to NVML indices by UUID.
Never in the Jupyter kernel: a context there would itself hold the GPU (in exclusive mode,
locking the user's own job out). Never imports torch, pynvml, psutil or IPython; this side
never loads libcuda.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from nbgpu._children import Finished, run_with_deadline, with_package_importable
from nbgpu._render import Block, Bullets, Result, Table, Title
from nbgpu._serial import from_data
from nbgpu.devices.cuda_errors import LIBCUDA_SONAME, cuda_version, error_name, error_string
from nbgpu.devices.health_child import DOC_FORMAT, PARENT_ENV, PROGRESS
from nbgpu.errors import ProbeError, UserInputError

__all__ = [
    "INIT_OUTCOMES", "OUTCOMES", "ProbeReport", "ProbeResult", "outcome_for", "probe_devices",
]  # fmt: skip

_CHILD_MODULE = "nbgpu.devices.health_child"

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

#: Outcomes only the probe as a whole can get (``ProbeReport.init_outcome``), on top of
#: the per-device ones for the CUDA code ``cuInit`` returned.
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


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


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
        """CUDA initialised and every visible device accepted a context."""
        return self.init_error is None and all(r.ok for r in self.results)

    def for_nvml_index(self, nvml_index: int) -> ProbeResult | None:
        """The first result on physical GPU ``nvml_index`` (None: not probed or not matched)."""
        return next((r for r in self.results if r.nvml_index == nvml_index), None)

    def _title(self) -> str:
        parts = ["CUDA probe"]
        if self.simulated:
            parts.append("SIMULATED")
        if self.driver_version:
            parts.append(f"CUDA driver {cuda_version(self.driver_version)}")
        if self.init_error is None:
            parts.append(f"{len(self.results)} device{'s' if len(self.results) != 1 else ''}")
        parts.append(f"{self.elapsed_ms / 1000:.2f} s")
        return " · ".join(parts)

    def _table(self) -> Table:
        table = Table(["cuda", "GPU", "name", "outcome", "detail"])
        for r in self.results:
            table.add(
                f"cuda:{r.cuda_index}",
                "-" if r.nvml_index is None else r.nvml_index,
                r.name or "-",
                r.outcome,
                f"context in {_ms(r.elapsed_ms)}" if r.ok else str(r.error_name or r.cuda_error),
                level="ok" if r.ok else "bad",
            )
        return table

    def notes(self) -> list[str]:
        """One sentence per problem: CUDA's words first, then what to do."""
        if self.init_error is not None:
            outcome = self.init_outcome or "error"
            hint = INIT_OUTCOMES.get(outcome) or OUTCOMES.get(outcome, "")
            return [_sentences(self.init_error, hint)]
        lines = []
        for r in self.results:
            if r.ok:
                continue
            where = f"cuda:{r.cuda_index}"
            if r.nvml_index is not None:
                where += f" (GPU {r.nvml_index})"
            code = f"{r.error_name} ({r.cuda_error})" if r.error_name else str(r.cuda_error)
            lines.append(_sentences(f"{where}: {code}: {r.message}", OUTCOMES.get(r.outcome, "")))
        return lines

    def content(self) -> list[Block]:
        blocks: list[Block] = [Title(self._title(), simulated=self.simulated)]
        if self.init_error is None:
            blocks.append(self._table())
        # One sentence per problem; UUIDs and error names are never broken.
        return [*blocks, Bullets(self.notes(), marker="! ", level="bad")]

    def to_dict(self) -> dict[str, Any]:
        doc = _renamed(asdict(self), "init_outcome", "init_verdict")
        doc["results"] = self.records()
        return doc

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


# -- the parent side: the child against a deadline, its answer read back ----------


def probe_devices(
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
    nvml_index_by_uuid: Mapping[str, int] | None = None,
) -> ProbeReport:
    """The probe in *environ* (default ``os.environ``); ``nvml_index_by_uuid`` matches
    results back to physical GPUs (simulated, the fleet gives it). Never raises for a GPU or
    driver problem (those are outcomes): ``FleetSpecError`` for a malformed
    ``NBGPU_SIMULATE``, ``UserInputError`` for a bad timeout, ``ProbeError`` if the probe
    process cannot be started at all."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise UserInputError(f"probe timeout {timeout_s!r}; expected a positive number of seconds")
    env = dict(os.environ if environ is None else environ)
    from nbgpu.devices.nvml import backend_for  # noqa: PLC0415  (loads pynvml)

    # The backend also validates NBGPU_SIMULATE here, so a typo is a one-line
    # FleetSpecError, not a failed subprocess.
    backend = backend_for(env)
    uuids = backend.nvml_index_by_uuid() if nvml_index_by_uuid is None else nvml_index_by_uuid
    child_env = {**with_package_importable(env), PARENT_ENV: str(os.getpid())}
    run = _run_child([sys.executable, "-m", _CHILD_MODULE], child_env, timeout_s=timeout_s)
    return _report(run, timeout_s, simulated=backend.simulated, uuids=uuids)


def _run_child(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float) -> Finished:
    """Run the probe process against the deadline; ``ProbeError`` if it cannot start."""
    try:
        return run_with_deadline(argv, env, timeout_s=timeout_s)
    except OSError as exc:
        raise ProbeError(
            f"cannot start the CUDA probe process {argv[0]!r}: {exc.strerror or exc}"
        ) from None


def _uuid_body(uuid: str) -> str:
    return (uuid[4:] if uuid[:4] in ("GPU-", "MIG-") else uuid).lower()


def _report(
    run: Finished, timeout_s: float, *, simulated: bool, uuids: Mapping[str, int]
) -> ProbeReport:
    # What every answer shares; each outcome below fills in the rest.
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
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
