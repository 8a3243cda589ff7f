"""What flows from the ranks to the kernel: their output (log files followed, decoded,
coalesced for the screen). Standard library only.
Each rank writes straight into its own log file, complete whatever happens on screen.
:class:`LogTail` follows one with an incremental UTF-8 decoder (a character split across
reads stays intact); :class:`ScreenWriter` keeps to a byte budget, as Jupyter's server
*drops* output above ~1 MB/s. A warm job's cells go
over their own channel (``nbgpu.launch.relay``).
"""

import codecs
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

__all__ = [
    "MAX_LOGS_PER_POLL", "LineSink", "LogTail", "RankLogs", "ScreenWriter", "in_turn",
]  # fmt: skip

# At most this many rank logs are read in one poll (20 polls a second). Beyond it the logs
# take turns: 4096 ranks' logs are each read every 16 polls (0.8 s), and a poll costs what
# 256 reads cost instead of 4096 (about 10 ms here; on a shared filesystem each read is a
# round trip). The final drain reads every log.
MAX_LOGS_PER_POLL = 256

READ_CHUNK = 1 << 16
MAX_READ_PER_POLL = 8 << 20  # bound one poll's work; the rest is read next tick


class LineSink(Protocol):
    """Where a run's lines go: a terminal/cell text stream, or a widget panel."""

    def add(self, label: str, lines: list[str]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, log_hint: str) -> None: ...


class LogTail:
    """Follow one growing log file. ``keep_open=False`` opens it for each poll: thousands of
    ranks would otherwise hold a descriptor each (the usual limit is 1024), and on NFS a
    fresh open sees other nodes."""

    def __init__(self, path: Path, *, keep_open: bool = True) -> None:
        self.path = path
        self.keep_open = keep_open
        self.bytes_read = 0  # also where a reopened file is read from
        self._fd: int | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # text after the last newline

    def _open(self) -> bool:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
            os.lseek(self._fd, self.bytes_read, os.SEEK_SET)
        return True

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def poll(self) -> list[str]:
        """New completed lines (without newline), progress (``\\r``) already resolved."""
        if not self._open() or self._fd is None:
            return []
        chunks = []
        total = 0
        try:
            while total < MAX_READ_PER_POLL and (data := os.read(self._fd, READ_CHUNK)):
                chunks.append(data)
                total += len(data)
        finally:
            self.bytes_read += total
            if not self.keep_open:
                self._release()
        text = self._pending + self._decoder.decode(b"".join(chunks))
        *complete, self._pending = text.split("\n")
        return [_resolve_cr(line) for line in complete]

    @property
    def live(self) -> str:
        """The unfinished line as a terminal would show it now (a progress bar)."""
        return _resolve_cr(self._pending)

    def close(self) -> list[str]:
        lines = self.poll()
        tail = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if tail:
            lines.append(_resolve_cr(tail))
        self._release()
        return lines


def in_turn(count: int, cursor: int, limit: int = MAX_LOGS_PER_POLL) -> tuple[list[int], int]:
    """Which of *count* logs to read this poll, from *cursor* on; and the next cursor."""
    if count <= limit:
        return list(range(count)), 0
    return [(cursor + i) % count for i in range(limit)], (cursor + limit) % count


class RankLogs:
    """Every rank's log of one run, followed (beyond :data:`MAX_LOGS_PER_POLL` ranks, in
    turns); lines starting with *skip* (a warm job's cell marks) are not shown."""

    def __init__(self, paths: dict[int, Path], *, skip: str | None = None) -> None:
        few = len(paths) <= MAX_LOGS_PER_POLL
        self._tails = {rank: LogTail(path, keep_open=few) for rank, path in paths.items()}
        self._cursor = 0  # where the next poll starts when the logs take turns
        self._skip = skip
        self.first_output_at: float | None = None
        self.last_output_at: float | None = None  # any byte, a progress bar's too (stalls)

    def poll(self, *, every: bool = False) -> list[tuple[int, list[str]]]:
        """New lines, by rank (``every``: read every log, not this poll's turn)."""
        tails = list(self._tails.items())
        if not every:
            turn, self._cursor = in_turn(len(tails), self._cursor)
            tails = [tails[i] for i in turn]
        before = sum(tail.bytes_read for _, tail in tails)
        polled = [(rank, tail.poll()) for rank, tail in tails]
        if sum(tail.bytes_read for _, tail in tails) != before:
            self.last_output_at = time.time()
        return self._shown(polled)

    def drain(self) -> list[tuple[int, list[str]]]:
        """The last lines of every log (a final line without newline too); closes them."""
        return self._shown((rank, tail.close()) for rank, tail in self._tails.items())

    def _shown(self, polled: Iterable[tuple[int, list[str]]]) -> list[tuple[int, list[str]]]:
        out = []
        skip = self._skip
        for rank, lines in polled:
            shown = lines if skip is None else [ln for ln in lines if not ln.startswith(skip)]
            if shown:
                if self.first_output_at is None:
                    self.first_output_at = time.time()
                out.append((rank, shown))
        return out


