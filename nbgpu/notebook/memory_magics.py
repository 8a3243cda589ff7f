"""``%%gpu_phase`` and ``%gpu_memory``: memory phases in the kernel, reports of runs.

``%%gpu_phase NAME`` runs its cell inside ``nbgpu.phase(NAME)`` in the kernel process
itself (loading a model in the notebook is a phase too) and prints one line about it.
``%gpu_memory [RUN|kernel]`` shows a run's memory by phase and rank as a figure (PNG,
so a saved notebook keeps it) and a table. Parsing only; the work is in
:mod:`nbgpu.profile` and :func:`nbgpu.api.memory`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from nbgpu.errors import UserInputError
from nbgpu.notebook.usage import print_help

__all__ = ["MemoryMagics"]

#: (line magics, cell magics) this module adds, for %unload_ext.


def _gib(value: object) -> str:
    return f"{value / 1024**3:.2f} GiB" if isinstance(value, int) else "-"


@magics_class
class MemoryMagics(Magics):
    """Memory phases and reports; see each magic's ``-h``."""

    @magic_arguments()
    @argument("name", nargs="+", help="the phase's name (free text)")
    @argument(
        "--mem-sample",
        default="0.1",
        metavar="S",
        help="seconds between the kernel's memory samples (default 0.1; 0: phase ends only)",
    )
    @cell_magic
    def gpu_phase(self, line: str, cell: str) -> None:
        """Run this cell as a memory phase of the kernel: ``%%gpu_phase load model``.

        Records host RSS/USS/PSS at its start and end, its peak (sampled, and the
        kernel's high-water mark), the node's available memory and CUDA figures if the
        kernel uses CUDA. ``%gpu_memory kernel`` shows every phase of this kernel.
        """
        if any(token in ("-h", "--help") for token in line.split()):
            print_help(self.gpu_phase, "%%gpu_phase")
            return
        try:
            args = parse_argstring(self.gpu_phase, line)
        except UsageError:
            raise
        except ValueError as exc:  # shlex: an unclosed quote
            raise UsageError(f"%%gpu_phase {line!r}: {exc}") from None
        from nbgpu.profile.phases import Phase, parse_sample_interval, recorder  # noqa: PLC0415

        try:
            interval = parse_sample_interval(args.mem_sample)
            name = " ".join(args.name)
            rec = recorder()
            if interval and rec.sample_s != interval and rec._sampler is None:
                rec.sample_s = interval
            if interval:
                rec.start_sampling()
            phase = Phase(name, rec)
        except UserInputError as exc:
            raise UsageError(str(exc)) from None
        phase.start()
        error = None
        try:
            result = self.shell.run_cell(cell, store_history=False) if self.shell else None
            if result is not None and not result.success:
                failure = result.error_in_exec or result.error_before_exec
                error = f"{type(failure).__name__}: {failure}"[:300]
        finally:
            phase.stop(error=error)
        end = next(
            (r for r in reversed(rec.records) if r.get("k") == "end" and r.get("phase") == name),
            None,
        )
        if end is not None:
            begin = next(
                (r for r in rec.records if r.get("k") == "begin" and r.get("id") == end["id"]),
                {},
            )
            peak = max(
                end.get("peak_rss") or 0, end.get("hwm") or 0 if not end.get("hwm_why") else 0
            )
            print(
                f"[nbgpu] phase {name!r}: {end['t'] - begin.get('t', end['t']):.1f} s · RSS "
                f"{_gib(begin.get('rss'))} -> {_gib(end.get('rss'))} · peak {_gib(peak)} · "
                f"node available {_gib(end.get('avail'))}  (%gpu_memory kernel: every phase)"
            )

    @magic_arguments()
    @argument("run", nargs="?", default=None, help="a run name, a run directory, or 'kernel'")
    @argument("--png", default=None, metavar="FILE", help="also save the figure to FILE")
    @argument("--no-figure", action="store_true", help="the table only")
    @line_magic
    def gpu_memory(self, line: str = "") -> Any:
        """Memory by phase and rank of a run: figure and table (``%gpu_memory NAME``).

        Without an argument: this kernel's last run (else the kernel's own phases);
        ``kernel``: this kernel's ``%%gpu_phase`` cells. The result converts with
        ``.to_frame()`` (pandas, indexed by phase and rank) and draws with ``.figure()``.
        """
        if any(token in ("-h", "--help") for token in line.split()):
            print_help(self.gpu_memory, "%gpu_memory")
            return None
        try:
            args = parse_argstring(self.gpu_memory, line)
        except ValueError as exc:
            raise UsageError(f"%gpu_memory {line!r}: {exc}") from None
        from nbgpu.api import memory  # noqa: PLC0415
        from nbgpu.profile.phases import recorder  # noqa: PLC0415
        from nbgpu.profile.report import report_from_recorder  # noqa: PLC0415

        try:
            if args.run == "kernel":
                report = report_from_recorder(recorder(), label="this kernel")
            else:
                report = memory(args.run)
        except UserInputError as exc:
            raise UsageError(str(exc)) from None
        if report.ranks and not args.no_figure:
            from IPython.display import Image, display  # noqa: PLC0415

            png = report.png()
            display(Image(data=png, format="png"))
            if args.png:
                try:
                    Path(args.png).expanduser().write_bytes(png)
                except OSError as exc:
                    raise UsageError(
                        f"--png {shlex.quote(args.png)}: cannot write ({exc.strerror})"
                    ) from None
        return report
