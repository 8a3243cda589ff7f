"""``nbgpu.phase``: named phases of a process, recorded crash-safe as JSON lines.

    with nbgpu.phase("model"):        # nested phases are fine; names are free text
        model = build()
    nbgpu.phase.mark("POST-MODEL")    # a point in time, like the MEM: prints it replaces

Each process has one :class:`~nbgpu.profile.recorder.Recorder`: in a rank it appends to
``mem-rank{N}.jsonl`` in ``NBGPU_RUN_DIR`` (``NBGPU_MEM_DIR`` for other jobs; a slow disk delays
a record by the page cache's write, never by a flush); outside any run (the notebook kernel, a
plain script) it keeps them in memory for ``nbgpu.phase.report()``. Standard library only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.errors import UserInputError
from nbgpu.profile.recorder import DEFAULT_SAMPLE_S, Recorder, records_file

if TYPE_CHECKING:
    from nbgpu.profile.report import MemoryReport

__all__ = ["Phase", "configure", "parse_sample_interval", "phase", "recorder"]


def parse_sample_interval(value: object) -> float:
    """Seconds between samples from ``0.1``, ``"0.5"`` or ``0`` (off); else one clear line."""
    text = str(value).strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if isinstance(value, bool) or not (seconds == 0 or 0.001 <= seconds <= 3600):
        raise UserInputError(
            f"--mem-sample {text!r}: expected seconds between memory samples, from 0.001 to "
            "3600 (e.g. 0.1), or 0 to turn sampling off"
        )
    return seconds


_RECORDER: list[Recorder] = []
_SETUP = threading.Lock()


def _identity(environ: Mapping[str, str]) -> dict[str, Any]:
    raw = {key: environ.get(key, "").strip() for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    identity: dict[str, Any] = {k.lower(): int(v) if v.isdigit() else None for k, v in raw.items()}
    return {**identity, "run": environ.get("NBGPU_RUN_NAME") or None}


def configure(
    directory: Path | None,
    *,
    sample_s: float = DEFAULT_SAMPLE_S,
    environ: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Recorder:
    """Install this process's recorder (the rank entry point calls this first)."""
    env = os.environ if environ is None else environ
    identity = {**_identity(env), **(extra or {})}
    path = None if directory is None else records_file(directory, identity.get("rank"))
    with _SETUP:
        if _RECORDER:
            _RECORDER[0].close()
            _RECORDER.clear()
        rec = Recorder(path, identity, sample_s)
        _RECORDER.append(rec)
    rec.start_sampling()
    return rec


def recorder(environ: Mapping[str, str] | None = None) -> Recorder:
    """This process's recorder, created on first use from the environment."""
    if _RECORDER:
        return _RECORDER[0]
    env = os.environ if environ is None else environ
    where = env.get("NBGPU_MEM_DIR") or env.get("NBGPU_RUN_DIR")
    try:
        sample_s = parse_sample_interval(env.get("NBGPU_MEM_SAMPLE", DEFAULT_SAMPLE_S))
    except UserInputError:
        sample_s = DEFAULT_SAMPLE_S
    identity = _identity(env)
    path = records_file(Path(where), identity["rank"]) if where else None
    with _SETUP:
        if not _RECORDER:
            _RECORDER.append(Recorder(path, identity, sample_s))
    rec = _RECORDER[0]
    if rec.path is not None:
        rec.start_sampling()  # in memory only (a kernel, a plain script): sampling on request
    return rec


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise UserInputError(f"phase name {name!r}: expected a non-empty text, e.g. 'model'")
    return name.strip()


class Phase:
    """One phase: ``with nbgpu.phase("model"):`` or ``p.start() ... p.stop()``."""

    def __init__(self, name: str, recorder_: Recorder | None = None) -> None:
        self.name = _check_name(name)
        self._recorder = recorder_
        self._id: int | None = None

    def start(self) -> Phase:
        if self._id is not None:
            raise UserInputError(f"phase {self.name!r} was already started")
        self._recorder = self._recorder or recorder()
        self._id = self._recorder.begin(self.name)
        return self

    def stop(self, *, error: str | None = None) -> None:
        if self._id is not None and self._recorder is not None:
            self._recorder.end(self._id, error=error)

    def __enter__(self) -> Phase:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        exc = exc_info[1]
        self.stop(error=None if exc is None else f"{type(exc).__name__}: {exc}"[:300])


class _PhaseApi:
    """``nbgpu.phase``: call it for a phase; ``.mark(name)`` for a point in time."""

    def __call__(self, name: str) -> Phase:
        return Phase(name)

    def mark(self, name: str) -> None:
        """Record this process's memory now, labelled *name* (``MEM:POST-MODEL``)."""
        recorder().mark(_check_name(name))

    def report(self) -> MemoryReport:
        """The phases recorded so far in this process, as a report."""
        from nbgpu.profile.report import report_from_recorder  # noqa: PLC0415

        return report_from_recorder(recorder())

    def __repr__(self) -> str:
        return "nbgpu.phase(name): a memory phase; nbgpu.phase.mark(name): a point in time"


#: The public entry: ``nbgpu.phase("model")``, ``nbgpu.phase.mark("POST-MODEL")``.
phase = _PhaseApi()
