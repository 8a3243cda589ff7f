"""IPython magics: a thin face that parses arguments and calls :mod:`nbgpu.api`.

Everything heavy (pynvml, psutil, the inventory) is imported inside the magic that
needs it, so ``%load_ext nbgpu`` stays cheap. User mistakes become ``UsageError``
(one line, no traceback); results are returned so the notebook renders them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbgpu.errors import UserInputError
from nbgpu.notebook.usage import parse_or_help

if TYPE_CHECKING:
    from nbgpu.devices.clean import CleanPlan

__all__ = ["GPUMagics"]

_GPU_PLAN_DOC = """Plan a job before launching: roles on healthy GPUs, ports, batch sizes, memory.

        ``p = %gpu_plan sglang.d1t1p1+d3t1p1 --batch 8`` then ``%%torchrun --plan p``.
        Also ``--sweep RUNS --per-run K`` (disjoint runs) and ``--scale CONFIG --to N``.
        ``--widget`` shows the inputs as controls and redraws the plan as they change
        (the other flags give their first values; the plan is kept as ``p``).
        Flags are those of ``nbgpu plan`` (``%gpu_plan -h`` lists them).
        """


def _visible_value(text: str | None) -> str | None:
    """--env accepts '2,3' or 'CUDA_VISIBLE_DEVICES=2,3' (and '' for none)."""
    if text is None:
        return None
    key, sep, value = text.partition("=")
    if sep:
        if key.strip() != "CUDA_VISIBLE_DEVICES":
            raise UsageError(
                f"--env {text!r}: only CUDA_VISIBLE_DEVICES can be given here, as "
                "--env 2,3 or --env CUDA_VISIBLE_DEVICES=2,3"
            )
        return value.strip().strip("'\"")
    return text.strip().strip("'\"")


@magics_class
class GPUMagics(Magics):
    """nbgpu's magics; see each one's ``-h``."""

    @magic_arguments()
    @argument(
        "--probe",
        action="store_true",
        help="also create a CUDA context on each GPU "
        "(in a short-lived subprocess) to catch 'busy or unavailable'",
    )
    @argument(
        "--json",
        action="store_true",
        help="print the snapshot as JSON (a fleet file that NBGPU_SIMULATE accepts)",
    )
    @argument(
        "--env",
        metavar="CVD",
        default=None,
        help="show cuda:N -> GPU for this "
        "CUDA_VISIBLE_DEVICES value instead of the kernel's (e.g. --env 2,3)",
    )
    @argument(
        "--slurm",
        action="store_true",
        help="every node of the SLURM allocation (or of --nodes N requested for the look)",
    )
    @argument("--nodes", type=int, default=None, metavar="N", help="with --slurm")
    @argument("--partition", default=None, metavar="P", help="with --slurm")
    @line_magic
    def gpu_status(self, line: str = "") -> Any:
        """Show every GPU: health, memory, who holds it, and what cuda:N means here."""
        args = parse_or_help(self.gpu_status, line)
        if args is None:
            return None
        from nbgpu.api import status  # noqa: PLC0415

        if args.slurm:
            return self._cluster_status(args)
        try:
            inventory = status(
                probe=args.probe, visible_devices=_visible_value(args.env), environ=self._environ()
            )
        except UserInputError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            print(inventory.to_json())
            return None
        return inventory

    def _cluster_status(self, args: Any) -> Any:
        from nbgpu.launch.config import SlurmOptions  # noqa: PLC0415
        from nbgpu.launch.slurm import cluster_status  # noqa: PLC0415

        try:
            cluster = cluster_status(
                nodes=args.nodes,
                options=SlurmOptions(partition=args.partition),
                environ=self._environ(),
                probe=args.probe,
            )
        except UserInputError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            print(cluster.to_json())
            return None
        return cluster

    @magic_arguments()
    @argument("--no-probe", action="store_true", help="skip the active CUDA probe")
    @argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="check a planned number of ranks per node against the visible GPUs",
    )
    @argument("--json", action="store_true", help="print the report as JSON")
    @line_magic
    def gpu_doctor(self, line: str = "") -> Any:
        """Diagnose the GPUs and the launch environment; name each problem and its fix."""
        args = parse_or_help(self.gpu_doctor, line)
        if args is None:
            return None
        if args.nproc is not None and args.nproc < 1:
            raise UsageError(f"--nproc {args.nproc}: expected a whole number >= 1")
        from nbgpu.api import doctor  # noqa: PLC0415

        try:
            report = doctor(
                probe=not args.no_probe, nproc=args.nproc, environ=self._environ(), face="notebook"
            )
        except UserInputError as exc:
            raise UsageError(str(exc)) from None
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
        args = parse_or_help(self.gpu_clean, line)
        if args is None:
            return None
        if args.grace < 0:
            raise UsageError(f"--grace {args.grace}: expected seconds >= 0")
        from nbgpu.api import clean  # noqa: PLC0415

        def confirm(plan: CleanPlan) -> bool:
            print(plan.text())
            try:
                answer = input(f"Stop these {len(plan.candidates)} processes? [y/N] ")
            except (StdinNotImplementedError, EOFError):
                print("No way to ask here: nothing stopped. Re-run with %gpu_clean --yes.")
                return False
            return answer.strip().lower() in ("y", "yes")

        try:
            return clean(
                yes=args.yes,
                dry_run=args.dry_run,
                grace_s=args.grace,
                confirm=confirm,
                environ=self._environ(),
            )
        except UserInputError as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def gpu_plan(self, line: str = "") -> Any:
        """Plan a job before launching: roles on healthy GPUs, ports, batch sizes, memory.

        ``p = %gpu_plan sglang.d1t1p1+d3t1p1 --batch 8`` then ``%%torchrun --plan p``.
        Also ``--sweep RUNS --per-run K`` (disjoint runs) and ``--scale CONFIG --to N``.
        Flags are those of ``nbgpu plan`` (``%gpu_plan -h`` lists them).
        """
        import argparse  # noqa: PLC0415
        import shlex  # noqa: PLC0415

        from nbgpu.plan_cli import add_plan_arguments, plan_from_args, render_plan_output  # noqa: PLC0415

        class _Parser(argparse.ArgumentParser):
            def error(self, message: str) -> Any:
                raise UsageError(f"%gpu_plan: {message}")

        parser = _Parser(prog="%gpu_plan", add_help=False)
        add_plan_arguments(parser)
        try:
            tokens = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%gpu_plan {line!r}: {exc}") from None
        if "-h" in tokens or "--help" in tokens:
            print(inspect.cleandoc(_GPU_PLAN_DOC))
            print()
            print(parser.format_help())
            return None
        widget = "--widget" in tokens
        tokens = [t for t in tokens if t != "--widget"]
        args = parser.parse_args(tokens)
        if widget:
            return _plan_widget(self.shell.user_ns if self.shell is not None else {}, args)
        try:
            result = plan_from_args(args)
        except UserInputError as exc:
            raise UsageError(str(exc)) from None
        text = render_plan_output(result, args)
        if text is not None:
            print(text)
            return None
        return result

    def _environ(self) -> dict[str, str]:
        # The kernel's environment as it is now (%env changes it in place).
        import os  # noqa: PLC0415

        return dict(os.environ)


def _plan_widget(namespace: dict[str, Any], args: Any) -> None:
    """``%gpu_plan --widget``: the other flags give the controls their first values."""
    from nbgpu.notebook.plan_widget import PlanWidget  # noqa: PLC0415
    from nbgpu.notebook.widgets import widgets_available  # noqa: PLC0415

    if not widgets_available():
        raise UsageError("%gpu_plan --widget needs ipywidgets; without it use the flags")
    if args.slurm or args.nodes is not None or args.nproc_per_node is not None:
        raise UsageError(
            "%gpu_plan --widget plans one box; across nodes drop --widget "
            "(p = %gpu_plan --slurm --nproc-per-node P ...)"
        )
    initial = {
        "allocation": getattr(args, "allocation", None) or "",
        "global_batch": getattr(args, "batch", None) or 0,
        "micro_batch": getattr(args, "micro", None) or 0,
        "strategy": getattr(args, "strategy", None) or "ddp",
        "model": getattr(args, "model", None) or "",
    }
    try:
        PlanWidget(namespace, initial=initial).show()
    except UserInputError as exc:
        raise UsageError(str(exc)) from None
