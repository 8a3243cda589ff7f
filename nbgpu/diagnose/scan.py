"""What one log says: catalog hits, exits, exceptions and tracebacks, line by line.

:class:`SourceScan` reads one source (a rank's log, torchrun's output, a pasted string, an
error file's call stack) and keeps, within fixed bounds: the first few :class:`Hit` s per
cause and rank, torchrun's ``ChildFailedError`` banner and ``failed (exitcode: N)
local_rank: R`` lines as :class:`ExitRecord` s, and the exception lines with the traceback
above them. Nothing here decides the root cause (``rootcause.py`` does).
"""

import re
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from nbgpu.diagnose.catalog import SECONDARY, SECONDARY_KEYWORDS, Cause, Pattern, candidates
from nbgpu.diagnose.lines import ParsedLine, Stamp, parse_line, parse_stamp_text

__all__ = ["ExceptionLine", "ExitRecord", "Hit", "SourceScan"]

SECONDARY_ID = "_secondary"
_HITS_PER_KEY = 3  # first hits kept per (cause, rank)
_MAX_EXCEPTIONS = 64
_TRACEBACK_LINES = 40
_TEXT_CHARS = 400  # evidence lines are cut to this many characters
_CONTEXT_LINES = 2  # lines after a hit kept for parameters split over lines

_EXCEPTION = re.compile(
    r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure))(?::\s?(.*))?$"
)
# argparse's exit: "train.py: error: unrecognized arguments: --local-rank=1"
_USAGE_ERROR = re.compile(r"^[\w./\\-]+\.py: error: .+")
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SPAWN_SIGNAL = re.compile(r"process (\d+) terminated with (?:signal (SIG\w+)|exit code (-?\d+))")
_BANNER_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*$")
_BANNER_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")
_BANNER_RANK = re.compile(r"(\d+)\s*\(local_rank:\s*(\d+)\)")
_BANNER_EXIT = re.compile(r"(-?\d+)\s*\(pid:\s*(\d+)\)(?:\s*\((SIG\w+)\))?")
_SIGNAL_TEXT = re.compile(r"Signal (\d+) \((SIG\w+)\)")
# An exit code that means a signal: torchrun reports -N for signal N; a shell between it and
# Python reports 128+N. One table for the scan and the root cause.
SIGNAL_OF_CODE: dict[int | None, str] = {-2: "SIGINT", -6: "SIGABRT", -7: "SIGBUS", -9: "SIGKILL",
                                         -11: "SIGSEGV", -15: "SIGTERM", 137: "SIGKILL",
                                         139: "SIGSEGV"}  # fmt: skip
_LAUNCHER_EXCEPTIONS = frozenset({"ChildFailedError", "CalledProcessError", "ProcessRaisedException",
                                  "ProcessExitedException", "SignalException", "KeyboardInterrupt",
                                  "SystemExit"})  # fmt: skip


@dataclass
class Hit:
    """A line that matched a catalog pattern (or a secondary marker)."""

    cause: str
    confidence: float
    consequence: bool
    source: str
    lineno: int | None
    text: str
    rank: int | None
    local_rank: int | None
    stamp: Stamp | None
    order: int
    context: list[str] = field(default_factory=list)  # the lines after it (see rootcause)


@dataclass(frozen=True)
class ExitRecord:
    """How a rank ended, as torchrun (or ``mp.spawn``) reported it, or run.json recorded it."""

    rank: int | None
    local_rank: int | None
    exit_code: int | None
    signal: str | None
    stamp: Stamp | None
    source: str
    lineno: int | None
    root: bool = False  # listed under "Root Cause (first observed failure)"


@dataclass(frozen=True)
class ExceptionLine:
    """A Python exception line and the traceback above it, if one was seen."""

    name: str
    text: str
    rank: int | None
    source: str
    lineno: int | None
    order: int
    traceback: tuple[str, ...]

    @property
    def launcher(self) -> bool:
        """Raised by the launcher about a child, not by the child itself."""
        return self.name.rsplit(".", 1)[-1] in _LAUNCHER_EXCEPTIONS


@dataclass
class _Traceback:
    lines: deque[str]
    last: int | None  # line number of the last line taken


