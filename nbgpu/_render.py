"""Plain rendering helpers shared by every result object: tables and sizes.

Results render themselves as text (terminals, nbval, 80 columns) and HTML (notebooks)
through ``_repr_mimebundle_``; both come from the same :class:`Table`, so they never
disagree. Pure standard library: no IPython, no pandas.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Result",
    "Table",
    "code_html",
    "fix_html",
    "fixes_html",
    "fmt_bytes",
    "fmt_opt",
    "fmt_used_total",
    "memory_bar_html",
    "shorten",
    "simulated_label",
    "title_html",
    "wrap",
]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(value: int | None) -> str:
    """1073741824 → '1.0 GiB'; None → '-'. Binary units, as nvidia-smi's MiB."""
    if value is None:
        return "-"
    size = float(value)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def fmt_used_total(used: int | None, total: int | None) -> str:
    """Used and total in the total's unit: '22.5/45.0 GiB' (fits a narrow column)."""
    if total is None:
        return fmt_bytes(used)
    number, unit = fmt_bytes(total).split()
    scale = 1024 ** _UNITS.index(unit)
    used_text = "-" if used is None else f"{used / scale:.1f}"
    return f"{used_text}/{number} {unit}"


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
    """The one HTML rendering of fix text: escaped, with `backticked` spans as <code>.

    Fixes, recommendations and causes are written once, Markdown-style, for terminals
    (where the backticks stay, as in Markdown source) and for notebooks (where they
    become code). Every result renders them through here, so a command looks the same
    in ``%gpu_doctor``, ``%gpu_plan``, ``%gpu_diagnose`` and a failed run's summary.
    """
    return _CODE_SPAN.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def fixes_html(fixes: Sequence[str], *, ordered: bool = False) -> str:
    """A list of fixes (or steps, *ordered*) as one HTML list; empty for no fixes."""
    if not fixes:
        return ""
    tag = "ol" if ordered else "ul"
    return f"<{tag}>" + "".join(f"<li>{fix_html(f)}</li>" for f in fixes) + f"</{tag}>"


#: The name older code knows :func:`fix_html` by.
code_html = fix_html


def fmt_opt(value: object, suffix: str = "") -> str:
    return "-" if value is None else f"{value}{suffix}"


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(1, width - 1)] + "…"


_BAR_CELLS = 10


def memory_bar_html(used: int | None, total: int | None) -> str | None:
    """A memory bar for an HTML table cell: ``█████░░░░░ 28.3/79.6 GiB``.

    Block characters, not SVG or CSS widths: GitHub's notebook view strips styles and
    inline SVG, nbconvert and every notebook front end keep text, so the picture
    survives everywhere the table does. The colour (a span style) is a bonus where
    styles are kept. None when the figures are unknown.
    """
    if used is None or not total:
        return None
    share = max(0.0, min(1.0, used / total))
    filled = round(share * _BAR_CELLS)
    if used and not filled:
        filled = 1  # a GPU with anything on it never looks empty
    colour = "#c62828" if share >= 0.9 else "#ef6c00" if share >= 0.6 else "#2e7d32"
    bar = (
        f'<span style="font-family:monospace;color:{colour}" title="{share:.0%} used">'
        f"{'█' * filled}</span>"
        f'<span style="font-family:monospace;color:#bdbdbd">{"░" * (_BAR_CELLS - filled)}</span>'
    )
    return f"{bar} {html.escape(fmt_used_total(used, total))}"


# JupyterLab right-aligns output table cells with
# `:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td` (specificity 0,2,1), which beats
# a plain `.nbgpu td` (0,1,1) wherever our <style> sits; VS Code and nbviewer bring
# their own table styles, and GitHub drops <style> altogether. An inline style beats
# every stylesheet rule (none of them uses !important), so names, states, paths and
# code lines start at the left edge everywhere.
_LEFT = ' style="text-align:left"'


