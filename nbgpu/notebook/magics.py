"""IPython magics: a thin face that parses arguments and calls :mod:`nbgpu.api`.

The GPU and memory magics, and what every magic shares: ``-h``, and user mistakes as
``UsageError`` (one line, no traceback). Anything heavy is imported inside the magic that
needs it (``%load_ext nbgpu`` stays cheap); each magic reads ``os.environ`` as it is now
(``%env`` changes it in place).
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import ArgDecorator, argument, magic_arguments

from nbgpu import plan_cli
from nbgpu.errors import UserInputError
from nbgpu.sizes import fmt_bytes

if TYPE_CHECKING:
    from nbgpu.devices.clean import CleanPlan

__all__ = ["GPUMagics", "parse_or_help", "user_errors", "words"]


# -- what every magic shares ----------------------------------------------------------
# IPython's magic parser has no help flag (``%magic?`` opens a pager that nbval and
# terminals do not show): each magic answers -h with its docstring, magic_arguments' usage.


def parse_or_help(magics: Magics, name: str, line: str | list[str]) -> Any:
    """The magic *name*'s arguments from *line* (or its words), or None after printing its usage
    for ``-h``. Every magic reads its line here, with its magic_arguments parser: an open quote,
    an unknown flag or a bad value is one UsageError line that names it."""
    usage = f"%%{name}" if name in magics.magics["cell"] else f"%{name}"
    tokens = words(line, usage) if isinstance(line, str) else line
    method = getattr(magics, name)
    if "-h" in tokens or "--help" in tokens:
        # Drop magic_arguments' reST '::' marker; a cell magic's usage says '%name': say '%%name'.
        text = inspect.cleandoc(method.__doc__ or "").removeprefix("::").strip()
        print(text.replace(f"%{name}", usage, 1))
        return None
    try:
        return method.parser.parse_args(tokens)
    except UsageError as exc:  # argparse's complaint, raised by IPython's parser
        raise UsageError(f"{usage}: {exc} (see {usage} -h)") from None


def words(line: str, name: str) -> list[str]:
    """*line* split as a shell would; an unclosed quote is a one-line UsageError."""
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(
            f"{name} {line!r}: {exc}; quote as a shell does: 'a b', \"it's\""
        ) from None


class _PlanArguments(ArgDecorator):
    """``nbgpu plan``'s flags on ``%gpu_plan`` (:mod:`nbgpu.plan_cli` declares them once)."""

    def add_to_parser(self, parser: Any, group: Any) -> None:  # noqa: ARG002  (IPython's hook)
        plan_cli.add_plan_arguments(parser)


@contextmanager
def user_errors() -> Iterator[None]:
    """A mistake in the user's input (:class:`UserInputError`) as a one-line UsageError."""
    try:
        yield
    except UserInputError as exc:
        raise UsageError(str(exc)) from None


def _visible_value(text: str | None) -> str | None:
    """--env accepts '2,3' or 'CUDA_VISIBLE_DEVICES=2,3' (and '' for none)."""
    if text is None:
        return None
    key, sep, value = text.partition("=")
    if sep and key.strip() != "CUDA_VISIBLE_DEVICES":
        raise UsageError(
            f"--env {text!r}: only CUDA_VISIBLE_DEVICES can be given here, as "
            "--env 2,3 or --env CUDA_VISIBLE_DEVICES=2,3"
        )
    return (value if sep else text).strip().strip("'\"")


