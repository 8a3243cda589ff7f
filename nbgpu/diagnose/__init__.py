"""Diagnose: from a failed run's logs to the cause, the first failing rank, and the fix.

    import nbgpu
    nbgpu.diagnose("runs/2024-05-01-sweep1")        # a run directory
    nbgpu.diagnose("train.log", inventory=nbgpu.status())
    nbgpu.diagnose(log_text).root.fixes

The package is callable: ``nbgpu.diagnose(...)`` calls :func:`diagnose`, while
``nbgpu.diagnose.Diagnosis``, ``.CATALOG`` etc. stay reachable as attributes.
:func:`diagnose` is the one entry point behind ``nbgpu.diagnose(...)``, ``nbgpu
diagnose FILE|DIR|-`` and the automatic diagnosis of failed runs: it owns the order of
the steps and the bad-input answers (empty input, binary data, a directory without
logs, no failure); the steps live in their modules.

Layout (one idea per module): ``catalog`` (causes, patterns, fixes: data) · ``lines``
(streaming bytes to the lines worth reading; prefixes, ranks, timestamps) · ``scan``
(hits, exits, tracebacks of one source) · ``sources`` (strings, files, run directories,
run.json, error files) · ``rootcause`` (which rank failed first and why) · ``enrich``
(the numbers in the log turned into advice; what the logs do not say: this machine's
GPUs, the run's memory records) · ``report`` (the results).

Maps logs and torchelastic error files to causes and fixes; reads files (streaming) and
takes an optional inventory object (passed in, never taken here). Never imports IPython,
torch, pynvml or psutil.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.diagnose.catalog import CATALOG, CAUSE_IDS, UNKNOWN, Cause, Pattern, cause
from nbgpu.diagnose.enrich import add_facts, describe_inventory
from nbgpu.diagnose.lines import WindowScanner
from nbgpu.diagnose.report import Diagnosis, Evidence, FoundCause, RankSummary, SourceSummary
from nbgpu.diagnose.rootcause import rank_failures
from nbgpu.diagnose.scan import SourceScan
from nbgpu.diagnose.sources import Inputs, LogInput, chunks, resolve
from nbgpu.errors import UserInputError

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = [
    "CATALOG",
    "CAUSE_IDS",
    "FULL_SCAN_BYTES",
    "UNKNOWN",
    "Cause",
    "Diagnosis",
    "Evidence",
    "FoundCause",
    "Pattern",
    "RankSummary",
    "SourceSummary",
    "cause",
    "diagnose",
]

#: Inputs up to this size are read line by line in full; larger ones through the
#: trigger windows (same causes on the corpus, a test checks; far faster on big logs).
FULL_SCAN_BYTES = 4 * 1024 * 1024


def _binary(sample: bytes | bytearray) -> bool:
    """Mostly non-text bytes: NULs, or invalid UTF-8 that is not Latin-1 text."""
    if not sample:
        return False
    if sample.count(b"\x00") > len(sample) // 100:
        return True
    text = sample.decode("utf-8", "replace")
    return text.count("\ufffd") > len(text) // 10


def _size(log: LogInput) -> int | None:
    if log.data is not None:
        return len(log.data)
    if log.path is not None:
        try:
            return log.path.stat().st_size - log.offset
        except OSError:
            return None
    return None


def _lines_before(path: Path, offset: int) -> int:
    count = 0
    with contextlib.suppress(OSError), path.open("rb") as handle:
        while offset > 0:
            piece = handle.read(min(offset, 1 << 20))
            if not piece:
                break
            count += piece.count(b"\n")
            offset -= len(piece)
    return count


def _scan_log(
    log: LogInput, counter: Any, notes: list[str], *, full: bool | None
) -> tuple[SourceScan, SourceSummary]:
    scan = SourceScan(log.name, default_rank=log.default_rank, counter=counter)
    size = _size(log)
    whole = full if full is not None else (size is not None and size <= FULL_SCAN_BYTES)
    # Line numbers stay those of the file when reading starts further in (a warm job).
    skipped = _lines_before(log.path, log.offset) if log.offset and log.path else 0
    scanner = WindowScanner(scan.feed_raw, full=whole, first_line=skipped + 1)
    first = True
    try:
        for piece in chunks(log):
            if first:
                first = False
                if _binary(piece[:65536]):
                    notes.append(f"{log.name}: looks like binary data, not a text log")
            scanner.feed(piece)
    except OSError as exc:
        notes.append(f"{log.name}: read failed ({exc.strerror or exc.__class__.__name__})")
    scanner.close()
    scan.finish()
    return scan, SourceSummary(log.name, scanner.lines, scanner.bytes_read, log.default_rank)


def _scan_error_files(inputs: Inputs, counter: Any) -> list[SourceScan]:
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


def _world_size(inputs: Inputs, scans: list[SourceScan]) -> int | None:
    if inputs.run is not None and inputs.run.world_size:
        return inputs.run.world_size
    ranks = {r for s in scans for r in s.ranks_seen}
    ranks |= {x.rank for s in scans for x in s.exits if x.rank is not None}
    return max(ranks) + 1 if ranks else None


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
    ``error-rank{N}.json``, ``agent.log``), ``"-"`` for stdin, a binary or text stream,
    the log text itself (``str`` or ``bytes``), or a run object with a ``run_dir``
    attribute. ``inventory`` is an ``nbgpu.status()`` snapshot (live or simulated): with
    it a found cause names the physical GPU, its holder and the exact ``--gpus`` to use.
    ``name`` labels a text or stream source in the evidence. ``full_scan`` forces
    (True) or forbids (False) reading every line instead of the trigger windows.

    A path that does not exist raises ``UserInputError``; every other input gets an
    answer, "no failure found" included.
    """
    if max_evidence < 1:
        raise UserInputError(f"max_evidence={max_evidence}: expected a whole number >= 1")
    started = time.perf_counter()
    inputs = resolve(source, name=name)
    notes = list(inputs.notes)
    counter = itertools.count()
    if not inputs.logs and not inputs.errors:
        return Diagnosis(
            status="no_logs",
            input=inputs.label,
            causes=(),
            notes=(*notes, "no log files (*.log, *.txt, *.out, *.err) or error files found"),
            elapsed_ms=(time.perf_counter() - started) * 1000,
        )
    scans: list[SourceScan] = []
    summaries: list[SourceSummary] = []
    for log in inputs.logs:
        scan, summary = _scan_log(log, counter, notes, full=full_scan)
        scans.append(scan)
        summaries.append(summary)
    error_scans = _scan_error_files(inputs, counter)
    summaries.extend(SourceSummary(s.name, s.lines_seen, 0, s.default_rank) for s in error_scans)
    if sum(s.bytes for s in summaries) == 0 and not error_scans:
        return Diagnosis(
            status="empty",
            input=inputs.label,
            causes=(),
            sources=tuple(summaries),
            notes=tuple(notes),
            elapsed_ms=(time.perf_counter() - started) * 1000,
        )
    world = _world_size(inputs, scans + error_scans)
    ranking = rank_failures(
        [*scans, *error_scans],
        inputs.errors,
        inputs.run,
        max_evidence=max_evidence,
        world_size=world,
    )
    return Diagnosis(
        status="failure" if ranking.failed else "no_failure",
        input=inputs.label,
        causes=add_facts(ranking.causes, inputs.run, inventory),
        ranks=ranking.ranks,
        sources=tuple(summaries),
        notes=(*notes, *ranking.notes),
        world_size=world,
        inventory=describe_inventory(inventory) if inventory is not None else None,
        elapsed_ms=(time.perf_counter() - started) * 1000,
    )


class _CallableModule(types.ModuleType):
    """This package's module type: calling the module calls :func:`diagnose`."""

    def __call__(
        self,
        source: object,
        *,
        inventory: Inventory | None = None,
        name: str | None = None,
        max_evidence: int = 5,
        full_scan: bool | None = None,
    ) -> Diagnosis:
        return diagnose(
            source, inventory=inventory, name=name, max_evidence=max_evidence, full_scan=full_scan
        )


sys.modules[__name__].__class__ = _CallableModule
