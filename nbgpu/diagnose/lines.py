"""Log lines: which ones are worth reading, and what each one says.

:class:`WindowScanner` streams raw bytes in any chunking. A training log is mostly
progress bars and loss lines, and decoding and matching every one of them costs seconds
per hundred megabytes: the scanner finds the catalog's trigger strings in one
regular-expression pass (C speed) and hands over only the lines within a window around
each hit - a few before (the head of a banner or traceback) and more after (the traceback
body, a message continued on the next line). Line numbers count ``\\n`` as editors do; a ``\\r``
progress bar stays one line. Memory is bounded: one chunk, a short tail of previous
lines, and a cap on any single line (a megabyte without a newline is cut, its matching
pieces kept). ``full=True`` hands over every line (small inputs, tests).

Linear time, whatever the log looks like: every line is walked a bounded number of
times (found by the trigger search, its shape taken once if it holds a trigger, walked
once by the window that hands it over). A trigger line opens no window when it is routine
output, its shape (``_VARYING``) seen ``ROUTINE_REPEATS`` times - the same warning from
every rank at every step, a retried request's traceback, a loss line with a field named
``error``: its first occurrences are read in full, so what it says is still known, but not
a million of them. Nor does one that cannot begin a failure's story (``_STORY``); a window
around a story-telling line still hands it over.

:func:`parse_line` undoes the decorations launchers and libraries put on a line (each
pattern below names one). A timestamp keeps its *kind*: glog stamps have no year, so they
are only compared with other glog stamps.
"""

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from nbgpu.diagnose.catalog import SECONDARY_KEYWORDS, TRIGGERS, candidates

__all__ = ["MAX_LINE_BYTES", "ParsedLine", "Stamp", "WindowScanner", "parse_line",
           "parse_stamp_text"]  # fmt: skip

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# [rank3]: / [default3]: / [rank3]:[E1206 ...] - torch >= 2.2 and torchrun --tee.
_RANK_PREFIX = re.compile(r"\[(?:rank|default)(\d+)\]:")
# "[Rank 3]" / "[PG 1 Rank 3]" / "[PG ID 0 PG GUID 0(default_pg) Rank 3]" in NCCL messages.
_NCCL_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]")
# NCCL's own log lines: "host:pid:tid [3] NCCL WARN ..." (the number is the local device).
_NCCL_DEVICE = re.compile(r"^[\w.\-]+:\d+:\d+ \[(\d+)\] .{0,80}NCCL ")
# glog: "E0227 17:39:41.510000 293816 file.py:732] " (also inside "[rank0]:[E1206 18:44:12.7 ...]").
# torch's C++ logger drops the month's leading zero ("E321" is March 21).
_GLOG = re.compile(r"(?:^|\[)([IWEF])(\d{3,4}) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?\b[^\]]{0,200}\]\s?")
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?")
_PREFIX_NOISE = re.compile(r"^(?:\[\d+\]\s+)+")  # "[80746] " process/line-number prefixes


@dataclass(frozen=True)
class Stamp:
    """A point in time and the clock it was read from (``epoch``, ``iso`` or ``glog``)."""

    kind: str
    seconds: float


@dataclass(frozen=True)
class ParsedLine:
    rank: int | None  # global rank when the prefix says so
    local_rank: int | None  # NCCL's device index: a local rank, not a global one
    stamp: Stamp | None
    body: str  # the message without launcher prefixes


def _stamp(
    kind: str, fields: tuple[int, int, int, int, int, int], frac: str | None
) -> Stamp | None:
    try:
        moment = datetime(*fields, tzinfo=timezone.utc)
    except ValueError:
        return None
    return Stamp(kind, moment.timestamp() + (float("0." + frac) if frac else 0.0))


def _iso(m: re.Match[str]) -> Stamp | None:
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    return _stamp("iso", (year, month, day, hour, minute, second), m.group(7))