def _resolve_cr(line: str) -> str:
    # "\r\n" is a plain newline; otherwise the text after the last "\r" is what a
    # terminal shows (tqdm pads each update, so overwriting is replacing).
    return line.removesuffix("\r").rsplit("\r", 1)[-1]


# Over the budget, at most this many lines a tick: a line per rank up to it, then a line
# per node, then one line for the job (64 lines of ~220 bytes, ten ticks a second, stay
# under the 200 kB/s budget).
MAX_CUT_LINES = 64
# When the run ends, the last lines of at most this many ranks that the budget held back.
MAX_FINAL_TAILS = 16
MAX_LINE_CHARS = 2000  # a longer line is clipped on screen (never in the log)
NEWEST_LINE_CHARS = 200  # over the budget, the newest line shown per rank or node


class ScreenWriter:
    """Prefixed output for a notebook cell or a terminal: ``flush`` (once per tick) writes in
    one call the lines that fit the byte budget, otherwise per rank a count of what was held
    back and its newest line; ``finish`` shows every rank's last lines that were not shown."""

    def __init__(
        self,
        write: Callable[[str], object],
        *,
        colour: Callable[[str], str] | None = None,
        rate_bytes_per_s: float = 200_000,
        tail_lines: int = 20,
        live_status: bool = False,
    ) -> None:
        self._write = write
        # A one-line status (the node's memory) kept under the output, rewritten in
        # place with '\r' (terminals and Jupyter alike); erased when the run ends.
        self.live_status = live_status
        self._status = ""
        self._status_shown = ""
        self._colour = colour  # a label's colour as #rrggbb (None: plain prefixes)
        # A token bucket of bytes: refills at the rate per second, up to one second's worth.
        self._rate = rate_bytes_per_s
        self._tokens = rate_bytes_per_s
        self._refilled_at = time.monotonic()
        self._pending: dict[str, list[str]] = {}
        self._recent: dict[str, deque[tuple[str, bool]]] = {}  # each rank's last lines, shown?
        self._tail_lines = tail_lines
        self._prefixes: dict[str, str] = {}
        self.writes = 0  # how many write calls reached the screen (display messages)
        self.lines_shown = 0
        self.lines_not_shown = 0  # held back by the budget (all of them are in the log)

    def _prefix(self, label: str) -> str:
        if label not in self._prefixes:
            prefix = f"[{label}]"
            if self._colour is not None:  # 24-bit ANSI: the rank's own colour everywhere
                red, green, blue = bytes.fromhex(self._colour(label)[1:])
                prefix = f"\x1b[38;2;{red};{green};{blue}m{prefix}\x1b[0m"
            self._prefixes[label] = prefix + " "
        return self._prefixes[label]

    def add(self, label: str, lines: list[str]) -> None:
        self._pending.setdefault(label, []).extend(lines)

    def status(self, text: str | None) -> None:
        """Set the live status line (None keeps the current one); shown at the next flush."""
        if text is not None and self.live_status:
            self._status = text.replace("\n", " ")[:NEWEST_LINE_CHARS]

    def _erase_status(self) -> str:
        if not self._status_shown:
            return ""
        # Back over the line, blank it, back again: a terminal is left with the cursor at
        # the line's start, and JupyterLab, which applies each backspace by deleting the
        # character before it in the text it keeps (and saves), with nothing at all. A
        # '\r' with padding would leave the padding in the saved text.
        back = "\b" * len(self._status_shown)
        self._status_shown = ""
        return back + " " * len(back) + back

    def _clip(self, line: str, limit: int) -> str:
        return line if len(line) <= limit else line[:limit] + " …"

    def flush(self) -> None:
        pending = {label: lines for label, lines in self._pending.items() if lines}
        self._pending = {}
        if not pending:
            if self._status and self._status != self._status_shown:
                self._emit(self._erase_status() + self._status)
                self._status_shown = self._status
            return
        size = sum(
            sum(map(len, lines)) + len(lines) * (len(self._prefix(label)) + 1)
            for label, lines in pending.items()
        )
        now = time.monotonic()
        budget = self._tokens = min(
            self._rate, self._tokens + (now - self._refilled_at) * self._rate
        )
        self._refilled_at = now
        pieces: list[str] = []
        fits = size <= budget  # else each rank's newest line, and a count of the others
        if fits or len(pending) <= MAX_CUT_LINES:
            limit = MAX_LINE_CHARS if fits else NEWEST_LINE_CHARS
            for label, lines in pending.items():
                prefix = self._prefix(label)
                shown = lines if fits else lines[-1:]
                held = len(lines) - len(shown)
                if held:
                    pieces.append(f"{prefix}… {held} lines not shown (output rate limit)\n")
                pieces.extend(f"{prefix}{self._clip(line, limit)}\n" for line in shown)
                self._remember(label, lines, shown_last=len(shown))
                self.lines_shown += len(shown)
                self.lines_not_shown += held
        else:
            pieces.extend(self._by_node(pending))
        text = self._erase_status() + "".join(pieces)
        if self._status:
            text += self._status
            self._status_shown = self._status
        self._tokens -= len(text)  # may go below zero: the next ticks wait it out
        self._emit(text)

    def _emit(self, text: str) -> None:
        self._write(text)
        self.writes += 1

    def _by_node(self, pending: dict[str, list[str]]) -> list[str]:
        """Too many ranks for a line each: a line per node (``n17/rank136`` is node ``n17``'s:
        ranks that printed, lines skipped, the newest), or one for the whole job."""
        nodes: dict[str, list[str]] = {}
        for label in pending:
            nodes.setdefault(label.split("/", 1)[0] if "/" in label else "", []).append(label)
        total = sum(map(len, pending.values()))
        for label, lines in pending.items():
            self._remember(label, lines, shown_last=0)
        self.lines_not_shown += total
        if len(nodes) > MAX_CUT_LINES or "" in nodes:
            newest = next(reversed(pending))
            line = self._clip(pending[newest][-1], NEWEST_LINE_CHARS)
            summary = (
                f"{self._prefix('nbgpu')}{len(pending)} ranks on {len(nodes)} node(s) printed "
                f"{total} lines (output rate limit: every line is in its rank's log); "
                f"newest, {newest}: {line}\n"
            )
            return [summary]
        pieces = []
        for node, labels in nodes.items():
            count = sum(len(pending[label]) for label in labels)
            newest = labels[-1]
            line = self._clip(pending[newest][-1], NEWEST_LINE_CHARS)
            pieces.append(
                f"{self._prefix(node)}{len(labels)} ranks, {count} lines not shown; newest, "
                f"{newest.split('/', 1)[1]}: {line}\n"
            )
        return pieces

    def _remember(self, label: str, lines: list[str], *, shown_last: int) -> None:
        recent = self._recent.setdefault(label, deque(maxlen=self._tail_lines))
        cut = len(lines) - shown_last
        # Only the last tail_lines matter; skip the rest without touching them.
        start = max(0, len(lines) - self._tail_lines)
        recent.extend((line, i >= cut) for i, line in enumerate(lines[start:], start))

    def finish(self, log_hint: str) -> None:
        self._status = ""
        self.flush()
        pieces: list[str] = [self._erase_status()] if self._status_shown else []
        behind = [label for label, recent in self._recent.items() if any(not s for _l, s in recent)]
        for label in behind[MAX_FINAL_TAILS:]:
            self._recent[label].clear()  # kept on disk; the screen names how many
        for label, recent in self._recent.items():
            unseen = [line for line, shown in recent if not shown]
            if not unseen:
                continue
            prefix = self._prefix(label)
            pieces.append(f"{prefix}… last lines (complete log: {log_hint}):\n")
            # Everything from the first unseen line on, so the order reads naturally.
            tail = itertools.dropwhile(lambda entry: entry[1], recent)
            pieces.extend(f"{prefix}{self._clip(line, MAX_LINE_CHARS)}\n" for line, _ in tail)
            self.lines_not_shown -= len(unseen)
            self.lines_shown += len(unseen)
        if len(behind) > MAX_FINAL_TAILS:
            pieces.append(
                f"{self._prefix('nbgpu')}… {len(behind) - MAX_FINAL_TAILS} more ranks have lines "
                f"not shown here; every rank's complete log: {log_hint}\n"
            )
        if pieces:
            self._emit("".join(pieces))
