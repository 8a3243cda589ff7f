"""The results: :class:`Diagnosis` (what ``nbgpu.diagnose`` returns) and its :class:`FoundCause` s.

Each says its content once (``content()``: 80-column text and HTML). A found cause is also
the problem every layer reports (:attr:`FoundCause.problem`); the diagnosis orders the
causes root first and adds a per-rank table.
"""

import textwrap
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Blank, Block, Bullets, Line, Pre, Result, Section, Table, Title, shorten
from nbgpu.problems import Problem
from nbgpu.profile.records import ranks_text

__all__ = ["Diagnosis", "Evidence", "FoundCause", "RankSummary", "SourceSummary"]

_HEADS = {"root": "ROOT CAUSE", "consequence": "CONSEQUENCE", "also": "ALSO"}
_BRIEF_HEADS = {"root": "root cause", "consequence": "consequence", "also": "also seen"}
_SEVERITIES = {"root": "bad", "consequence": "warn", "also": "warn"}


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
        # The JSON key is "line" (scripts parse it); the field says what it holds.
        return {"source": self.source, "line": self.lineno, "rank": self.rank, "text": self.text}

    def lines(self, indent: str, max_lines: int) -> str:
        """Where, then the log line wrapped under it in at most *max_lines* lines."""
        inner = indent + "  "
        width = 80 - len(inner)
        lines = textwrap.wrap(self.text, width, break_on_hyphens=False) or [""]
        if len(lines) > max_lines:
            lines = [*lines[: max_lines - 1], shorten(lines[max_lines - 1], width - 1) + "…"]
        return "\n".join([indent + self.where, *(inner + line for line in lines)])


@dataclass(frozen=True)
class FoundCause(Result):
    """A catalog cause found in one run's logs: its role, evidence and fixes."""

    cause: str  # catalog id: cuda_busy, cuda_oom, ..., unknown
    title: str
    role: str  # root | consequence | also
    confidence: float  # 0..1, rounded to 3 places: how sure we are that it explains the failure
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

    @property
    def problem(self) -> Problem:
        """This cause as the problem doctor, plan and estimate report too."""
        subject = self._first() if self.first_rank is not None else ranks_text(self.ranks)
        message = f"{self.title}: {self.explanation}"
        return Problem(_SEVERITIES[self.role], self.cause, subject or "run", message, self.fixes)

    def summary(self) -> str:
        where = f" on {self._first()}" if self.first_rank is not None else ""
        return f"{self.title} ({self.cause}){where}, confidence {self.confidence:.2f}"

    def content(self) -> list[Block]:
        """The full account (the root cause's): who, why, evidence, specifics, fixes."""
        who = ranks_text(self.ranks)
        if self.first_rank is not None and self.root:
            who = f"{self._first()} failed first" + (f" ({who})" if len(self.ranks) > 1 else "")
        level = _SEVERITIES[self.role]
        blocks: list[Block] = [
            Line(f"{self.title} [{self.cause}]", label=_HEADS[self.role], level=level),
            Line(f"{who + ' · ' if who else ''}confidence {self.confidence:.2f}", indent="  "),
            Line(self.explanation, indent="  "),
        ]
        if self.evidence:
            blocks.append(Line("evidence:", indent="  "))
            blocks.append(Pre("\n".join(e.lines("    ", 3) for e in self.evidence)))
        if self.traceback:
            blocks.append(Line("traceback (first failing rank):", indent="  "))
            blocks.append(Pre("\n".join(shorten(f"    {t}", 80) for t in self.traceback)))
        if self.details:
            blocks.append(Bullets(self.details, title="  specifics:", marker="    "))
        if self.fixes:
            blocks.append(Bullets(self.fixes, title="  fix:", marker="    - "))
        return [Section(blocks, level=level)]

    def brief(self) -> Section:
        """Two or three lines, for a cause beside the root (the root gets the detail)."""
        who = ranks_text(self.ranks)
        head = f"{self.title} [{self.cause}]" + (f" on {who}" if who else "")
        blocks: list[Block] = [
            Line(f"{head} · confidence {self.confidence:.2f}", label=_BRIEF_HEADS[self.role])
        ]
        if self.evidence:
            blocks.append(Pre(self.evidence[0].lines("  ", 1)))
        return Section(blocks, level=_SEVERITIES[self.role])

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "evidence": [e.to_dict() for e in self.evidence]}

    def records(self) -> list[dict[str, Any]]:
        row = {
            "cause": self.cause,
            "role": self.role,
            "confidence": self.confidence,
            "first_rank": self.first_rank,
            "ranks": ",".join(map(str, self.ranks)),
        }
        return [{**row, "where": e.where, "line": e.text} for e in self.evidence] or [
            {**row, "where": None, "line": None}
        ]


