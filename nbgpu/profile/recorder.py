"""One process's memory, read from /proc, and its phase stack recorded as crash-safe JSON lines.

The :class:`Recorder` behind ``nbgpu.phase``: one ``os.write`` per record on an ``O_APPEND``
descriptor, so a rank killed by the OOM killer leaves every phase it entered and its last samples on
disk, and nothing is shared between ranks (no lock, no fsync). A :class:`Sampler` thread folds host
memory (and CUDA figures once the process uses CUDA) into the open phases' peaks; the training
thread never waits for it, sharing only a short lock around the phase stack.

The readings: RSS; USS (private pages: what the process frees on exit) and PSS (shared
pages divided among the sharers: sums across ranks without counting torch's libraries
eight times) from ``smaps_rollup``; the kernel's high-water mark ``VmHWM`` and its reset
through ``/proc/self/clear_refs``, which some kernels and containers refuse (then the
reason is returned, never a guess); the node's ``MemTotal`` and ``MemAvailable``; the
caching allocator's figures only when torch is imported *and* CUDA initialised here: the
profiler must never create a CUDA context (hundreds of MiB per GPU; a busy GPU would fail).

Standard library only at import time (this runs inside every rank, every 100 ms).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_SAMPLE_S", "CudaMemory", "NodeMemory", "ProcessMemory", "Recorder",
           "Sampler", "cuda_memory", "node_memory", "process_memory", "process_start_time",
           "records_file", "reset_peak_rss", "resident_bytes", "status_bytes"]  # fmt: skip

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int | None
    uss_bytes: int | None  # None: no smaps_rollup (reason in `why`)
    pss_bytes: int | None
    why: str = ""


@dataclass(frozen=True)
class NodeMemory:
    total_bytes: int | None
    available_bytes: int | None


@dataclass(frozen=True)
class CudaMemory:
    device: int
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int


def _kib_fields(text: str, wanted: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in wanted:
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


def _read(path: str) -> str | None:
    # One open and read per file: these run 10 times a second in every rank.
    try:
        with open(path, encoding="ascii", errors="replace") as handle:  # noqa: PTH123
            return handle.read()
    except OSError:
        return None


_PRIVATE = ("Private_Clean", "Private_Dirty", "Private_Hugetlb")  # together: USS
_ROLLUP = ("Rss", "Pss", *_PRIVATE)


def process_memory(pid: int | str = "self") -> ProcessMemory:
    """RSS, USS and PSS of one process (``self`` by default)."""
    f = _kib_fields(_read(f"/proc/{pid}/smaps_rollup") or "", _ROLLUP)
    if "Rss" in f and "Pss" in f:
        return ProcessMemory(f["Rss"], sum(f.get(k, 0) for k in _PRIVATE), f["Pss"])
    rss = resident_bytes(pid)
    if rss is not None:
        why = "no /proc/PID/smaps_rollup (Linux < 4.14 or not permitted): no USS/PSS"
        return ProcessMemory(rss, None, None, why)
    return ProcessMemory(None, None, None, f"/proc/{pid} is not readable")


def resident_bytes(pid: int | str = "self") -> int | None:
    """RSS alone from ``/proc/PID/statm``: constant time, unlike smaps_rollup's page walk."""
    statm = _read(f"/proc/{pid}/statm")
    parts = statm.split() if statm else []
    return int(parts[1]) * _PAGE if len(parts) > 1 and parts[1].isdigit() else None


def status_bytes(key: str, pid: int | str = "self") -> int | None:
    """A size ``/proc/PID/status`` gives: ``VmHWM`` (the most resident memory since start or
    the last reset), ``VmSize`` (the address space, what ``RLIMIT_AS`` counts)."""
    return _kib_fields(_read(f"/proc/{pid}/status") or "", (key,)).get(key)


def reset_peak_rss() -> str | None:
    """Reset this process's ``VmHWM``; None when done, else why it could not be."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)
    except OSError as exc:
        return f"VmHWM cannot be reset here (clear_refs: {exc.strerror}): peak since start"
    return None


def process_start_time(pid: int | str = "self") -> float | None:
    """When a process started: places 'start' before Python ran, and tells a reused pid
    from the process that wrote the records."""
    stat, system = _read(f"/proc/{pid}/stat") or "", _read("/proc/stat") or ""
    try:  # an unreadable file is an empty one: no field, no btime line
        fields = stat.rsplit(")", 1)[1].split()
        boot = next(
            float(line.split()[1]) for line in system.splitlines() if line.startswith("btime")
        )
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError, StopIteration):
        return None


def node_memory() -> NodeMemory:
    f = _kib_fields(_read("/proc/meminfo") or "", ("MemTotal", "MemAvailable"))
    return NodeMemory(f.get("MemTotal"), f.get("MemAvailable"))


def cuda_memory() -> tuple[CudaMemory | None, str]:
    """The current device's allocator figures, or None and why there are none (reads only
    what exists: never imports torch, never initialises CUDA)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None, "torch not imported in this process"
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None, "CUDA not initialised in this process"
        device = int(cuda.current_device())
        allocated, reserved = cuda.memory_allocated(device), cuda.memory_reserved(device)
        peak = cuda.max_memory_allocated(device)
        return CudaMemory(device, int(allocated), int(reserved), int(peak)), ""
    except Exception as exc:  # noqa: BLE001  (a broken CUDA must not break the rank)
        return None, f"CUDA figures unavailable ({type(exc).__name__})"


