"""``diagnose()``: read the sources, scan them, rank the failures, add specifics and GPU facts.

The one entry point behind ``nbgpu.diagnose(...)``, ``nbgpu diagnose FILE|DIR|-`` and the
automatic diagnosis of failed runs. It owns the order of the steps and the bad-input
answers (empty input, binary data, a directory without logs, no failure); the steps live
in their modules. Imports only the standard library and sibling modules: never IPython,
torch, pynvml or psutil (an inventory is passed in, not taken here).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.diagnose.enrich import describe_inventory, enrich, gpu_for_rank
from nbgpu.diagnose.report import Diagnosis, SourceSummary
from nbgpu.diagnose.rootcause import rank_failures
from nbgpu.diagnose.scan import SourceScan
from nbgpu.diagnose.sources import Inputs, LogInput, chunks, resolve
from nbgpu.diagnose.window import WindowScanner
from nbgpu.errors import UserInputError

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = ["FULL_SCAN_BYTES", "diagnose"]

#: Inputs up to this size are read line by line in full; larger ones through the
#: trigger windows (same causes on the corpus, a test checks; far faster on big logs).
FULL_SCAN_BYTES = 4 * 1024 * 1024
_GPU_CAUSES = ("cuda_busy", "cuda_oom", "illegal_access", "device_assert", "gpu_lost")


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
    causes = ranking.causes
    if inventory is not None:
        causes = enrich(causes, inputs.run, inventory)
    elif (
        causes
        and causes[0].root
        and causes[0].cause in _GPU_CAUSES
        and causes[0].first_rank is not None
    ):
        where = gpu_for_rank(causes[0].first_rank, inputs.run, None)
        if where is not None:
            root = causes[0]
            line = f"rank {root.first_rank} ran on cuda:{where[0]} = physical GPU {where[1]} (run.json)"
            causes = (replace(root, details=(*root.details, line)), *causes[1:])
    from nbgpu.diagnose.memory import with_memory_details  # noqa: PLC0415

    causes = with_memory_details(causes, inputs.run.path if inputs.run is not None else None)
    if inputs.run is not None and inputs.run.nodes:
        # A run over several nodes: each cause names where its first rank ran.
        causes = tuple(
            replace(c, first_node=inputs.run.nodes.get(c.first_rank))
            if c.first_rank is not None
            else c
            for c in causes
        )
    return Diagnosis(
        status="failure" if ranking.failed else "no_failure",
        input=inputs.label,
        causes=causes,
        ranks=ranking.ranks,
        sources=tuple(summaries),
        notes=(*notes, *ranking.notes),
        world_size=world,
        inventory=describe_inventory(inventory) if inventory is not None else None,
        elapsed_ms=(time.perf_counter() - started) * 1000,
    )