def _glog(m: re.Match[str]) -> Stamp | None:
    month, day = int(m.group(2)[:-2]), int(m.group(2)[-2:])
    hour, minute, second = (int(m.group(i)) for i in range(3, 6))
    if second > 60:
        return None
    # No year in glog stamps: seconds since the start of a fixed leap year keep order
    # within one run (which never spans a new year in practice).
    return _stamp("glog", (2000, month, day, hour, minute, min(second, 59)), m.group(6))


def parse_stamp_text(text: str) -> Stamp | None:
    """An ISO-like timestamp anywhere in ``text`` (torchelastic's ``2024-03-05_07:01:51`` too)."""
    return _iso(m) if (m := _ISO.search(text)) else None


def parse_line(text: str, default_rank: int | None = None) -> ParsedLine:
    """Split a decoded line into rank, timestamp and body."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    text = text.rstrip("\r\n")
    body = text
    rank = default_rank
    prefixed = False
    if m := _RANK_PREFIX.search(text[:160]):
        rank = int(m.group(1))
        body = text[m.end() :]
        prefixed = True
    if (g := _GLOG.search(body[:200])) and g.start() <= 2:
        stamp = _glog(g)
        body = body[g.end() :]
        prefixed = True
    else:
        stamp = _iso(i) if (i := _ISO.search(text[:80])) else None
    if noise := _PREFIX_NOISE.match(body):
        body = body[noise.end() :]
        prefixed = True
    body = body.rstrip()
    # Keep indentation (it tells a traceback frame from the exception line); drop only
    # the single space a prefix leaves behind.
    if prefixed and body.startswith(" "):
        body = body[1:]
    local_rank = None
    if n := _NCCL_DEVICE.match(body):
        local_rank = int(n.group(1))
    elif m is None and "Rank " in body and (r := _NCCL_RANK.search(body)):
        rank = int(r.group(1))
    return ParsedLine(rank, local_rank, stamp, body)


# -- which lines to read --------------------------------------------------------

#: Longest piece of one line handed over; longer lines keep their matching pieces.
MAX_LINE_BYTES = 16 * 1024
# A "line" this long without a newline is cut (binary data, a tqdm bar rewritten with
# \r for hours); the part after the cut keeps the same line number.
_MAX_CARRY = 1024 * 1024

# All triggers in one regular-expression pass: up to 2.5x faster than one bytes.find pass
# per trigger, as fast where every line holds several (RESULTS §6a). "NCCL INFO" is
# NCCL_DEBUG=INFO chatter, up to every fifth line of a log: not a trigger by itself; another
# trigger on the same line still is.
_TRIGGER = re.compile(
    b"|".join(b"NCCL(?! INFO)" if k == b"NCCL" else re.escape(k) for k in TRIGGERS)
)

#: A trigger line whose shape was seen this many times opens no more windows. Above the
#: hits kept per cause and rank (3) times the ranks of a node (8), so a failure echoed by
#: every rank is still read on each of them.
ROUTINE_REPEATS = 32
# Shapes remembered (a hash each): beyond this many distinct ones, new shapes open
# windows as before, so memory stays bounded and nothing is missed.
_MAX_SHAPES = 8192
# What varies between repeats of one line: numbers, and hex (0x7f3a2c... addresses,
# ids). Dropping a-f from words too merges only lines that differ in those letters alone.
_VARYING = b"0123456789abcdef"
# A trigger line opens a window only when it can begin a failure's story: an exception or
# a traceback, torchrun's verdict (an exit code, a signal), or a line naming a catalog cause
# or a casualty. Any other ("wandb: ERROR Error uploading x.png, retrying", new text every
# time) opens none. Without this, a log with such a line every few lines is read whole,
# line by line, in Python.
_STORY = re.compile(
    rb"Traceback|(?:Error|Exception|Interrupt|Exit|Failure)\b\s*(?::|$)|exitcode|error_file|[Ss]ignal"
)


def _opens_window(line: bytes) -> bool:
    if _STORY.search(line):
        return True
    lowered = line.decode("utf-8", "replace").lower()
    return bool(candidates(lowered)) or any(k in lowered for k in SECONDARY_KEYWORDS)


class WindowScanner:
    """Feed bytes with :meth:`feed`, finish with :meth:`close`; ``emit(lineno, line)`` gets lines."""

    def __init__(
        self,
        emit: Callable[[int, bytes], None],
        *,
        before: int = 12,
        after: int = 40,
        full: bool = False,
        first_line: int = 1,
    ) -> None:
        self._emit = emit
        self._before = before
        self._after = after
        self._full = full
        self._carry = b""
        self._next = first_line  # line number of the first line of the next region
        self._tail: deque[tuple[int, bytes]] = deque(maxlen=before)
        self._emitted = first_line - 1  # highest line number handed over
        self._after_until = 0  # lines up to here must be handed over (look-ahead)
        # Where the line after the last one handed over starts, in the region being read
        # (its number, its offset): a window that overlaps the previous one starts there.
        self._resume: tuple[int, int] | None = None
        self._shapes: dict[int, int] = {}  # hash of a trigger line's shape -> times seen
        self.bytes_read = 0
        self.lines = 0
        self.walked = 0  # lines stepped over by windows and tails (the linearity test reads it)
        self.routine = 0  # trigger lines that opened no window: their shape was routine
        self.storyless = 0  # trigger lines that opened no window: they begin no story

    def feed(self, data: bytes | bytearray) -> None:
        """More bytes; ``data`` may be a buffer the caller reuses (nothing keeps it)."""
        if not data:
            return
        self.bytes_read += len(data)
        first = data.find(b"\n")
        if first < 0:
            self._carry += bytes(data)
        else:
            start = 0
            if self._carry:
                # Complete the pending line on its own: gluing it to the chunk would copy
                # the whole chunk.
                self._region(self._carry + bytes(data[: first + 1]), 0, None)
                start = first + 1
            last = data.rfind(b"\n")
            if last >= start:
                self._region(data, start, last + 1)
            self._carry = bytes(data[last + 1 :])
        if len(self._carry) > _MAX_CARRY:
            # Part of a line that never ends: hand over its matching pieces now, under the
            # line number the line will have, so memory stays bounded.
            if self._full or _TRIGGER.search(self._carry):
                self._emit(self._next, self._trim(self._carry))
            self._carry = self._carry[-MAX_LINE_BYTES:]

    def close(self) -> None:
        """Hand over the last line (one without a final newline)."""
        if self._carry:
            carry, self._carry = self._carry, b""
            self._region(carry + b"\n", 0, None)
        self.lines = self._next - 1

    def _openers(self, buf: bytes | bytearray, start: int, stop: int) -> list[int]:
        """Where each trigger line that opens a window starts, in order. O(length of the
        region): one search resumed after each trigger line's newline (a line with a
        thousand triggers costs one); each trigger line is cut out and its shape hashed once."""
        openers: list[int] = []
        pos = start
        while match := _TRIGGER.search(buf, pos, stop):
            line_start = buf.rfind(b"\n", pos, match.start()) + 1 or pos
            line_end = buf.find(b"\n", match.start(), stop)
            if line_end == -1:
                line_end = stop
            pos = line_end + 1
            text = bytes(buf[line_start : min(line_end, line_start + MAX_LINE_BYTES)])
            shape = hash(text.translate(None, _VARYING))
            seen = self._shapes.get(shape, 0)
            if seen or len(self._shapes) < _MAX_SHAPES:
                self._shapes[shape] = seen + 1
            if seen >= ROUTINE_REPEATS:
                self.routine += 1
            # A line longer than the piece tested may tell its story past the cut.
            elif _opens_window(text) or line_end - line_start > MAX_LINE_BYTES:
                openers.append(line_start)
            else:
                self.storyless += 1
        return openers

    def _hand_over(self, lineno: int, line: bytes) -> None:
        if lineno <= self._emitted:
            return
        self._emitted = lineno
        if len(line) > MAX_LINE_BYTES:
            line = self._trim(line)
        self._emit(lineno, line)

    def _trim(self, line: bytes) -> bytes:
        # A huge line is usually a \r progress bar: keep the pieces that matter.
        pieces = [p for p in line.split(b"\r") if _TRIGGER.search(p)]
        pieces = pieces or [line.rsplit(b"\r", 1)[-1]]
        return b"\r".join(p[-MAX_LINE_BYTES // 4 :] for p in pieces[-4:])

    def _region(self, buf: bytes | bytearray, start: int, stop: int | None) -> None:
        """Complete lines ``buf[start:stop]`` (the slice ends with a newline)."""
        stop = len(buf) if stop is None else stop
        first = self._next
        count = buf.count(b"\n", start, stop)
        self._next += count
        self._resume = None
        if self._full:
            for i, line in enumerate(bytes(buf[start:stop]).split(b"\n")[:-1]):
                self._hand_over(first + i, line)
            return
        hits = self._openers(buf, start, stop)
        if hits or self._after_until >= first:
            self._windows(buf, start, stop, first, hits)
        self._remember_tail(buf, start, stop, first, count)

    def _windows(
        self, buf: bytes | bytearray, start: int, stop: int, first: int, hits: list[int]
    ) -> None:
        """Hand over the lines around each hit, walking from it instead of splitting. O(lines
        of the region): hits are counted forward from the previous one; a window walks back
        only to the last line handed over and forward from the first one not handed over, so
        overlapping windows (a trigger on every line) never walk a line twice."""
        if self._after_until >= first:
            self._forward(buf, start, stop, first, self._after_until)
        index, previous = 0, start
        for line_start in hits:
            index += buf.count(b"\n", previous, line_start)
            previous = line_start
            lineno = first + index
            if lineno + self._after <= self._emitted:
                continue
            self._backward(buf, start, line_start, lineno)
            self._forward(buf, line_start, stop, lineno, lineno + self._after)
            self._after_until = max(self._after_until, lineno + self._after)

    def _backward(self, buf: bytes | bytearray, start: int, line_start: int, lineno: int) -> None:
        """The ``before`` lines above line ``lineno`` (which starts at ``line_start``)."""
        lowest = max(lineno - self._before, self._emitted + 1)
        spans: list[tuple[int, int, int]] = []
        pos, number = line_start, lineno
        while number > lowest and pos > start:
            self.walked += 1
            begin = buf.rfind(b"\n", start, pos - 1) + 1 or start
            number -= 1
            spans.append((number, begin, pos - 1))
            pos = begin
        if number > lowest:  # reaches into the previous region: its tail
            for tail_lineno, line in list(self._tail):
                if lowest <= tail_lineno < number:
                    self._hand_over(tail_lineno, line)
        for number, begin, end in reversed(spans):
            self._hand_over(number, bytes(buf[begin:end]))

    def _forward(
        self, buf: bytes | bytearray, pos: int, stop: int, lineno: int, until: int
    ) -> None:
        """Lines ``lineno`` .. ``until`` starting at ``pos`` (within this region)."""
        if lineno <= self._emitted and self._resume is not None:
            # Lines up to _emitted were handed over by an earlier window of this region:
            # start after them instead of walking them again.
            lineno, pos = self._resume
        while lineno <= until and pos < stop:
            self.walked += 1
            end = buf.find(b"\n", pos, stop)
            if end == -1:
                end = stop
            if lineno > self._emitted:
                self._hand_over(lineno, bytes(buf[pos:end]))
            lineno += 1
            pos = end + 1
        self._resume = (lineno, pos)

    def _remember_tail(
        self, buf: bytes | bytearray, start: int, stop: int, first: int, count: int
    ) -> None:
        # Keep the last few lines of an uninteresting region: the next region's hit may
        # need them (a banner's "rank"/"exitcode" lines come before its "error_file").
        self._tail.clear()
        end = stop - 1  # the final newline
        keep: list[tuple[int, bytes]] = []
        lineno = first + count - 1
        while len(keep) < self._before and end >= start and lineno >= first:
            self.walked += 1
            begin = max(buf.rfind(b"\n", start, end) + 1, start)
            keep.append((lineno, bytes(buf[max(begin, end - MAX_LINE_BYTES) : end])))
            lineno -= 1
            end = begin - 1
        self._tail.extend(reversed(keep))
