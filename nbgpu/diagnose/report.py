"""The results: :class:`Diagnosis` (what ``nbgpu.diagnose`` returns) and its :class:`FoundCause` s.

Frozen dataclasses rendered through :class:`nbgpu._render.Result`: text for terminals and
nbval (80 columns), HTML for notebooks, ``to_dict()``/``to_json()`` and ``to_frame()``.
A found cause names a cause id from the catalog, how sure we are, the failing ranks, the
evidence lines (file and line number), the explanation and the fixes; the diagnosis
orders them root cause first and adds a per-rank table.

Imports only the standard library and ``nbgpu._render``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from nbgpu._render import Result, Table, fix_html, fixes_html, shorten, wrap

__all__ = ["Diagnosis", "Evidence", "FoundCause", "RankSummary", "SourceSummary"]

STATUSES = ("failure", "no_failure", "empty", "no_logs")


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return ""
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass(frozen=True)
class Evidence:
    """One log line that supports a found cause."""

    source: str  # file name relative to the input, "<text>", "error-rank1.json"
    lineno: int | None
    text: str
    rank: int | None = None

    @property
    def where(self) -> str:
        return self.source if self.lineno is None else f"{self.source}:{self.lineno}"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "line": self.lineno, "rank": self.rank, "text": self.text}


@dataclass(frozen=True)
class FoundCause(Result):
    """A catalog cause found in one run's logs: its role, evidence and fixes."""

    cause: str  # catalog id: cuda_busy, cuda_oom, ..., unknown
    title: str
    role: str  # root | consequence | also
    confidence: float  # 0..1: how sure we are that this cause explains the failure
    ranks: tuple[int, ...]  # ranks showing this cause
    first_rank: int | None  # the rank that failed first with it
    evidence: tuple[Evidence, ...]
    explanation: str
    fixes: tuple[str, ...]
    details: tuple[str, ...] = ()  # specifics: numbers from the log, this machine's GPUs
    traceback: tuple[str, ...] = ()  # the first failing rank's traceback, when seen
    first_node: str | None = None  # over several nodes: where first_rank ran

    @property
    def root(self) -> bool:
        return self.role == "root"

    def _first(self) -> str:
        node = f" on node {self.first_node}" if self.first_node else ""
        return f"rank {self.first_rank}{node}"

    def summary(self) -> str:
        """One line: cause, rank, confidence."""
        where = f" on {self._first()}" if self.first_rank is not None else ""
        return f"{self.title} ({self.cause}){where}, confidence {self.confidence:.2f}"

    def text(self) -> str:
        head = {"root": "ROOT CAUSE", "consequence": "CONSEQUENCE", "also": "ALSO"}[self.role]
        lines = [_fill(f"{head}: {self.title} [{self.cause}]", "", "  ")]
        who = _ranks_text(self.ranks)
        if self.first_rank is not None and self.role == "root":
            who = f"{self._first()} failed first" + (f" ({who})" if len(self.ranks) > 1 else "")
        lines.append(f"  {who + ' · ' if who else ''}confidence {self.confidence:.2f}")
        lines.append(wrap(self.explanation, "  "))
        if self.evidence:
            lines.append("  evidence:")
            for e in self.evidence:
                lines.append(f"    {e.where}")
                lines.append(_wrapped_text(e.text, "      ", 3))
        if self.traceback:
            lines.append("  traceback (first failing rank):")
            lines.extend(shorten(f"    {t}", 80) for t in self.traceback)
        if self.details:
            lines.append("  specifics:")
            lines.extend(wrap(d, "    ") for d in self.details)
        if self.fixes:
            lines.append("  fix:")
            lines.extend(wrap(f, "    - ") for f in self.fixes)
        return "\n".join(lines)

    def html_body(self) -> str:
        level = {"root": "bad", "consequence": "warn", "also": "warn"}[self.role]
        parts = [
            (
                f'<div class="nbgpu-finding"><b class="{level}">{escape(self.role.upper())}: '
                f"{escape(self.title)}</b> <code>{escape(self.cause)}</code> · confidence "
                f"{self.confidence:.2f}"
            )
        ]
        who = _ranks_text(self.ranks)
        if self.first_rank is not None and self.role == "root":
            who = f"{self._first()} failed first" + (f" ({who})" if len(self.ranks) > 1 else "")
        if who:
            parts.append(f"<div>{escape(who)}</div>")
        parts.append(f"<p>{fix_html(self.explanation)}</p>")
        if self.evidence:
            table = Table(["where", "line"])
            for e in self.evidence:
                table.add(e.where, e.text)
            parts.append(table.html())
        if self.traceback:
            parts.append("<pre>" + escape("\n".join(self.traceback)) + "</pre>")
        if self.details:
            parts.append(fixes_html(self.details))
        if self.fixes:
            parts.append("<b>fix:</b>" + fixes_html(self.fixes))
        parts.append("</div>")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "title": self.title,
            "role": self.role,
            "confidence": round(self.confidence, 3),
            "ranks": list(self.ranks),
            "first_rank": self.first_rank,
            "first_node": self.first_node,
            "evidence": [e.to_dict() for e in self.evidence],
            "explanation": self.explanation,
            "fixes": list(self.fixes),
            "details": list(self.details),
            "traceback": list(self.traceback),
        }

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "cause": self.cause,
                "role": self.role,
                "confidence": round(self.confidence, 3),
                "first_rank": self.first_rank,
                "ranks": ",".join(map(str, self.ranks)),
                "where": e.where,
                "line": e.text,
            }
            for e in self.evidence
        ] or [
            {
                "cause": self.cause,
                "role": self.role,
                "confidence": round(self.confidence, 3),
                "first_rank": self.first_rank,
                "ranks": ",".join(map(str, self.ranks)),
                "where": None,
                "line": None,
            }
        ]


