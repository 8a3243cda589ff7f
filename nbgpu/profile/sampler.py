"""The background sampler: one daemon thread per process, one record per interval.

The training thread never waits for it: sampling reads /proc and appends one line
on the sampler's own thread; the only thing it shares with phase changes is this
process's own short lock around the phase stack. Stops with the process (daemon)
or with :meth:`Sampler.stop`. Standard library only.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Sampler"]


class _Samples(Protocol):
    def sample(self) -> None: ...


class Sampler(threading.Thread):
    def __init__(self, target: _Samples, interval_s: float) -> None:
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