DEFAULT_SAMPLE_S = 0.1
PSS_EVERY_S = 1.0  # samples read USS/PSS (smaps_rollup) at most this often; RSS every time
PSS_CPU_SHARE = 0.002  # ... and less often if reading it would take more of a core than this
_KEEP_SAMPLES = 200_000  # in-memory recorders (the kernel): ~6 h at 10 Hz


def records_file(directory: Path, rank: int | None) -> Path:
    who = f"rank{rank}" if rank is not None else f"pid{os.getpid()}"  # by pid outside a job
    return directory / f"mem-{who}.jsonl"


@dataclass
class _Open:
    """A phase that has started and not yet ended (the recorder's stack)."""

    id: int
    name: str
    parent: int | None
    peak_rss: int = 0
    peak_pss: int = 0
    hwm: int = 0  # VmHWM folded in before a nested phase reset it
    gpu_peak: int = 0
    gpu_peak_at_start: int | None = None


class Sampler(threading.Thread):
    """One daemon thread per process: a sample each interval, until stopped or exit."""

    def __init__(self, target: Recorder, interval_s: float) -> None:
        super().__init__(name="nbgpu-mem-sampler", daemon=True)
        self._target = target
        self._interval = interval_s
        self._stopped = threading.Event()
        self.count = 0
        self.cpu_s = 0.0  # this thread's own CPU time: what sampling costs the process

    def run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._target.sample()
            except Exception:  # noqa: BLE001  (profiling must never break the rank)
                return
            self.count += 1
            self.cpu_s = time.thread_time()

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2.0)