@dataclass
class Table:
    """Rows of cells rendered as aligned text or an HTML table."""

    headers: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    title: str | None = None
    # Per-row CSS class for HTML ("ok", "warn", "bad"); text shows no colour.
    row_levels: list[str] = field(default_factory=list)
    # The column to shorten first when the table is too wide (free text, e.g. a command).
    flex: int | None = None

    # Per-row {column: raw HTML} shown instead of the escaped text (a memory bar).
    html_cells: list[dict[int, str]] = field(default_factory=list)

    def add(
        self, *cells: object, level: str = "", html_cells: dict[int, str] | None = None
    ) -> None:
        self.rows.append([str(c) for c in cells])
        self.row_levels.append(level)
        self.html_cells.append(html_cells or {})

    def text(self, max_width: int = 80) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))
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
        lines = []
        if self.title:
            lines.append(self.title)
        lines.append(
            "  ".join(
                shorten(h, w).ljust(w) for h, w in zip(self.headers, widths, strict=True)
            ).rstrip()
        )
        for row in self.rows:
            cells = [shorten(c, w).ljust(w) for c, w in zip(row, widths, strict=True)]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def html(self) -> str:
        head = "".join(f"<th{_LEFT}>{html.escape(h)}</th>" for h in self.headers)
        body = []
        for row, level, raw in zip(self.rows, self.row_levels, self.html_cells, strict=True):
            cls = f' class="nbgpu-{level}"' if level else ""
            cells = "".join(
                f"<td{_LEFT}>{raw[i] if i in raw else html.escape(c)}</td>"
                for i, c in enumerate(row)
            )
            body.append(f"<tr{cls}>{cells}</tr>")
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return (
            f'<table class="nbgpu-table">{caption}<thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>"
        )


# Selectors carry two classes and an element (0,2,2): more specific than JupyterLab's
# rendered-HTML table rules (at most 0,2,1), so our margins and padding win there too.
STYLE = (
    "<style>.nbgpu{font-family:var(--jp-code-font-family,monospace);font-size:12px}"
    "div.nbgpu table.nbgpu-table{border-collapse:collapse;margin:4px 0;table-layout:auto}"
    "div.nbgpu table.nbgpu-table th,div.nbgpu table.nbgpu-table td"
    "{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}"
    "div.nbgpu tr.nbgpu-bad td{background:rgba(220,50,47,.15)}"
    "div.nbgpu tr.nbgpu-warn td{background:rgba(181,137,0,.15)}"
    ".nbgpu .nbgpu-sim{color:#6c71c4;font-weight:bold}"
    ".nbgpu li.bad{color:#c0392b}.nbgpu li.warn{color:#9a7d0a}</style>"
)


def simulated_label(fleet: str) -> str:
    """How simulated output names its fleet, everywhere: ``SIMULATED fleet 'NAME'``."""
    return f"SIMULATED fleet '{fleet}'"


def title_html(title: str, *, simulated: bool) -> str:
    """A result's title as escaped HTML, its word SIMULATED marked as the stylesheet says."""
    text = html.escape(title)
    if simulated:
        text = text.replace("SIMULATED", '<span class="nbgpu-sim">SIMULATED</span>')
    return text


class Result:
    """Mixin for result objects: text, HTML, JSON and pandas from one definition.

    Subclasses implement ``text()``, ``html_body()`` and ``to_dict()``; rows for
    ``to_frame()`` come from ``records()``.
    """

    def text(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def html_body(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def records(self) -> list[dict[str, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    #: Column names for an empty frame (no records), so selections never KeyError.
    FRAME_COLUMNS: tuple[str, ...] = ()

    def simulated_fleet(self) -> str | None:
        """The simulated fleet's name when this result comes from one, else None."""
        return None

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per record (pandas is imported only here).

        A frame from a simulated fleet says so where people look: its index is named
        ``SIMULATED fleet 'NAME'`` (a header line in text and HTML, kept by column
        selections such as ``frame[cols]`` and ``frame.filter(items=...)`` and by row
        filters, which a renamed column header row is not), and
        ``frame.attrs["nbgpu_simulated"]`` holds the fleet's name for code.
        """
        import pandas as pd  # noqa: PLC0415  (heavy; only when asked for)

        records = self.records()
        if not records:
            frame = pd.DataFrame(columns=list(self.FRAME_COLUMNS))
        else:
            frame = pd.DataFrame.from_records(records)
        fleet = self.simulated_fleet()
        if fleet is not None:
            frame.index.name = simulated_label(fleet)
            frame.attrs["nbgpu_simulated"] = fleet
        return frame

    def html(self) -> str:
        return f'{STYLE}<div class="nbgpu">{self.html_body()}</div>'

    def _repr_mimebundle_(
        self,
        include: Any = None,  # noqa: ARG002  (IPython's protocol; we always send both)
        exclude: Any = None,  # noqa: ARG002
    ) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # noqa: ARG002
        printer.text(self.text())

    def __str__(self) -> str:
        return self.text()