@dataclass(frozen=True)
class RankSummary:
    """How one rank ended and what the diagnosis makes of it."""

    rank: int
    exit_code: int | None
    signal: str | None
    cause: str | None
    role: str  # root | secondary | failed | ok | unknown


@dataclass(frozen=True)
class SourceSummary:
    """A file or stream that was read."""

    name: str
    lines: int
    bytes: int
    rank: int | None = None


@dataclass(frozen=True)
class Diagnosis(Result):
    """What ``nbgpu.diagnose()`` returns: the root cause first, then what followed from it."""

    JSON_EXTRAS = ("cause", "headline")

    status: str  # failure | no_failure | empty | no_logs
    input: str  # what was diagnosed: a path, "<text>", "run 'name' (dir)"
    causes: tuple[FoundCause, ...]  # root cause first
    ranks: tuple[RankSummary, ...] = ()
    sources: tuple[SourceSummary, ...] = ()
    notes: tuple[str, ...] = ()
    world_size: int | None = None
    inventory: str | None = None  # "simulated fleet 'busy-gpu0'", "host gpu7" when one was used
    elapsed_ms: float = 0.0

    @property
    def findings(self) -> tuple[FoundCause, ...]:
        """The causes, under the name ``to_dict()`` keeps for them (``"findings"``)."""
        return self.causes

    @property
    def problems(self) -> tuple[Problem, ...]:
        return tuple(c.problem for c in self.causes)

    @property
    def root(self) -> FoundCause | None:
        """The root cause, or None when nothing failed."""
        return self.causes[0] if self.causes and self.causes[0].root else None

    @property
    def cause(self) -> str:
        """The root cause id, ``"none"`` when no failure was found."""
        return self.root.cause if self.root else "none"

    @property
    def failed_rank(self) -> int | None:
        return self.root.first_rank if self.root else None

    @property
    def headline(self) -> str:
        """One line for a failure summary: cause, rank, first fix."""
        if self.status == "empty":
            return "nothing to diagnose: the input is empty"
        if self.status == "no_logs":
            return "nothing to diagnose: no log files found"
        if (root := self.root) is None:
            return "no failure found"
        fix = (root.details[:1] or root.fixes[:1] or ("",))[0]
        where = f" on rank {root.first_rank}" if root.first_rank is not None else ""
        line = f"{root.title}{where} [{root.cause}]"
        return f"{line} - {fix}" if fix else line

    def content(self) -> list[Block]:
        lines = sum(s.lines for s in self.sources)
        parts = [f"nbgpu diagnose - {self.input}"]
        if self.world_size:
            parts.append(f"{self.world_size} rank{'s' if self.world_size != 1 else ''}")
        parts.append(
            f"{len(self.sources)} source{'s' if len(self.sources) != 1 else ''}, {lines:,} lines"
        )
        blocks: list[Block] = [Title(" · ".join(parts))]
        if self.inventory:
            blocks.append(Line(f"(GPU facts from {self.inventory})", indent="  ", wrap=False))
        if self.root is None:
            blocks.append(Line(self.headline))
        for found in self.causes:
            blocks += [Blank(), *(found.content() if found.root else [found.brief()])]
        if len(self.ranks) > 1 or any(r.role != "ok" for r in self.ranks):
            table = Table(["rank", "exit", "signal", "cause", "role"])
            for r in self.ranks:
                level = {"root": "bad", "failed": "warn", "secondary": "warn"}.get(r.role, "")
                exit_code = "-" if r.exit_code is None else r.exit_code
                table.add(r.rank, exit_code, r.signal or "-", r.cause or "-", r.role, level=level)
            blocks += [Blank(), table]
        if self.notes:
            blocks += [Blank(), Bullets(self.notes, marker="note: ")]
        return blocks

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        del data["causes"]
        data["findings"] = [c.to_dict() for c in self.causes]  # the key scripts parse
        data["elapsed_ms"] = round(self.elapsed_ms, 1)
        return data

    def records(self) -> list[dict[str, Any]]:
        return [row for c in self.causes for row in c.records()]