@dataclass
class Recorder:
    """One process's phase stack and record sink (file, or memory when ``path`` is None)."""

    path: Path | None
    identity: dict[str, Any] = field(default_factory=dict)
    sample_s: float = DEFAULT_SAMPLE_S
    records: list[dict[str, Any]] = field(default_factory=list)
    samples: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_KEEP_SAMPLES))
    write_error: str | None = None

    def __post_init__(self) -> None:
        self._fd: int | None = None
        self._stack: list[_Open] = []
        self._next_id = 0
        self._lock = threading.Lock()  # this process's threads only; never across ranks
        self._sampler: Sampler | None = None
        self._next_full = 0.0  # perf_counter time of the next USS/PSS reading
        self.hwm_reset_problem: str | None = None
        if self.path is not None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError as exc:
                self.write_error = f"{self.path}: {exc.strerror}"
        self._emit(
            {
                "k": "proc",
                "t": time.time(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "process_started": process_start_time(),
                "mem_total": node_memory().total_bytes,
                "sample_s": self.sample_s,
                "mem_why": process_memory().why or None,
                **self.identity,
            }
        )

    def _emit(self, record: dict[str, Any]) -> None:
        (self.samples if record.get("k") == "s" else self.records).append(record)
        if self._fd is None:
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            os.write(self._fd, line)  # O_APPEND: one write is one whole line
        except OSError as exc:
            # A full disk must not kill the rank: keep recording in memory, say why once.
            self.write_error = f"{self.path}: {exc.strerror}"
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _snapshot(self) -> dict[str, Any]:
        """Memory now: RSS every time (constant cost), USS/PSS when the budget allows."""
        out: dict[str, Any] = {"t": time.time()}
        started = time.perf_counter()
        if started >= self._next_full:
            own = process_memory()
            out.update(rss=own.rss_bytes, uss=own.uss_bytes, pss=own.pss_bytes)
            # smaps_rollup costs more the bigger the process (5 ms in a training torch process
            # here): at most once a second, less often when dear, never more than PSS_CPU_SHARE
            # of a core. Phases around every step then cost RSS readings, not page walks.
            cost = time.perf_counter() - started
            self._next_full = started + max(PSS_EVERY_S, cost / PSS_CPU_SHARE)
        else:
            out["rss"] = resident_bytes()
        out["avail"] = node_memory().available_bytes
        cuda, _why = cuda_memory()
        if cuda is not None:
            out.update(
                gpu=cuda.device,
                gpu_alloc=cuda.allocated_bytes,
                gpu_reserved=cuda.reserved_bytes,
                gpu_max=cuda.peak_allocated_bytes,
            )
        return out

    def begin(self, name: str) -> int:
        snap = self._snapshot()
        with self._lock:
            # Resetting VmHWM would lose the enclosing phases' peak so far: fold it in first.
            current_hwm = status_bytes("VmHWM") or 0
            for outer in self._stack:
                outer.hwm = max(outer.hwm, current_hwm)
            problem = reset_peak_rss()
            self.hwm_reset_problem = self.hwm_reset_problem or problem
            opened = _Open(
                id=self._next_id,
                name=name,
                parent=self._stack[-1].id if self._stack else None,
                peak_rss=snap["rss"] or 0,
                peak_pss=snap.get("pss") or 0,
                gpu_peak=snap.get("gpu_alloc", 0),
                gpu_peak_at_start=snap.get("gpu_max"),
            )
            self._next_id += 1
            self._stack.append(opened)
        begin = {"k": "begin", "id": opened.id, "phase": name, "parent": opened.parent}
        self._emit({**begin, "depth": len(self._stack) - 1, **snap})
        return opened.id

    def end(self, phase_id: int, *, error: str | None = None) -> None:
        snap = self._snapshot()
        with self._lock:
            index = next((i for i, p in enumerate(self._stack) if p.id == phase_id), None)
            if index is None:
                return  # ended twice: the first end is the record
            closing = self._stack.pop(index)
            inner = [p.name for p in self._stack[index:]]
            self._fold(closing, snap)
            hwm_now = status_bytes("VmHWM")
            for outer in self._stack:
                outer.hwm = max(outer.hwm, hwm_now or 0)
        record: dict[str, Any] = {
            "k": "end",
            "id": closing.id,
            "phase": closing.name,
            **snap,
            "peak_rss": closing.peak_rss,
            "peak_pss": closing.peak_pss or None,
            "hwm": None if hwm_now is None else max(hwm_now, closing.hwm),
            "hwm_why": self.hwm_reset_problem,
        }
        if "gpu_alloc" in snap:
            # torch's max_memory_allocated is the peak since start (or the user's reset): if it
            # rose, the phase reached it; else the phase's peak is what its samples and ends saw.
            start_max = closing.gpu_peak_at_start
            if start_max is not None and snap["gpu_max"] > start_max:
                record["gpu_peak"] = int(snap["gpu_max"])
            else:
                record["gpu_peak"] = max(closing.gpu_peak, int(snap["gpu_alloc"]))
            record["nvml_used"], record["nvml_why"] = _nvml_used_by(os.getpid())
        if error:
            record["error"] = error
        if inner:
            record["order"] = (
                f"ended before its nested phase(s) {', '.join(repr(n) for n in inner)}, "
                "which stay open"
            )
        self._emit(record)

    @staticmethod
    def _fold(opened: _Open, snap: dict[str, Any]) -> None:
        opened.peak_rss = max(opened.peak_rss, snap.get("rss") or 0)
        opened.peak_pss = max(opened.peak_pss, snap.get("pss") or 0)
        if "gpu_alloc" in snap:
            opened.gpu_peak = max(opened.gpu_peak, snap["gpu_alloc"])

    def mark(self, name: str) -> None:
        snap = self._snapshot()
        phase = self._stack[-1].name if self._stack else None
        self._emit({"k": "mark", "name": name, "phase": phase, **snap})

    def sample(self) -> None:
        """One timeline point; also raises the running peaks of every open phase."""
        snap = self._snapshot()
        if "pss" in snap:
            # The high-water mark since the innermost phase began: the peak a sampler
            # between two ticks can miss, kept for a phase the process may die in.
            snap["hwm"] = status_bytes("VmHWM")
            if self.hwm_reset_problem:
                snap["hwm_why"] = self.hwm_reset_problem
        with self._lock:
            for opened in self._stack:
                self._fold(opened, snap)
        self._emit({"k": "s", **snap})

    def start_sampling(self) -> None:
        if self.sample_s > 0 and self._sampler is None:
            self._sampler = Sampler(self, self.sample_s)
            self._sampler.start()

    def close(self, *, error: str | None = None) -> None:
        """End every open phase (innermost first) and write the closing record."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        for opened in reversed(list(self._stack)):
            self.end(opened.id, error=error)
        self._emit({"k": "close", "t": time.time(), "write_error": self.write_error})
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _nvml_used_by(pid: int) -> tuple[int | None, str | None]:
    """GPU memory NVML attributes to *pid* (context, NCCL and allocator together)."""
    try:
        from nbgpu.devices.nvml import read_system  # noqa: PLC0415  (only ranks on CUDA)

        snapshot = read_system(os.environ)
    except Exception as exc:  # noqa: BLE001  (no NVML, no driver, no permission)
        return None, f"NVML unavailable ({type(exc).__name__})"
    if snapshot.backend.simulated:
        return None, "simulated fleet: NVML knows no per-process memory for ranks"
    used = [p.used_bytes for g in snapshot.gpus for p in g.processes if p.pid == pid]
    if not used:
        return None, "NVML lists no memory for this pid (another PID namespace?)"
    if any(u is None for u in used):
        return None, "NVML cannot attribute memory to processes here (MIG without privileges?)"
    return sum(u for u in used if u is not None), None
