"""One log line: which rank wrote it, when, and what it says without the launcher's prefix.

Launchers and libraries decorate lines in many ways; this module undoes the common ones:
torchrun's ``--tee`` prefix (``[default3]:``) and torch's rank prefix (``[rank3]:``), glog
headers (``E0227 17:39:41.510000 293816 api.py:732]``), NCCL's ``host:pid:tid [3] NCCL``,
bracketed ISO timestamps, ANSI colours. A timestamp is kept with its *kind*: glog stamps
have no year, so they are only compared with other glog stamps.

Pure functions over strings; imports only the standard library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

__all__ = ["ParsedLine", "Stamp", "parse_line", "parse_stamp_text", "strip_ansi"]

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
    """A point in time and the clock it was read from (``iso`` or ``glog``)."""

    kind: str
    seconds: float


@dataclass(frozen=True)
class ParsedLine:
    rank: int | None  # global rank when the prefix says so
    local_rank: int | None  # NCCL's device index: a local rank, not a global one
    stamp: Stamp | None
    body: str  # the message without launcher prefixes


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text) if "\x1b" in text else text


def _iso(m: re.Match[str]) -> Stamp | None:
    try:
        year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
        frac = float("0." + m.group(7)) if m.group(7) else 0.0
        moment = datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc)
    except ValueError:
        return None
    return Stamp("iso", moment.timestamp() + frac)


def _glog(m: re.Match[str]) -> Stamp | None:
    month, day = int(m.group(2)[:-2]), int(m.group(2)[-2:])
    hour, minute, second = (int(m.group(i)) for i in range(3, 6))
    if not (1 <= month <= 12 and 1 <= day <= 31 and hour < 24 and minute < 60 and second < 61):
        return None
    frac = float("0." + m.group(6)) if m.group(6) else 0.0
    # No year in glog stamps: seconds since the start of a fixed leap year keep order
    # within one run (which never spans a new year in practice).
    try:
        moment = datetime(2000, month, day, hour, minute, min(second, 59), tzinfo=timezone.utc)
    except ValueError:
        return None
    return Stamp("glog", moment.timestamp() + frac)


def parse_stamp_text(text: str) -> Stamp | None:
    """An ISO-like timestamp anywhere in ``text`` (torchelastic's ``2024-03-05_07:01:51`` too)."""
    m = _ISO.search(text)
    return _iso(m) if m else None


def parse_line(text: str, default_rank: int | None = None) -> ParsedLine:
    """Split a decoded line into rank, timestamp and body."""
    text = strip_ansi(text).rstrip("\r\n")
    body = text
    rank = default_rank
    prefixed = False
    m = _RANK_PREFIX.search(text[:160])
    if m:
        rank = int(m.group(1))
        body = text[m.end() :]
        prefixed = True
    stamp: Stamp | None = None
    g = _GLOG.search(body[:200])
    if g and g.start() <= 2:
        stamp = _glog(g)
        body = body[g.end() :]
        prefixed = True
    else:
        i = _ISO.search(text[:80])
        if i:
            stamp = _iso(i)
    noise = _PREFIX_NOISE.match(body)
    if noise:
        body = body[noise.end() :]
        prefixed = True
    body = body.rstrip()
    # Keep indentation (it tells a traceback frame from the exception line); drop only
    # the single space a prefix leaves behind.
    if prefixed and body.startswith(" "):
        body = body[1:]
    local_rank = None
    n = _NCCL_DEVICE.match(body)
    if n:
        local_rank = int(n.group(1))
    elif m is None and "Rank " in body:
        r = _NCCL_RANK.search(body)
        if r:
            rank = int(r.group(1))
    return ParsedLine(rank, local_rank, stamp, body)