@dataclass(frozen=True)
class RankSummary:
    """How one rank ended and what the diagnosis makes of it."""

    rank: int
    exit_code: int | None
    signal: str | None
    cause: str | None
    role: str  # root | secondary | failed | ok | unknown

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "cause": self.cause,
            "role": self.role,
        }


@dataclass(frozen=True)
class SourceSummary:
    """A file or stream that was read."""

    name: str
    lines: int
    bytes: int
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lines": self.lines, "bytes": self.bytes, "rank": self.rank}


@dataclass(frozen=True)
class Diagnosis(Result):
    """What ``nbgpu.diagnose()`` returns: the root cause first, then what followed from it."""

    status: str  # failure | no_failure | empty | no_logs
    input: str  # what was diagnosed: a path, "<text>", "run 'name' (dir)"
    causes: tuple[FoundCause, ...]  # root cause first
    ranks: tuple[RankSummary, ...] = ()
    sources: tuple[SourceSummary, ...] = ()
    notes: tuple[str, ...] = ()
    world_size: int | None = None
    inventory: str | None = None  # "simulated fleet 'busy-gpu0'", "host gpu7" when one was used
    elapsed_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def findings(self) -> tuple[FoundCause, ...]:
        """The causes, under the name ``to_dict()`` keeps for them (``"findings"``)."""
        return self.causes

    @property
    def root(self) -> FoundCause | None:
        """The root cause, or None when nothing failed."""
        return self.causes[0] if self.causes and self.causes[0].root else None

    @property
    def cause(self) -> str:
        """The root cause id, ``"none"`` when no failure was found."""
        root = self.root
        return root.cause if root else "none"

    @property
    def failed_rank(self) -> int | None:
        root = self.root
        return root.first_rank if root else None

    @property
    def headline(self) -> str:
        """One line for a failure summary: cause, rank, first fix."""
        if self.status == "empty":
            return "nothing to diagnose: the input is empty"
        if self.status == "no_logs":
            return "nothing to diagnose: no log files found"
        root = self.root
        if root is None:
            return "no failure found"
        fix = (root.details[:1] or root.fixes[:1] or ("",))[0]
        where = f" on rank {root.first_rank}" if root.first_rank is not None else ""
        line = f"{root.title}{where} [{root.cause}]"
        return f"{line} - {fix}" if fix else line

    def _header(self) -> str:
        lines = sum(s.lines for s in self.sources)
        parts = [f"nbgpu diagnose - {self.input}"]
        if self.world_size:
            parts.append(f"{self.world_size} rank{'s' if self.world_size != 1 else ''}")
        parts.append(
            f"{len(self.sources)} source{'s' if len(self.sources) != 1 else ''}, {lines:,} lines"
        )
        return " · ".join(parts)

    def _rank_table(self) -> Table:
        table = Table(["rank", "exit", "signal", "cause", "role"])
        for r in self.ranks:
            level = {"root": "bad", "failed": "warn", "secondary": "warn"}.get(r.role, "")
            table.add(
                r.rank,
                "-" if r.exit_code is None else r.exit_code,
                r.signal or "-",
                r.cause or "-",
                r.role,
                level=level,
            )
        return table

    def text(self) -> str:
        lines = [self._header()]
        if self.inventory:
            lines.append(f"  (GPU facts from {self.inventory})")
        if self.root is None:
            lines.append(self.headline)
        for found in self.causes:
            lines.append("")
            lines.append(found.text() if found.root else _short(found))
        if len(self.ranks) > 1 or any(r.role != "ok" for r in self.ranks):
            lines.append("")
            lines.append(self._rank_table().text())
        if self.notes:
            lines.append("")
            lines.extend(wrap(n, "note: ") for n in self.notes)
        return "\n".join(lines)

    def html_body(self) -> str:
        parts = [f"<b>{escape(self._header())}</b>"]
        if self.inventory:
            parts.append(f"<div><i>GPU facts from {escape(self.inventory)}</i></div>")
        if self.root is None:
            parts.append(f"<p>{fix_html(self.headline)}</p>")
        parts.extend(c.html_body() for c in self.causes)
        if self.ranks:
            parts.append(self._rank_table().html())
        if self.notes:
            parts.append(fixes_html(self.notes))
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "cause": self.cause,
            "headline": self.headline,
            "input": self.input,
            "world_size": self.world_size,
            "findings": [c.to_dict() for c in self.causes],
            "ranks": [r.to_dict() for r in self.ranks],
            "sources": [s.to_dict() for s in self.sources],
            "notes": list(self.notes),
            "inventory": self.inventory,
            "elapsed_ms": round(self.elapsed_ms, 1),
        }

    def records(self) -> list[dict[str, Any]]:
        return [row for c in self.causes for row in c.records()]


def _fill(text: str, first: str, rest: str) -> str:
    import textwrap  # noqa: PLC0415  (rendering only)

    return textwrap.fill(
        text, 80, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )


def _wrapped_text(text: str, indent: str, max_lines: int) -> str:
    """A log line wrapped under its location, at most ``max_lines`` lines."""
    import textwrap  # noqa: PLC0415  (rendering only)

    lines = textwrap.wrap(text, 80 - len(indent), break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = [*lines[: max_lines - 1], shorten(lines[max_lines - 1], 80 - len(indent) - 1) + "…"]
    return "\n".join(indent + line for line in lines)


def _short(found: FoundCause) -> str:
    """Causes other than the root in two or three lines: the reader needs the root cause's detail."""
    who = _ranks_text(found.ranks)
    head = {"consequence": "consequence", "also": "also seen"}.get(found.role, found.role)
    lines = [
        _fill(
            f"{head}: {found.title} [{found.cause}]"
            + (f" on {who}" if who else "")
            + f" · confidence {found.confidence:.2f}",
            "",
            "  ",
        )
    ]
    if found.evidence:
        e = found.evidence[0]
        lines.append(f"  {e.where}")
        lines.append(_wrapped_text(e.text, "    ", 1))
    return "\n".join(lines)