class SourceScan:
    """Everything worth keeping from one source; feed it lines in order. Cost per line: a
    fixed number of regular expressions (prefix, banner, exception shape), the catalog's
    keywords tested once on the lowered line, and the patterns of the causes whose keyword
    it holds - at most three times for the start of an exception message a terminal wrapped
    (it is joined with the next two)."""

    def __init__(
        self, name: str, *, default_rank: int | None = None, counter: Iterator[int]
    ) -> None:
        self.name = name
        self.default_rank = default_rank
        self._counter = counter
        self.hits: list[Hit] = []
        self.exits: list[ExitRecord] = []
        self.exceptions: list[ExceptionLine] = []
        self.ranks_seen: set[int] = set()
        self.lines_seen = 0
        self._kept: Counter[tuple[str, int | None]] = Counter()
        self._pending: list[Hit] = []  # hits still taking the lines after them
        self._tracebacks: dict[int | None, _Traceback] = {}
        self._banner_root = False
        self._entry: dict[str, object] | None = None
        self._entry_rank: int | None = None
        self._in_entry_traceback = False
        self._unmatched: tuple[int | None, ParsedLine, str, int] | None = None
        self.catalog_lookups = 0  # texts looked up in the catalog (a line, a joined line)
        self.cause_checks = 0  # causes whose patterns were run on them

    def feed_raw(self, lineno: int | None, raw: bytes) -> None:
        """One raw line from a file (bytes, possibly with ``\\r`` progress updates)."""
        text = raw.decode("utf-8", "replace")
        if "\r" in text:
            for piece in text.split("\r"):
                if piece.strip():
                    self.feed(lineno, piece)
        else:
            self.feed(lineno, text)

    def feed(self, lineno: int | None, text: str) -> None:
        self.lines_seen += 1
        line = parse_line(text, self.default_rank)
        body = line.body
        entry_rank = self._entry_rank
        if body.strip():
            self._banner(lineno, body)
        rank = line.rank
        if rank is None:
            # Lines of a banner entry (its exitcode, its traceback) belong to its rank.
            rank = self._entry_rank if self._entry_rank is not None else entry_rank
            line = ParsedLine(rank, line.local_rank, line.stamp, body)
        if rank is not None:
            self.ranks_seen.add(rank)
        for hit in self._pending:
            hit.context.append(body.strip()[:_TEXT_CHARS])
        self._pending = [h for h in self._pending if len(h.context) < _CONTEXT_LINES]
        if not body.strip():
            return
        lowered = body.lower()
        matches = self._matches(body, lowered)
        for cause, pattern in matches:
            self._keep(cause.id, pattern, body, lineno, line)
        if not matches:
            self._wrapped(body, lineno, line)
        if any(k in lowered for k in SECONDARY_KEYWORDS):
            for pattern in SECONDARY:
                if pattern.regex.search(body):
                    self._keep(SECONDARY_ID, pattern, body, lineno, line)
                    break
        self._agent_lines(lineno, body, line.stamp)
        self._python(lineno, body, rank)

    def _wrapped(self, body: str, lineno: int | None, line: ParsedLine) -> None:
        """Match an exception message that a terminal or rich wrapped over several lines."""
        waiting = self._unmatched
        self._unmatched = None
        if waiting is None:
            if _EXCEPTION.match(body.strip()):
                self._unmatched = (lineno, line, body.strip(), 2)
            return
        first_lineno, first, joined, left = waiting
        joined = f"{joined} {body.strip()}"
        if matches := self._matches(joined, joined.lower()):
            self._keep(matches[0][0].id, matches[0][1], joined, first_lineno, first)
        elif left > 1:
            self._unmatched = (first_lineno, first, joined, left - 1)

    def _matches(self, text: str, lowered: str) -> list[tuple[Cause, Pattern]]:
        """The causes ``text`` matches, each with its first matching pattern, in catalog order."""
        self.catalog_lookups += 1
        found = []
        for cause in candidates(lowered):
            self.cause_checks += 1
            if (pattern := cause.search(text)) is not None:
                found.append((cause, pattern))
        return found

    def finish(self) -> None:
        """Close the banner entry the source ended in."""
        self._end_entry()
        self._pending.clear()

    def _keep(
        self, cause_id: str, pattern: Pattern, body: str, lineno: int | None, line: ParsedLine
    ) -> None:
        key = (cause_id, line.rank)
        if self._kept[key] >= _HITS_PER_KEY:
            return
        self._kept[key] += 1
        hit = Hit(
            cause=cause_id,
            confidence=pattern.confidence,
            consequence=pattern.consequence,
            source=self.name,
            lineno=lineno,
            text=body.strip()[:_TEXT_CHARS],
            rank=line.rank,
            local_rank=line.local_rank,
            stamp=line.stamp,
            order=next(self._counter),
        )
        self.hits.append(hit)
        self._pending.append(hit)

    def _banner(self, lineno: int | None, body: str) -> None:
        stripped = body.strip()
        root = "Root Cause (first observed failure)" in body
        if root or stripped.startswith("Failures:"):
            self._end_entry()
            self._banner_root = root
            return
        if stripped.startswith(("====", "----")):
            self._end_entry()
            return
        if _BANNER_ENTRY.match(body):
            self._end_entry()
            self._entry = {"root": self._banner_root, "lineno": lineno}
            return
        field_match = _BANNER_FIELD.match(body)
        if field_match and self._entry is None and field_match.group(1) in ("rank", "exitcode"):
            # A banner cut by the window or by a copy-paste: start an entry anyway.
            self._entry = {"root": self._banner_root, "lineno": lineno}
        if self._entry is None:
            return
        if field_match and not self._in_entry_traceback:
            key, value = field_match.group(1), field_match.group(2).strip()
            self._entry[key] = value
            if key == "rank" and (r := _BANNER_RANK.search(value)):
                self._entry_rank = int(r.group(1))
            if key == "traceback":
                self._in_entry_traceback = value.startswith("Traceback")
                if not self._in_entry_traceback:
                    self._end_entry()
        elif self._in_entry_traceback and not body.startswith((" ", "\t")):
            self._end_entry()

    def _end_entry(self) -> None:
        entry, self._entry = self._entry, None
        self._in_entry_traceback = False
        self._entry_rank = None
        if not entry or ("rank" not in entry and "exitcode" not in entry):
            return
        r = _BANNER_RANK.search(str(entry.get("rank", "")))
        e = _BANNER_EXIT.search(str(entry.get("exitcode", "")))
        s = _SIGNAL_TEXT.search(str(entry.get("traceback", "")))
        lineno = entry.get("lineno")
        self.exits.append(
            ExitRecord(
                rank=int(r.group(1)) if r else None,
                local_rank=int(r.group(2)) if r else None,
                exit_code=int(e.group(1)) if e else None,
                signal=(e.group(3) if e else None) or (s.group(2) if s else None),
                stamp=parse_stamp_text(str(entry.get("time", ""))),
                source=self.name,
                lineno=lineno if isinstance(lineno, int) else None,
                root=bool(entry.get("root")),
            )
        )

    def _agent_lines(self, lineno: int | None, body: str, stamp: Stamp | None) -> None:
        if "exitcode" in body and (m := _AGENT_FAILED.search(body)):
            code = int(m.group(1))
            signal = SIGNAL_OF_CODE.get(code)
            self.exits.append(
                ExitRecord(None, int(m.group(2)), code, signal, stamp, self.name, lineno)
            )
        elif "terminated with" in body and (m := _SPAWN_SIGNAL.search(body)):
            rank, spawn_code = int(m.group(1)), int(m.group(3)) if m.group(3) else None
            signal = m.group(2) or SIGNAL_OF_CODE.get(spawn_code)
            self.exits.append(ExitRecord(rank, rank, spawn_code, signal, stamp, self.name, lineno))

    def _python(self, lineno: int | None, body: str, rank: int | None) -> None:
        if "Traceback (most recent call last)" in body:
            lines = deque([body.strip()], maxlen=_TRACEBACK_LINES)
            self._tracebacks[rank] = _Traceback(lines, lineno)
            return
        text = body.strip().removeprefix("traceback :").strip()
        # Indented exception lines occur too: torchrun's banner indents the child's traceback.
        m = _EXCEPTION.match(text) or _USAGE_ERROR.match(text)
        tb = self._tracebacks.get(rank)
        if m is None:
            if tb is not None:
                if tb.last is not None and lineno is not None and lineno > tb.last + 1:
                    tb.lines.append("...")
                tb.lines.append(text)
                tb.last = lineno
            return
        frames: tuple[str, ...] = () if tb is None else (*tb.lines, text)
        self._tracebacks.pop(rank, None)
        if len(self.exceptions) >= _MAX_EXCEPTIONS:
            self.exceptions.pop(_MAX_EXCEPTIONS // 2)  # keep the first and the latest ones
        exc_name = m.group(1) if m.re is _EXCEPTION else "UsageError"
        order = next(self._counter)
        self.exceptions.append(
            ExceptionLine(exc_name, text[:_TEXT_CHARS], rank, self.name, lineno, order, frames)
        )
