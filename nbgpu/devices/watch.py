"""Sampling the GPUs over time for live views: a bounded history and a background thread.

:class:`Watcher` takes an inventory snapshot every ``interval_s`` seconds on a daemon
thread (NVML and ``/proc`` only: no CUDA, no device-file scan) and keeps the last
``history`` samples. A stopped watcher never samples again; a sample that raises ends the
thread with the error kept (``error``), never silently.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nbgpu.devices.sim import simulation_source
from nbgpu.errors import UserInputError

__all__ = [
    "MAX_HISTORY", "MIN_INTERVAL_S", "GpuPoint", "ProcessPoint", "Sample", "Watcher",
    "parse_watch_options",
]  # fmt: skip

#: Faster than this the sampling itself would be the load being watched.
MIN_INTERVAL_S = 0.2
#: A day of samples at 1 Hz is 86,400 points per GPU; more is a typo, not a wish.
MAX_HISTORY = 86_400


@dataclass(frozen=True)
class ProcessPoint:
    pid: int
    used_bytes: int | None
    state: str  # the holder's: alive, dead, zombie, other_namespace, ...
    label: str | None = None  # "this kernel", "run 'x' rank 1", ...


@dataclass(frozen=True)
class GpuPoint:
    index: int
    name: str | None
    utilization_pct: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    temperature_c: int | None
    power_w: float | None
    processes: tuple[ProcessPoint, ...]
    error: str | None = None


@dataclass(frozen=True)
class Sample:
    at: float  # time.time()
    gpus: tuple[GpuPoint, ...]
    simulated: str | None
    note: str | None = None  # NVML unavailable, and why


def parse_watch_options(interval: str | float, history: str | int) -> tuple[float, int]:
    try:
        interval_s = float(interval)
    except (TypeError, ValueError):
        raise UserInputError(
            f"--interval {interval!r} is not a number; expected seconds, at least "
            f"{MIN_INTERVAL_S:g} (e.g. --interval 1)"
        ) from None
    if not interval_s >= MIN_INTERVAL_S:  # also catches NaN
        raise UserInputError(
            f"--interval {interval!r}: expected seconds, at least {MIN_INTERVAL_S:g} "
            "(faster sampling would load the GPUs it watches)"
        )
    try:
        count = int(str(history))
    except ValueError:
        raise UserInputError(
            f"--history {history!r} is not a whole number; expected 2 to {MAX_HISTORY}"
        ) from None
    if not 2 <= count <= MAX_HISTORY:
        raise UserInputError(f"--history {history!r}: expected 2 to {MAX_HISTORY} samples")
    return interval_s, count


def take_sample(
    environ: Mapping[str, str], label_pid: Callable[[int], str | None] | None = None
) -> Sample:
    from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415

    inv = take_inventory(environ, scan_device_files=False)

    def label(pid: int) -> str | None:
        if pid == os.getpid():
            return "this kernel"
        return label_pid(pid) if label_pid is not None else None

    gpus = tuple(
        GpuPoint(
            index=g.nvml_index,
            name=g.name,
            utilization_pct=g.utilization_gpu_pct,
            memory_used_bytes=g.memory_used_bytes,
            memory_total_bytes=g.memory_total_bytes,
            temperature_c=g.temperature_c,
            power_w=g.power_w,
            processes=tuple(
                ProcessPoint(p.pid, p.used_bytes, p.state, label(p.pid)) for p in g.processes
            ),
            error=g.error,
        )
        for g in inv.gpus
    )
    fleet = simulation_source(environ) if inv.simulated else None
    return Sample(time.time(), gpus, fleet, inv.nvml_error)


class Watcher:
    def __init__(
        self,
        *,
        interval_s: float = 1.0,
        history: int = 300,
        environ: Mapping[str, str] | None = None,
        label_pid: Callable[[int], str | None] | None = None,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        self.interval_s, self.history = parse_watch_options(interval_s, history)
        self.environ = dict(os.environ if environ is None else environ)
        self.label_pid = label_pid
        self.on_sample = on_sample
        self.samples: deque[Sample] = deque(maxlen=self.history)
        self.error: str | None = None  # why the thread ended, if a sample failed
        self.sampling_s = 0.0  # CPU time spent sampling (the overhead, for benchmarks)
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> Watcher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nbgpu-watch", daemon=True)
            self._thread.start()
        return self

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End sampling for good; returns once the thread has exited (or the timeout)."""
        self._stop.set()
        self._running.set()  # wake a paused thread so it can see the stop
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def sample_now(self) -> Sample:
        started = time.thread_time()
        sample = take_sample(self.environ, self.label_pid)
        self.sampling_s += time.thread_time() - started
        self.samples.append(sample)
        return sample

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._running.wait()
            if self._stop.is_set():
                break
            try:
                sample = self.sample_now()
                if self.on_sample is not None:
                    self.on_sample(sample)
            except Exception as exc:  # noqa: BLE001  (a failing sample ends the thread, said)
                self.error = f"{type(exc).__name__}: {exc}"
                self._stop.set()
                break
            next_at += self.interval_s
            # Keep the cadence; after a long stall (a paused or busy kernel) restart it.
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at, delay = time.monotonic(), 0.0
            self._stop.wait(delay)
