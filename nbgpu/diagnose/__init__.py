"""Diagnose: from a failed run's logs to the cause, the first failing rank, and the fix.

    import nbgpu
    nbgpu.diagnose("runs/2024-05-01-sweep1")        # a run directory
    nbgpu.diagnose("train.log", inventory=nbgpu.status())
    nbgpu.diagnose(log_text).root.fixes

The package is callable: :func:`diagnose` is the one entry point behind
``nbgpu.diagnose(...)``, ``nbgpu diagnose FILE|DIR|-`` and the automatic diagnosis of failed
runs. It owns the order of the steps and the bad-input answers (empty input, binary data, a
directory without logs, no failure); the steps live in ``catalog`` (data) · ``lines`` ·
``scan`` (one source) · ``sources`` · ``hang`` (a stall) · ``rootcause`` · ``enrich`` ·
``report`` (the results). Takes an optional inventory (passed in, never taken here). Never
imports IPython, torch, pynvml or psutil.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.diagnose.catalog import CATALOG, CAUSE_IDS, UNKNOWN, Cause, cause
from nbgpu.diagnose.enrich import add_facts, describe_inventory
from nbgpu.diagnose.hang import stall_cause, with_stall
from nbgpu.diagnose.lines import WindowScanner
from nbgpu.diagnose.report import Diagnosis, Evidence, FoundCause, RankSummary, SourceSummary
from nbgpu.diagnose.rootcause import rank_failures
from nbgpu.diagnose.scan import SourceScan
from nbgpu.diagnose.sources import Inputs, LogInput, chunks, resolve
from nbgpu.errors import UserInputError

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = ["CATALOG", "CAUSE_IDS", "UNKNOWN", "Cause", "Diagnosis", "Evidence", "FoundCause",
           "RankSummary", "SourceSummary", "cause", "diagnose"]  # fmt: skip

# Inputs up to this size are read line by line in full; larger ones through the trigger
# windows (same causes on the corpus, a test checks; far faster on big logs).
_FULL_SCAN_BYTES = 4 * 1024 * 1024


def _binary(sample: bytes | bytearray) -> bool:
    """Mostly non-text bytes: NULs, or invalid UTF-8 that is not Latin-1 text."""
    text = sample.decode("utf-8", "replace")
    return sample.count(b"\x00") > len(sample) // 100 or text.count("\ufffd") > len(text) // 10


def _size(log: LogInput) -> int | None:
    if log.data is not None:
        return len(log.data)
    try:
        return log.path.stat().st_size - log.offset if log.path is not None else None
    except OSError:
        return None


def _lines_before(path: Path, offset: int) -> int:
    count = 0
    with contextlib.suppress(OSError), path.open("rb") as handle:
        while offset > 0 and (piece := handle.read(min(offset, 1 << 20))):
            count += piece.count(b"\n")
            offset -= len(piece)
    return count


def _scan_log(
    log: LogInput, counter: Iterator[int], notes: list[str], *, full: bool | None
) -> tuple[SourceScan, SourceSummary]:
    scan = SourceScan(log.name, default_rank=log.default_rank, counter=counter)
    size = _size(log)
    whole = full if full is not None else (size is not None and size <= _FULL_SCAN_BYTES)
    # Line numbers stay those of the file when reading starts further in (a warm job).
    skipped = _lines_before(log.path, log.offset) if log.offset and log.path else 0
    scanner = WindowScanner(scan.feed_raw, full=whole, first_line=skipped + 1)
    try:
        for piece in chunks(log):
            if scanner.bytes_read == 0 and _binary(piece[:65536]):
                notes.append(f"{log.name}: looks like binary data, not a text log")
            scanner.feed(piece)
    except OSError as exc:
        notes.append(f"{log.name}: read failed ({exc.strerror or exc.__class__.__name__})")
    scanner.close()
    scan.finish()
    return scan, SourceSummary(log.name, scanner.lines, scanner.bytes_read, log.default_rank)


def _scan_error_files(inputs: Inputs, counter: Iterator[int]) -> list[SourceScan]:
    scans = []
    for record in inputs.errors:
        scan = SourceScan(record.path.name, default_rank=record.rank, counter=counter)
        # The message is the exception line; the call stack ends with the same line.
        lines = record.callstack.splitlines() or [record.message]
        if record.message and record.callstack and record.message not in record.callstack:
            lines.append(record.message)
        for number, line in enumerate(lines, 1):
            scan.feed(number, line)
        scan.finish()
        scans.append(scan)
    return scans


def diagnose(
    source: object,
    *,
    inventory: Inventory | None = None,
    name: str | None = None,
    max_evidence: int = 5,
    full_scan: bool | None = None,
) -> Diagnosis:
    """Name the cause of a failed run, the rank that failed first, the evidence and the fix.

    ``source`` is a log file path, a run directory (``run.json``, ``rank{N}.log``,
    ``error-rank{N}.json``, ``agent.log``), ``"-"`` for stdin, a binary or text stream, the
    log text itself (``str`` or ``bytes``), or a run (``nbgpu.runs()[name]``, or an object
    with a ``run_dir`` attribute). With ``inventory`` (an ``nbgpu.status()`` snapshot, live or
    simulated) a found cause names the physical GPU, its holder and the exact ``--gpus``.
    ``name`` labels a text or stream source in the evidence. ``full_scan`` forces (True) or
    forbids (False) reading every line instead of the trigger windows. A path that does not
    exist raises ``UserInputError``; any other input gets an answer, "no failure found" too.
    """
    if max_evidence < 1:
        raise UserInputError(f"max_evidence={max_evidence}: expected a whole number >= 1")
    started = time.perf_counter()
    inputs = resolve(source, name=name)
    stall = stall_cause(inputs)  # a stall's record, nbgpu's or NCCL's (it may add notes)
    notes = list(inputs.notes)

    def answer(status: str, **fields: Any) -> Diagnosis:
        elapsed_ms = (time.perf_counter() - started) * 1000
        return Diagnosis(status=status, input=inputs.label, elapsed_ms=elapsed_ms, **fields)

    if not inputs.logs and not inputs.errors:
        if stall is not None:  # NCCL's dumps alone
            return answer("failure", causes=(stall,), notes=tuple(notes))
        notes.append("no log files (*.log, *.txt, *.out, *.err) or error files found")
        return answer("no_logs", causes=(), notes=tuple(notes))
    counter = itertools.count()
    logs = [_scan_log(log, counter, notes, full=full_scan) for log in inputs.logs]
    errors = _scan_error_files(inputs, counter)
    scans = [scan for scan, _ in logs] + errors
    sources = (
        *(summary for _, summary in logs),
        *(SourceSummary(s.name, s.lines_seen, 0, s.default_rank) for s in errors),
    )
    if not inputs.errors and sum(s.bytes for s in sources) == 0:
        return answer("empty", causes=(), sources=sources, notes=tuple(notes))
    world = inputs.run.world_size if inputs.run is not None else None
    if not world:
        ranks = {r for s in scans for r in s.ranks_seen}
        ranks |= {x.rank for s in scans for x in s.exits if x.rank is not None}
        world = max(ranks) + 1 if ranks else None
    ranking = rank_failures(
        scans, inputs.errors, inputs.run, max_evidence=max_evidence, world_size=world
    )
    causes = add_facts(ranking.causes, inputs.run, inventory)
    return answer(
        "failure" if ranking.failed or stall is not None else "no_failure",
        causes=causes if stall is None else with_stall(causes, stall),
        ranks=ranking.ranks,
        sources=sources,
        notes=(*notes, *ranking.notes),
        world_size=world,
        inventory=describe_inventory(inventory) if inventory is not None else None,
    )


class _CallableModule(types.ModuleType):
    __call__ = staticmethod(diagnose)


sys.modules[__name__].__class__ = _CallableModule
