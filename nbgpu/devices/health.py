"""The active health probe: one CUDA context per visible GPU, in a short-lived subprocess.

NVML can predict, but only creating a CUDA context *reveals*, "CUDA-capable device(s) is/are
busy or unavailable" (error 46), a lost GPU, a stub or mismatched driver. This module owns
that opt-in probe (``%gpu_status --probe``, ``nbgpu status --probe``, ``nbgpu doctor``):

- :func:`probe_devices` runs ``python -m nbgpu.devices.health`` with the caller's environment
  (so ``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER`` and ``NBGPU_SIMULATE`` apply), in its own
  session, with a deadline. A hung driver is a real failure mode: past the deadline the
  whole process group is killed and the report says so in one line.
- The child (:func:`_child_main`) loads the driver (``cuda_driver.load_cuda_library``: the
  real ``libcuda.so.1`` or the simulated fleet), creates and at once releases the primary
  context of each visible device, and prints one JSON document.
- :class:`ProbeReport` maps CUDA's codes to verdicts, matches devices back to NVML indices
  by UUID, and renders as text / HTML / JSON.

Never in the Jupyter kernel: a context there would itself hold the GPU (and, in exclusive
mode, lock the user's own training job out). This module never imports torch, pynvml,
psutil or IPython, and the parent side never loads libcuda.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nbgpu._lineage import die_with_parent, with_package_importable
from nbgpu._render import Result, Table
from nbgpu.devices.cuda_driver import (
    LIBCUDA_SONAME,
    CudaCallError,
    CudaDriver,
    error_name,
    error_string,
    load_cuda_library,
    simulation_source,
)
from nbgpu.errors import ProbeError, UserInputError

__all__ = [
    "INIT_VERDICTS",
    "VERDICTS",
    "ProbeReport",
    "ProbeResult",
    "probe_devices",
    "verdict_for",
]

#: Per-device verdicts, with what each means and what to do about it.
VERDICTS: Mapping[str, str] = {
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

#: Verdicts only the probe as a whole can get (``ProbeReport.init_verdict``), on top of
#: the per-device ones for the CUDA code ``cuInit`` returned.
INIT_VERDICTS: Mapping[str, str] = {
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

_VERDICT_BY_CODE: Mapping[int, str] = {
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

_CHILD_MODULE = "nbgpu.devices.health"
_DOC_FORMAT = 1
_PROGRESS = "nbgpu-probe: "  # stderr lines naming the step the child is in
_PARENT_ENV = "NBGPU_PROBE_PARENT"  # pid the child must die with
# After SIGKILL a process normally disappears at once; one stuck in the driver
# (uninterruptible sleep) does not, and we must not wait for it forever.
_REAP_TIMEOUT_S = 5.0


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 10 else f"{value:.0f} ms"


def _sentences(fact: str, hint: str) -> str:
    """``fact. Hint.``: the fact keeps its case (it may start with ``cuda:1`` or ``cuInit``)."""
    fact = fact if fact.endswith(".") else fact + "."
    return f"{fact} {hint[0].upper()}{hint[1:]}." if hint else fact


def verdict_for(cuda_error: int) -> str:
    """The verdict for a CUresult from context creation: 46 -> ``"busy"``, etc."""
    return _VERDICT_BY_CODE.get(cuda_error, "error")


@dataclass(frozen=True)
class ProbeResult:
    """What creating a context on one logical CUDA device gave."""

    cuda_index: int
    nvml_index: int | None  # matched back by UUID when possible
    uuid: str | None
    name: str | None
    verdict: str  # a key of VERDICTS
    cuda_error: int  # 0 for ok
    error_name: str | None  # "CUDA_ERROR_DEVICE_UNAVAILABLE"
    message: str  # CUDA's own wording for the error; a plain sentence for ok
    elapsed_ms: float  # context creation and release
    pci_bus_id: str | None = None  # CUDA's form, 0000:18:00.0

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


@dataclass(frozen=True)
class ProbeReport(Result):
    """The probe's outcome for every visible device, or why it could not run."""

    results: tuple[ProbeResult, ...]
    driver_version: int | None  # cuDriverGetVersion, e.g. 12040
    init_error: str | None  # set when the library, cuInit or the probe process failed
    init_verdict: str | None  # a key of INIT_VERDICTS or VERDICTS
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

    def for_cuda_index(self, cuda_index: int) -> ProbeResult | None:
        return next((r for r in self.results if r.cuda_index == cuda_index), None)

    def _title(self, *, label_simulated: bool = True) -> str:
        parts = ["CUDA probe"]
        if self.simulated and label_simulated:
            parts.append("SIMULATED")
        if self.driver_version:
            major, minor = self.driver_version // 1000, (self.driver_version % 1000) // 10
            parts.append(f"CUDA driver {major}.{minor}")
        if self.init_error is None:
            parts.append(f"{len(self.results)} device{'s' if len(self.results) != 1 else ''}")
        parts.append(f"{self.elapsed_ms / 1000:.2f} s")
        return " · ".join(parts)

    def _table(self, title: str | None) -> Table:
        table = Table(["cuda", "GPU", "name", "verdict", "detail"], title=title)
        for r in self.results:
            detail = (
                f"context in {_ms(r.elapsed_ms)}" if r.ok else f"{r.error_name or r.cuda_error}"
            )
            table.add(
                f"cuda:{r.cuda_index}",
                "-" if r.nvml_index is None else r.nvml_index,
                r.name or "-",
                r.verdict,
                detail,
                level="ok" if r.ok else "bad",
            )
        return table

    def notes(self) -> list[str]:
        """One sentence per problem: CUDA's words first, then what to do."""
        if self.init_error is not None:
            verdict = self.init_verdict or "error"
            hint = INIT_VERDICTS.get(verdict) or VERDICTS.get(verdict, "")
            return [_sentences(self.init_error, hint)]
        lines = []
        for r in self.results:
            if r.ok:
                continue
            where = f"cuda:{r.cuda_index}"
            if r.nvml_index is not None:
                where += f" (GPU {r.nvml_index})"
            code = f"{r.error_name} ({r.cuda_error})" if r.error_name else str(r.cuda_error)
            lines.append(_sentences(f"{where}: {code}: {r.message}", VERDICTS.get(r.verdict, "")))
        return lines

    def text(self) -> str:
        wrap = textwrap.TextWrapper(80, initial_indent="! ", subsequent_indent="  ")
        wrap.break_on_hyphens = False  # keep UUIDs and error names whole
        notes = [wrap.fill(n) for n in self.notes()]
        if self.init_error is not None:
            return "\n".join([self._title(), *notes])
        return "\n".join([self._table(self._title()).text(), *notes])

    def html_body(self) -> str:
        # The simulation label is styled in HTML, so it is not repeated in the title.
        label = '<span class="nbgpu-sim">SIMULATED</span> ' if self.simulated else ""
        title = f"<div>{label}{html.escape(self._title(label_simulated=False))}</div>"
        items = "".join(f'<li class="bad">{html.escape(n)}</li>' for n in self.notes())
        notes = f"<ul>{items}</ul>" if items else ""
        table = "" if self.init_error is not None else self._table(None).html()
        return f"{title}{table}{notes}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def records(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.results]


