"""Tables of results: aligned text for terminals, an inline-styled HTML table for notebooks.

A block of :mod:`nbgpu._render`'s content model, with the colours every block shares
(hex values in ``style`` attributes: untrusted notebooks keep them). Standard library only.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

from nbgpu.sizes import fmt_used_total

__all__ = ["COLOURS", "ROW_BACKGROUNDS", "Cell", "Table", "memory_bar_html", "shorten"]


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


_BAR_CELLS = 10


def memory_bar_html(used: int | None, total: int | None) -> str | None:
    """A memory bar for an HTML table cell, ``█████░░░░░ 28.3/79.6 GiB``; None when unknown.

    Block characters, not SVG or CSS widths: GitHub's notebook view strips styles and
    inline SVG, while text survives everywhere the table does (the colour is a bonus).
    """
    if used is None or not total:
        return None
    share = max(0.0, min(1.0, used / total))
    filled = round(share * _BAR_CELLS)
    if used and not filled:
        filled = 1  # a GPU with anything on it never looks empty
    colour = "#c62828" if share >= 0.9 else "#ef6c00" if share >= 0.6 else COLOURS["ok"]
    bar = (
        f'<span style="font-family:monospace;color:{colour}" title="{share:.0%} used">'
        f"{'█' * filled}</span>"
        f'<span style="font-family:monospace;color:#bdbdbd">{"░" * (_BAR_CELLS - filled)}</span>'
    )
    return f"{bar} {html.escape(fmt_used_total(used, total))}"


#: Text colour per severity (problem bullets, a cell's own level, a line's level).
COLOURS = {"ok": "#2e7d32", "info": "#546e7a", "warn": "#9a7d0a", "bad": "#c0392b"}
#: Row background per severity: translucent, so light and dark themes both read.
ROW_BACKGROUNDS = {"warn": "#b5890026", "bad": "#dc322f26"}
_TABLE_STYLE = "border-collapse:collapse;margin:4px 0"
_CELL_STYLE = "padding:2px 8px;text-align:left;border-bottom:1px solid #dddddd"


@dataclass(frozen=True)
class Cell:
    """A table cell with its own severity, or a *bar* ``(used_bytes, total_bytes)`` that
    HTML draws beside the figures (text shows *text*)."""

    text: str
    level: str = ""
    bar: tuple[int | None, int | None] | None = None

    def __str__(self) -> str:
        return self.text


@dataclass
class Table:
    """Rows of cells as aligned text or an HTML table. A header carries its unit in its
    text (``"GPU mem"`` cells say ``22.5 GiB``; a bare number column says ``[GiB]``)."""

    headers: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    title: str | None = None
    # Per-row severity for HTML ("ok", "warn", "bad"); text shows no colour.
    row_levels: list[str] = field(default_factory=list)
    # The column to shorten first when the table is too wide (free text, e.g. a command).
    flex: int | None = None
    # Per-row {column: Cell} for cells with their own severity or a bar.
    cells: list[dict[int, Cell]] = field(default_factory=list)

    def add(self, *values: object, level: str = "") -> None:
        self.rows.append([str(v) for v in values])
        self.row_levels.append(level)
        self.cells.append({i: v for i, v in enumerate(values) if isinstance(v, Cell)})

    def text(self, max_width: int = 80) -> str:
        widths = [max(map(len, column)) for column in zip(self.headers, *self.rows, strict=True)]
        total = sum(widths) + 2 * (len(widths) - 1)
        if self.flex is not None and total > max_width:
            # Free text gives way first, down to a readable minimum.
            cut = min(total - max_width, max(0, widths[self.flex] - 12))
            widths[self.flex] -= cut
            total -= cut
        # Then squeeze the widest column until the table fits the terminal.
        while total > max_width and max(widths) > 8:
            widest = widths.index(max(widths))
            widths[widest] -= 1
            total -= 1
        lines = [self.title] if self.title else []
        lines.append(
            "  ".join(
                shorten(h, w).ljust(w) for h, w in zip(self.headers, widths, strict=True)
            ).rstrip()
        )
        for row in self.rows:
            cells = [shorten(c, w).ljust(w) for c, w in zip(row, widths, strict=True)]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def _cell_html(self, r: int, i: int, text: str, background: str) -> str:
        style = _CELL_STYLE + background
        cell = self.cells[r].get(i)
        bar = memory_bar_html(*cell.bar) if cell is not None and cell.bar is not None else None
        body = bar or html.escape(text)
        if cell is not None and cell.level in COLOURS and cell.level != "ok":
            style += f";color:{COLOURS[cell.level]};font-weight:bold"
        return f'<td style="{style}">{body}</td>'

    def html(self) -> str:
        head = "".join(f'<th style="{_CELL_STYLE}">{html.escape(h)}</th>' for h in self.headers)
        body = []
        for r, (row, level) in enumerate(zip(self.rows, self.row_levels, strict=True)):
            colour = ROW_BACKGROUNDS.get(level)
            background = f";background-color:{colour}" if colour else ""
            cls = f' class="nbgpu-{level}"' if level else ""
            cells = "".join(self._cell_html(r, i, c, background) for i, c in enumerate(row))
            body.append(f"<tr{cls}>{cells}</tr>")
        caption = (
            f'<caption style="text-align:left">{html.escape(self.title)}</caption>'
            if self.title
            else ""
        )
        return (
            f'<table class="nbgpu-table" style="{_TABLE_STYLE}">{caption}'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )
