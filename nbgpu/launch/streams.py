"""Streaming rank output: follow log files, decode safely, coalesce for the screen.

Each rank writes straight into its own log file (see ``worker.py``), so the disk
copy is complete whatever happens on screen. :class:`LogTail` follows one file:
bytes until there are no more, an incremental UTF-8 decoder (a character split
across two reads stays intact), ``\\r`` handled as a terminal would (a progress bar
is one line whose text is replaced), and a final flush when the run ends.

:class:`ScreenWriter` is the on-screen side: it prefixes lines by rank, batches them
into one write per tick, and keeps to a byte budget (Jupyter's server *drops*
output above ~1 MB/s); lines over budget are counted, and the last lines of every
rank are always shown at the end. Standard library only.
"""

from __future__ import annotations

import codecs
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = ["LineSink", "LogTail", "ScreenWriter", "color_prefix"]

READ_CHUNK = 1 << 16
MAX_READ_PER_POLL = 8 << 20  # bound one poll's work; the rest is read next tick

_COLORS = (36, 33, 35, 32, 34, 31, 96, 93)  # cyan, yellow, magenta, green, ...


def color_prefix(label: str, index: int, *, color: bool) -> str:
    if not color:
        return f"[{label}] "
    return f"\x1b[{_COLORS[index % len(_COLORS)]}m[{label}]\x1b[0m "


class LineSink(Protocol):
    """Where a run's lines go: a terminal/cell text stream, or a widget panel."""

    def add(self, label: str, lines: list[str]) -> None: ...

    def flush(self) -> None: ...

    def finish(self, log_hint: str) -> None: ...


class LogTail:
    """Follow one growing log file; return completed lines and the live partial line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # text after the last newline
        self.bytes_read = 0
        self.lines_read = 0

    def _open(self) -> bool:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        return True

    def poll(self) -> list[str]:
        """New completed lines (without newline), progress (``\\r``) already resolved."""
        if not self._open() or self._fd is None:
            return []
        chunks = []
        total = 0
        while total < MAX_READ_PER_POLL:
            data = os.read(self._fd, READ_CHUNK)
            if not data:
                break
            chunks.append(data)
            total += len(data)
        if not chunks:
            return []
        self.bytes_read += total
        text = self._pending + self._decoder.decode(b"".join(chunks))
        return self._split(text)

    def _split(self, text: str) -> list[str]:
        *complete, self._pending = text.split("\n")
        lines = [_resolve_cr(line) for line in complete]
        self.lines_read += len(lines)
        return lines

    @property
    def live(self) -> str:
        """The unfinished line as a terminal would show it now (a progress bar)."""
        return _resolve_cr(self._pending)

    def close(self) -> list[str]:
        """Read what is left, flush the decoder, and return the final lines."""
        lines = self.poll()
        tail = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if tail:
            lines.append(_resolve_cr(tail))
            self.lines_read += 1
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return lines


def _resolve_cr(line: str) -> str:
    # "\r\n" is a plain newline; otherwise the text after the last "\r" is what a
    # terminal shows (tqdm pads each update, so overwriting is replacing).
    line = line.removesuffix("\r")
    if "\r" in line:
        line = line.rsplit("\r", 1)[1]
    return line


@dataclass
class _Budget:
    rate_bytes_per_s: float
    burst_bytes: float
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)

    def take(self, size: int) -> bool:
        now = time.monotonic()
        self.tokens = min(
            self.burst_bytes, self.tokens + (now - self.stamp) * self.rate_bytes_per_s
        )
        self.stamp = now
        if size <= self.tokens:
            self.tokens -= size
            return True
        return False


class ScreenWriter:
    """Prefixed, coalesced, budgeted output for a notebook cell or a terminal."""

    def __init__(
        self,
        write: Callable[[str], object],
        *,
        color: bool = False,
        rate_bytes_per_s: float = 200_000,
        tail_lines: int = 20,
        max_line_chars: int = 2000,
    ) -> None:
        self._write = write
        self._color = color
        self._budget = _Budget(
            rate_bytes_per_s, burst_bytes=rate_bytes_per_s, tokens=rate_bytes_per_s
        )
        self._buffer: list[str] = []
        self._tails: dict[str, deque[str]] = {}
        self._elided: dict[str, int] = {}
        self._tail_lines = tail_lines
        self._max_line = max_line_chars
        self.writes = 0  # how many write calls reached the screen (display messages)
        self.lines_shown = 0
        self.lines_not_shown = 0  # held back by the budget and never shown
        self._labels: dict[str, int] = {}

    def _prefix(self, label: str) -> str:
        index = self._labels.setdefault(label, len(self._labels))
        return color_prefix(label, index, color=self._color)

    def add(self, label: str, lines: list[str]) -> None:
        tail = self._tails.setdefault(label, deque(maxlen=self._tail_lines))
        for line in lines:
            shown = line if len(line) <= self._max_line else line[: self._max_line] + " …"
            text = self._prefix(label) + shown + "\n"
            if self._elided.get(label) is None and self._budget.take(len(text)):
                self._buffer.append(text)
                self.lines_shown += 1
                tail.clear()  # everything up to here is on screen
            else:
                # Over budget: remember only the last lines for the end of the run.
                self._elided[label] = self._elided.get(label, 0) + 1
                tail.append(text)
                if self._budget.tokens >= self._budget.burst_bytes / 2:
                    self._resume(label)

    def _resume(self, label: str) -> None:
        # The budget refilled: say how much was skipped, then continue live.
        skipped = self._elided.pop(label, 0) - len(self._tails[label])
        if skipped > 0:
            self.lines_not_shown += skipped
            self._buffer.append(f"{self._prefix(label)}… {skipped} lines not shown (see the log)\n")
        self._buffer.extend(self._tails[label])
        self._tails[label].clear()

    def flush(self) -> None:
        if self._buffer:
            self._write("".join(self._buffer))
            self._buffer.clear()
            self.writes += 1

    def finish(self, log_hint: str) -> None:
        """Show what the budget held back: a count per rank and its last lines."""
        for label in list(self._elided):
            tail = self._tails.get(label, deque())
            skipped = self._elided.pop(label) - len(tail)
            if skipped > 0:
                self.lines_not_shown += skipped
                self._buffer.append(
                    f"{self._prefix(label)}… {skipped} lines not shown; complete log: {log_hint}\n"
                )
            self._buffer.extend(tail)
        self.flush()
