"""Each result says its content once; this module renders it as text and as HTML.

A result's :meth:`Result.content` is a list of blocks (:data:`Block`); :func:`to_text`
draws them for terminals, nbval and 80 columns, :func:`to_html` for notebooks. The HTML
carries its colours in inline ``style`` attributes only: JupyterLab and Notebook strip
``<style>`` blocks from untrusted output (every notebook a colleague sends, every tutorial
opened fresh), GitHub and nbviewer drop them too, and an inline style beats the front
ends' own table rules without ``!important``. Colours are hex values, a form JupyterLab's
sanitizer keeps. Pure standard library (``to_frame`` imports pandas when asked).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbgpu.problems import Problem

# Re-exported for the result modules that format a table's cells.
from nbgpu.sizes import fmt_bytes, fmt_used_total

__all__ = ["COLOURS", "ROOT_STYLE", "ROW_BACKGROUNDS", "Blank", "Block", "Bullets", "Cell",
           "Figure", "Line", "Pre", "Problems", "Result", "Section", "Table", "Title", "fix_html",
           "fmt_bytes", "fmt_opt", "fmt_used_total", "memory_bar_html", "shorten",
           "simulated_label", "span", "title_html", "to_html", "to_text", "wrap"]  # fmt: skip


def wrap(text: str, prefix: str, width: int = 80) -> str:
    """Wrap a sentence for terminals, hanging indent under the prefix."""
    import textwrap  # noqa: PLC0415  (rarely needed; keep import time low)

    return textwrap.fill(
        text,
        width,
        initial_indent=prefix,
        subsequent_indent=" " * len(prefix),
        break_on_hyphens=False,
        break_long_words=False,
    )


# A `backticked` span on one line; an unpaired backtick stays a backtick.
_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def fix_html(text: str) -> str:
    """Fix text as HTML: escaped, `backticked` spans as <code> (terminals keep the backticks),
    so a command looks the same in every result (doctor, plan, diagnosis, a run's summary)."""
    return _CODE_SPAN.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def fmt_opt(value: object, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


#: Text colour per severity (problem bullets, a cell's own level, a line's level).
COLOURS = {"ok": "#2e7d32", "info": "#546e7a", "warn": "#9a7d0a", "bad": "#c0392b"}
#: Row background per severity: translucent, so light and dark themes both read.
ROW_BACKGROUNDS = {"warn": "#b5890026", "bad": "#dc322f26"}
SIMULATED_COLOUR = "#6c71c4"
#: One colour per rank number, the same in a cell's text, the run's panel and its figures
#: (matplotlib's tab10, so the figures' own cycle agrees).
RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip


def rank_colour(label: int | str) -> str:
    """The colour of rank *label* (``3``, ``"rank3"``, ``"n0/rank3"``); grey without a rank."""
    number = re.search(r"rank(\d+)$", f"rank{label}" if isinstance(label, int) else label)
    return RANK_COLOURS[int(number[1]) % len(RANK_COLOURS)] if number else "#555555"


ROOT_STYLE = "font-family:monospace;font-size:12px"
_PRE_STYLE = "margin:2px 0;white-space:pre-wrap"


# -- tables: aligned text for terminals, an HTML table for notebooks ---------------------


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


_BAR_CELLS = 10


def span(seconds: float) -> str:
    """A duration in the unit a person would say: ``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def memory_bar_html(used: int | None, total: int | None) -> str | None:
    """A memory bar for an HTML table cell, ``█████░░░░░ 28.3/79.6 GiB``; None when unknown.
    Block characters, not SVG or CSS widths: GitHub's notebook view strips styles and inline
    SVG, while text survives everywhere the table does (the colour is a bonus)."""
    if used is None or not total:
        return None
    share = max(0.0, min(1.0, used / total))
    filled = max(round(share * _BAR_CELLS), 1 if used else 0)  # anything on it: never empty
    colour = "#c62828" if share >= 0.9 else "#ef6c00" if share >= 0.6 else COLOURS["ok"]
    bar = (
        f'<span style="font-family:monospace;color:{colour}" title="{share:.0%} used">'
        f"{'█' * filled}</span>"
        f'<span style="font-family:monospace;color:#bdbdbd">{"░" * (_BAR_CELLS - filled)}</span>'
    )
    return f"{bar} {html.escape(fmt_used_total(used, total))}"


_TABLE_STYLE = "border-collapse:collapse;margin:4px 0"
_CELL_STYLE = "padding:2px 8px;text-align:left;border-bottom:1px solid #dddddd"


_QUANTITY = re.compile(r"[-+]?[\d.,]+ \S{1,4}\Z")


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
    row_levels: list[str] = field(default_factory=list)  # per-row severity, for HTML only
    flex: int | None = None  # the column shortened first when too wide (free text: a command)
    cells: list[dict[int, Cell]] = field(default_factory=list)  # per row, {column: Cell}

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
            widths[widths.index(max(widths))] -= 1
            total -= 1
        lines = [self.title] if self.title else []
        for row in [self.headers, *self.rows]:
            cells = [shorten(c, w).ljust(w) for c, w in zip(row, widths, strict=True)]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def _cell_html(self, r: int, i: int, text: str, background: str) -> str:
        # A number and its unit stay on one line however narrow the column ("154.8 GiB").
        style = _CELL_STYLE + background + (";white-space:nowrap" * bool(_QUANTITY.match(text)))
        cell = self.cells[r].get(i)
        bar = memory_bar_html(*cell.bar) if cell is not None and cell.bar is not None else None
        if cell is not None and cell.level in COLOURS and cell.level != "ok":
            style += f";color:{COLOURS[cell.level]};font-weight:bold"
        return f'<td style="{style}">{bar or html.escape(text)}</td>'

    def html(self) -> str:
        head = "".join(f'<th style="{_CELL_STYLE}">{html.escape(h)}</th>' for h in self.headers)
        body = []
        for r, (row, level) in enumerate(zip(self.rows, self.row_levels, strict=True)):
            colour = ROW_BACKGROUNDS.get(level)
            background = f";background-color:{colour}" if colour else ""
            cls = f' class="nbgpu-{level}"' if level else ""
            cells = "".join(self._cell_html(r, i, c, background) for i, c in enumerate(row))
            body.append(f"<tr{cls}>{cells}</tr>")
        title = html.escape(self.title or "")
        caption = f'<caption style="text-align:left">{title}</caption>' if title else ""
        return (
            f'<table class="nbgpu-table" style="{_TABLE_STYLE}">{caption}'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )


def _colour(level: str) -> str:
    colour = COLOURS.get(level)
    return f' style="color:{colour}"' if colour and level != "ok" else ""


def title_html(title: str, *, simulated: bool) -> str:
    """A result's title as escaped HTML, its word SIMULATED marked (inline colour)."""
    text = html.escape(title)
    if not simulated:
        return text
    mark = f'<span class="nbgpu-sim" style="color:{SIMULATED_COLOUR};font-weight:bold">'
    return text.replace("SIMULATED", f"{mark}SIMULATED</span>")


def simulated_label(fleet: str) -> str:
    """How simulated output names its fleet, everywhere: ``SIMULATED fleet 'NAME'``."""
    return f"SIMULATED fleet '{fleet}'"


@dataclass(frozen=True)
class Title:
    """A result's headline; in HTML bold, its word SIMULATED marked when *simulated*."""

    text: str
    simulated: bool = False


@dataclass(frozen=True)
class Line:
    """One sentence, ``indent + label: text``, wrapped at 80 columns unless *wrap* is False."""

    text: str
    label: str = ""
    level: str = ""
    wrap: bool = True
    indent: str = ""


@dataclass(frozen=True)
class Blank:
    """An empty line between parts of the text (HTML separates blocks by itself)."""


@dataclass(frozen=True)
class Bullets:
    """Items under an optional title, each wrapped behind *marker* (``"  1. "`` when *ordered*)."""

    items: Sequence[str]
    title: str = ""
    ordered: bool = False
    marker: str = "  - "
    level: str = ""


@dataclass(frozen=True)
class Problems:
    """Problems with their fixes: ``[FIX] subject: message`` then ``    -> fix`` per fix."""

    items: Sequence[Problem]
    title: str = ""


@dataclass(frozen=True)
class Pre:
    """Text shown exactly (log lines, a traceback, a stack)."""

    text: str


@dataclass(frozen=True)
class Figure:
    """A picture for notebooks (SVG markup or base64 PNG); *alt* is what text shows."""

    alt: str
    svg: str = ""
    png_base64: str = ""


@dataclass(frozen=True)
class Section:
    """Blocks that belong together (one cause of a failure); HTML rules them at the left."""

    blocks: Sequence[Block]
    level: str = ""


#: Anything a result's content may hold.
Block = Title | Line | Blank | Bullets | Problems | Pre | Figure | Section | Table

_TAGS = {"bad": "[FIX]", "warn": "[WARN]", "info": "[info]", "ok": "[ok]"}


def _block_text(block: Block, width: int) -> list[str]:
    if isinstance(block, Title | Pre):
        return [block.text]
    if isinstance(block, Line):
        prefix = block.indent + (f"{block.label}: " if block.label else "")
        return [wrap(block.text, prefix, width) if block.wrap else prefix + block.text]
    if isinstance(block, Blank):
        return [""]
    if isinstance(block, Bullets):
        lines = [block.title] if block.title else []
        for i, item in enumerate(block.items, 1):
            marker = f"  {i}. " if block.ordered else block.marker
            lines.append(wrap(item, marker, width))
        return lines
    if isinstance(block, Problems):
        lines = [block.title] if block.title else []
        for p in block.items:
            message = p.message if p.message.startswith(p.subject) else f"{p.subject}: {p.message}"
            lines.append(wrap(message, f"{_TAGS[p.severity]} ".ljust(7)))
            lines.extend(wrap(fix, "    -> ") for fix in p.fixes)
        return lines
    if isinstance(block, Figure):
        return [block.alt] if block.alt else []
    if isinstance(block, Section):
        return [line for inner in block.blocks for line in _block_text(inner, width)]
    return [block.text(width)]


def to_text(blocks: Sequence[Block], width: int = 80) -> str:
    return "\n".join(line for block in blocks for line in _block_text(block, width))


def _list_html(items: Sequence[str], *, ordered: bool = False, level: str = "") -> str:
    tag = "ol" if ordered else "ul"
    body = "".join(f"<li{_colour(level)}>{fix_html(item)}</li>" for item in items)
    return f'<{tag} style="margin:2px 0">{body}</{tag}>'


def _block_html(block: Block) -> str:
    if isinstance(block, Title):
        return f"<div><b>{title_html(block.text, simulated=block.simulated)}</b></div>"
    if isinstance(block, Line):
        label = f"<b>{html.escape(block.label)}:</b> " if block.label else ""
        text = fix_html(block.text) if block.wrap else html.escape(block.text)
        return f"<div{_colour(block.level)}>{label}{text}</div>"
    if isinstance(block, Blank):
        return ""
    if isinstance(block, Bullets):
        title = f"<div>{html.escape(block.title)}</div>" if block.title else ""
        listed = _list_html(block.items, ordered=block.ordered, level=block.level)
        return title + listed if block.items else title
    if isinstance(block, Problems):
        title = f"<div>{html.escape(block.title)}</div>" if block.title else ""
        items = []
        for p in block.items:
            # As in text: a message that starts with its subject ("GPU 0 is ...") says it once.
            said = p.message.startswith(p.subject)
            subject = "" if said else f"<b>{html.escape(p.subject)}</b>: "
            fixes = _list_html(p.fixes) if p.fixes else ""
            items.append(f"<li{_colour(p.severity)}>{subject}{fix_html(p.message)}{fixes}</li>")
        return f'{title}<ul style="margin:2px 0">{"".join(items)}</ul>' if items else title
    if isinstance(block, Pre):
        return f'<pre style="{_PRE_STYLE}">{html.escape(block.text)}</pre>'
    if isinstance(block, Figure):
        alt = html.escape(block.alt, quote=True)
        if block.png_base64:
            return f'<img alt="{alt}" src="data:image/png;base64,{block.png_base64}"/>'
        return block.svg
    if isinstance(block, Section):
        colour = COLOURS.get(block.level, "#bdbdbd")
        style = f"border-left:3px solid {colour};padding-left:6px;margin:4px 0"
        return f'<div style="{style}">{"".join(map(_block_html, block.blocks))}</div>'
    return block.html()


def to_html(blocks: Sequence[Block]) -> str:
    """The blocks as one HTML fragment, styled inline (no ``<style>`` block)."""
    return f'<div class="nbgpu" style="{ROOT_STYLE}">{"".join(map(_block_html, blocks))}</div>'


class Result:
    """Mixin for result objects: text and HTML from ``content()``, JSON from the fields
    (``_serial.to_data``) unless ``to_dict`` differs, pandas from ``records()``."""

    def content(self) -> Sequence[Block]:  # pragma: no cover - abstract
        raise NotImplementedError

    def text(self) -> str:
        return to_text(self.content())

    def html(self) -> str:
        return to_html(self.content())

    def html_body(self) -> str:
        """The HTML without its outer frame (a result nested in another's HTML)."""
        return "".join(map(_block_html, self.content()))

    def to_dict(self) -> dict[str, Any]:
        from nbgpu._serial import to_data  # noqa: PLC0415  (only for JSON)

        return dict(to_data(self))

    def records(self) -> list[dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    #: Column names for an empty frame (no records), so selections never KeyError.
    FRAME_COLUMNS: tuple[str, ...] = ()

    def simulated_fleet(self) -> str | None:
        return None

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per record. A simulated fleet's frame has its index
        named ``SIMULATED fleet 'NAME'`` (a header line in text and HTML that column
        selections and row filters keep, unlike a renamed column header) and the name in
        ``frame.attrs["nbgpu_simulated"]``."""
        import pandas as pd  # noqa: PLC0415  (heavy; only when asked for)

        records = self.records()
        columns = None if records else list(self.FRAME_COLUMNS)
        frame = pd.DataFrame.from_records(records, columns=columns)
        fleet = self.simulated_fleet()
        if fleet is not None:
            frame.index.name = simulated_label(fleet)
            frame.attrs["nbgpu_simulated"] = fleet
        return frame

    def _repr_mimebundle_(self, **_: Any) -> dict[str, str]:
        # IPython passes include= and exclude=; we always send both formats.
        return {"text/plain": self.text(), "text/html": self.html()}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # noqa: ARG002
        printer.text(self.text())

    def __str__(self) -> str:
        return self.text()