@magics_class
class GPUMagics(Magics):
    """nbgpu's GPU and memory magics; see each one's ``-h``."""

    @magic_arguments()
    @argument(
        "--probe",
        action="store_true",
        help="also create a CUDA context on each GPU (in a short-lived subprocess) to catch 'busy or unavailable'",
    )
    @argument(
        "--json",
        action="store_true",
        help="print the snapshot as JSON (a fleet file that NBGPU_SIMULATE accepts)",
    )
    @argument(
        "--env",
        metavar="CVD",
        help="show cuda:N -> GPU for this CUDA_VISIBLE_DEVICES value instead of the kernel's (e.g. --env 2,3)",
    )
    @argument(
        "--slurm",
        action="store_true",
        help="every node of the SLURM allocation (or of --nodes N requested for the look)",
    )
    @argument("--nodes", type=int, metavar="N", help="with --slurm")
    @argument("--partition", metavar="P", help="with --slurm")
    @line_magic
    def gpu_status(self, line: str = "") -> Any:
        """Show every GPU: health, memory, who holds it, and what cuda:N means here."""
        if (args := parse_or_help(self, "gpu_status", line)) is None:
            return None
        from nbgpu.cli import status_result  # noqa: PLC0415

        with user_errors():
            result = status_result(args, None if args.slurm else _visible_value(args.env))
        if args.json:
            print(result.to_json())
            return None
        return result

    @magic_arguments()
    @argument("--no-probe", action="store_true", help="skip the active CUDA probe")
    @argument(
        "--nproc",
        type=int,
        metavar="N",
        help="check a planned number of ranks per node against the visible GPUs",
    )
    @argument("--json", action="store_true", help="print the report as JSON")
    @line_magic
    def gpu_doctor(self, line: str = "") -> Any:
        """Diagnose the GPUs and the launch environment; name each problem and its fix."""
        if (args := parse_or_help(self, "gpu_doctor", line)) is None:
            return None
        from nbgpu.cli import doctor_result  # noqa: PLC0415

        with user_errors():
            report = doctor_result(args, "notebook")
        if args.json:
            print(report.to_json())
            return None
        return report

    @magic_arguments()
    @argument("--yes", "-y", action="store_true", help="stop the listed processes without asking")
    @argument("--dry-run", action="store_true", help="only list what would be stopped")
    @argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL (default 3)",
    )
    @line_magic
    def gpu_clean(self, line: str = "") -> Any:
        """Stop this user's stale GPU holders (orphaned ranks, dead jobs), by pid, after asking."""
        if (args := parse_or_help(self, "gpu_clean", line)) is None:
            return None
        from nbgpu.cli import clean_result  # noqa: PLC0415

        def confirm(plan: CleanPlan) -> bool:
            print(plan.text())
            try:
                answer = input(f"Stop these {len(plan.candidates)} processes? [y/N] ")
            except (StdinNotImplementedError, EOFError):
                print("No way to ask here: nothing stopped. Re-run with %gpu_clean --yes.")
                return False
            return answer.strip().lower() in ("y", "yes")

        with user_errors():
            return clean_result(args, confirm)

    @magic_arguments()
    @argument(
        "--widget",
        action="store_true",
        help="the inputs as controls; the plan redrawn as they change (kept as p)",
    )
    @_PlanArguments()
    @line_magic
    def gpu_plan(self, line: str = "") -> Any:
        """Plan a job before launching: roles on healthy GPUs, ports, batch sizes, memory.

        ``p = %gpu_plan sglang.d1t1p1+d3t1p1 --batch 8`` then ``%%torchrun --plan p``.
        Also ``--sweep RUNS --per-run K`` (disjoint runs) and ``--scale CONFIG --to N``.
        ``--widget``: the other flags give the controls' first values. The flags are
        ``nbgpu plan``'s.
        """
        if (args := parse_or_help(self, "gpu_plan", line)) is None:
            return None
        if args.widget:
            from nbgpu.notebook.plan_widget import PlanWidget  # noqa: PLC0415
            from nbgpu.notebook.widgets import widgets_available  # noqa: PLC0415

            if not widgets_available():
                raise UsageError("%gpu_plan --widget needs ipywidgets; without it use the flags")
            args.widget = False  # read here, not by the plan: not one of the flags it refuses
            with user_errors():
                if elsewhere := plan_cli.flags_not_read(self.gpu_plan.parser, args):
                    raise UsageError(
                        "%gpu_plan --widget plans one box: drop --widget to use "
                        + ", ".join(elsewhere)
                    )
                namespace = self.shell.user_ns if self.shell else {}
                PlanWidget(namespace, plan_cli.one_box_keywords(args)).show()
            return None
        with user_errors():
            result = plan_cli.plan_from_args(args)
        text = plan_cli.render_plan_output(result, args)
        if text is not None:
            print(text)
            return None
        return result

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
        if (args := parse_or_help(self, "gpu_phase", line)) is None:
            return
        from nbgpu.profile.phases import Phase, parse_sample_interval, recorder  # noqa: PLC0415

        name = " ".join(args.name)
        with user_errors():
            interval = parse_sample_interval(args.mem_sample)
            rec = recorder()
            if interval:
                if rec._sampler is None:
                    rec.sample_s = interval
                rec.start_sampling()
            phase = Phase(name, rec)
        phase.start()
        error = None
        try:
            result = self.shell.run_cell(cell, store_history=False) if self.shell else None
            if result is not None and not result.success:
                failure = result.error_in_exec or result.error_before_exec
                error = f"{type(failure).__name__}: {failure}"[:300]
        finally:
            phase.stop(error=error)
        ends = (r for r in reversed(rec.records) if r.get("k") == "end" and r.get("phase") == name)
        if (end := next(ends, None)) is not None:
            begins = (r for r in rec.records if r.get("k") == "begin" and r.get("id") == end["id"])
            begin = next(begins, {})
            peak = max(end.get("peak_rss") or 0, 0 if end.get("hwm_why") else end.get("hwm") or 0)
            print(
                f"[nbgpu] phase {name!r}: {end['t'] - begin.get('t', end['t']):.1f} s · RSS "
                f"{fmt_bytes(begin.get('rss'))} -> {fmt_bytes(end.get('rss'))} · peak {fmt_bytes(peak)} · "
                f"node available {fmt_bytes(end.get('avail'))}  (%gpu_memory kernel: every phase)"
            )

    @magic_arguments()
    @argument("run", nargs="?", help="a run name, a run directory, or 'kernel'")
    @argument("--png", metavar="FILE", help="also save the figure to FILE")
    @argument("--no-figure", action="store_true", help="the table only")
    @line_magic
    def gpu_memory(self, line: str = "") -> Any:
        """Memory by phase and rank of a run: figure and table (``%gpu_memory NAME``).

        Without an argument: this kernel's last run (else the kernel's own phases);
        ``kernel``: this kernel's ``%%gpu_phase`` cells. The result converts with
        ``.to_frame()`` (pandas, indexed by phase and rank) and draws with ``.figure()``.
        """
        if (args := parse_or_help(self, "gpu_memory", line)) is None:
            return None
        from nbgpu.api import memory  # noqa: PLC0415
        from nbgpu.profile.phases import recorder  # noqa: PLC0415
        from nbgpu.profile.report import report_from_recorder  # noqa: PLC0415

        with user_errors():
            if args.run == "kernel":
                report = report_from_recorder(recorder(), label="this kernel")
            else:
                report = memory(args.run)
        if report.ranks and not args.no_figure:
            from IPython.display import Image, display  # noqa: PLC0415

            with user_errors():  # a PNG, so that a saved notebook keeps the figure
                display(Image(data=report.png(args.png), format="png"))
        return report