# ------------------------------------------------------------------------- parent side


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

    Never raises for a GPU or driver problem: those are verdicts. Raises ``FleetSpecError``
    for a malformed ``NBGPU_SIMULATE``, ``UserInputError`` for a bad timeout, and
    ``ProbeError`` if the probe process cannot be started at all.
    """
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise UserInputError(f"probe timeout {timeout_s!r}; expected a positive number of seconds")
    env = dict(os.environ if environ is None else environ)
    source = simulation_source(env)
    if nvml_index_by_uuid is None and source is not None:
        # Also validates the spec here, so a typo is a one-line FleetSpecError, not a
        # failed subprocess.
        nvml_index_by_uuid = _fleet_uuids(source)
    run = _run_child(
        [sys.executable, "-m", _CHILD_MODULE], _child_environ(env), timeout_s=timeout_s
    )
    return _report(run, timeout_s, simulated=source is not None, uuids=nvml_index_by_uuid or {})


@dataclass(frozen=True)
class _ChildRun:
    pid: int
    stdout: bytes
    stderr: bytes
    returncode: int | None  # None: still there after SIGKILL (stuck in the driver)
    timed_out: bool
    elapsed_ms: float


def _run_child(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float) -> _ChildRun:
    """Run ``argv`` in its own session; past ``timeout_s`` kill its whole process group."""
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Its own session and group: one killpg reaches anything it started, and a
            # Ctrl-C meant for the kernel does not reach it behind our back.
            start_new_session=True,
        )
    except OSError as exc:
        raise ProbeError(
            f"cannot start the CUDA probe process {argv[0]!r}: {exc.strerror or exc}"
        ) from None
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stdout, stderr = _kill_group(proc)
    except BaseException:
        # KeyboardInterrupt (the user stopped the cell) or any other exit: leave no child.
        _kill_group(proc)
        raise
    return _ChildRun(
        proc.pid,
        stdout,
        stderr,
        proc.returncode,
        timed_out,
        (time.perf_counter() - started) * 1000,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGKILL the child's process group, reap it, and return what it had written."""
    # SIGKILL straight away: the deadline has already passed, and the probe holds nothing
    # worth a graceful exit (the kernel frees a dead process's CUDA contexts).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Uninterruptible sleep in the driver: it dies when the driver lets go. Its pipes
        # stay open until then, so reading them would block too.
        _close_pipes(proc)
        return b"", b""
    _wait_group_dead(proc.pid, deadline=time.monotonic() + _REAP_TIMEOUT_S)
    try:
        return proc.communicate(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipes
        _close_pipes(proc)
        return b"", b""


def _wait_group_dead(pgid: int, *, deadline: float) -> None:
    """Return once no live process is left in group ``pgid`` (SIGKILL is asynchronous)."""
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False  # the usual case: the probe started nothing else
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    # Killed descendants stay in the group as zombies until init reaps them, which may
    # take a while (or forever, under a PID 1 that does not reap): only live ones count.
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == pgid and state not in ("Z", "X"):
                return True
    return False


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _child_environ(environ: Mapping[str, str]) -> dict[str, str]:
    env = with_package_importable(environ)
    env[_PARENT_ENV] = str(os.getpid())
    return env


def _fleet_uuids(source: str) -> dict[str, int]:
    from nbgpu.devices.fleet import load_fleet  # noqa: PLC0415  (only when simulated)

    fleet = load_fleet(source)
    uuids = {gpu.uuid: gpu.index for gpu in fleet.gpus}
    uuids.update({mig.uuid: gpu.index for gpu in fleet.gpus for mig in gpu.mig_devices})
    return uuids


def _uuid_body(uuid: str) -> str:
    return (uuid[4:] if uuid[:4] in ("GPU-", "MIG-") else uuid).lower()


def _report(
    run: _ChildRun, timeout_s: float, *, simulated: bool, uuids: Mapping[str, int]
) -> ProbeReport:
    def report(
        results: tuple[ProbeResult, ...] = (),
        *,
        driver_version: int | None = None,
        init_error: str | None = None,
        init_verdict: str | None = None,
        timed_out: bool = False,
    ) -> ProbeReport:
        return ProbeReport(
            results=results,
            driver_version=driver_version,
            init_error=init_error,
            init_verdict=init_verdict,
            simulated=simulated,
            timed_out=timed_out,
            elapsed_ms=run.elapsed_ms,
        )

    stderr = run.stderr.decode("utf-8", errors="replace")
    if run.timed_out:
        steps = [
            line[len(_PROGRESS) :] for line in stderr.splitlines() if line.startswith(_PROGRESS)
        ]
        where = f" (stuck in {steps[-1]})" if steps else ""
        message = (
            f"the CUDA probe did not finish within {timeout_s:g} s{where}; its process group "
            "was killed"
        )
        if run.returncode is None:
            message += f", but pid {run.pid} is still in the driver (uninterruptible sleep)"
        return report(init_error=message, init_verdict="timeout", timed_out=True)
    doc = _last_json(run.stdout)
    if doc is None or doc.get("format") != _DOC_FORMAT:
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        how = (
            f"was killed by {_signal_name(-run.returncode)}"
            if run.returncode is not None and run.returncode < 0
            else f"exited with code {run.returncode} without a report"
        )
        message = f"the CUDA probe process {how}: {last.strip() or 'no output'}"
        return report(init_error=message, init_verdict="error")
    init = doc.get("init")
    driver_version = doc.get("driver_version")
    if init is not None:
        message, verdict = _init_failure(init)
        return report(driver_version=driver_version, init_error=message, init_verdict=verdict)
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
                verdict=verdict_for(code),
                cuda_error=code,
                error_name=device.get("error_name"),
                message=device.get("message") or "",
                elapsed_ms=float(device.get("elapsed_ms", 0.0)),
                pci_bus_id=device.get("pci_bus_id"),
            )
        )
    return report(tuple(results), driver_version=driver_version)


def _init_failure(init: Mapping[str, Any]) -> tuple[str, str]:
    """(init_error, init_verdict) from the child's ``init`` record."""
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
    return message, "unknown" if code == 999 else verdict_for(code)


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


# -------------------------------------------------------------------------- child side


def _progress(step: str) -> None:
    # Flushed before each call that can hang, so a timeout can name the step.
    sys.stderr.write(f"{_PROGRESS}{step}\n")
    sys.stderr.flush()


def _probe_in_process(environ: Mapping[str, str]) -> dict[str, Any]:
    """The probe itself: load the driver, init, one context per device. Child only."""
    doc: dict[str, Any] = {
        "format": _DOC_FORMAT,
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
    expected = os.environ.get(_PARENT_ENV, "")
    # Nowhere to record a refusal: the probe's answer is one JSON line on stdout.
    die_with_parent(signal.SIGKILL, int(expected) if expected.isdigit() else None)


def _child_main() -> int:
    """``python -m nbgpu.devices.health``: probe, print one JSON document on stdout."""
    _die_with_parent()
    doc = _probe_in_process(os.environ)
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main())
