"""``%%torchrun``, ``%gpu_runs``, ``%gpu_stop``, ``%gpu_stacks``, ``%gpu_diagnose``: the
launch face in a notebook. Parses arguments, calls :mod:`nbgpu.launch` (imported inside
the magics), and renders; where a run's lines go is ``widgets.py``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from IPython.core.completer import SimpleCompletion, SimpleMatcherResult, context_matcher
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbgpu.errors import UserInputError
from nbgpu.launch import flags
from nbgpu.notebook.magics import parse_or_help, user_errors, words

if TYPE_CHECKING:  # the launch engine loads on first use; %load_ext stays light
    from argparse import Namespace

    from IPython.core.completer import CompletionContext

    from nbgpu.launch.run import Run
    from nbgpu.launch.warm import CellResult

__all__ = ["LaunchMagics", "keep_empty_cell_body", "torchrun_matcher"]


def _launch_flags(method: Any) -> Any:
    # Decorators apply last-first; magic_arguments lists them as written: go backwards.
    for names, keywords in reversed(flags.arguments(flags.NOTEBOOK)):
        method = argument(*names, **keywords)(method)
    return magic_arguments()(method)


@magics_class
class LaunchMagics(Magics):
    """Launch and manage distributed runs; see each magic's ``-h``."""

    @_launch_flags
    @line_cell_magic
    def torchrun(self, line: str, cell: str | None = None) -> Any:
        """Run this cell as a torchrun job: ``%%torchrun 4`` starts four fresh processes.

        Every rank's output streams here, labelled ``[rankN]``; complete per-rank
        logs stay in the run directory. Arguments after ``--`` become the ranks'
        ``sys.argv``. Interrupting the cell stops every process of the run.
        """
        # Only flags before "--" are nbgpu's: "-- --help" is the cell's own --help.
        # '4 --gpus 0,1 -- --lr 3e-4' → '4 --gpus 0,1' and the ranks' ['--lr', '3e-4'].
        tokens = words(line, "%%torchrun")
        cut = tokens.index("--") if "--" in tokens else len(tokens)
        if (args := parse_or_help(self, "torchrun", tokens[:cut])) is None:
            return None
        # Every flag checked first, wherever typed: a hop between the two magics would not say it.
        with user_errors():
            options, pushed = self._options(args)
        options["script_args"] = tokens[cut + 1 :]
        if cell is None:
            raise UsageError(
                "%torchrun runs a whole cell: put %%torchrun N on the cell's first line "
                "(or call nbgpu.torchrun(code, N) from Python)"
            )
        if not cell.strip():
            raise UsageError(
                f"%%torchrun {line.strip()}: the cell is empty: write the code to run on the "
                "lines below %%torchrun"
            )
        if args.on is not None:
            return self._run_on(args, cell, options, pushed)
        from nbgpu.launch.spare import agent_started_early  # noqa: PLC0415  (not on %load_ext)

        # The agent first: it imports torch while the run is prepared (nbgpu/launch/spare.py).
        with agent_started_early(enabled=not args.slurm):
            return self._start(args, cell, options, pushed)

    def _start(
        self, args: Namespace, cell: str, options: dict[str, Any], pushed: dict[str, Any]
    ) -> Any:
        from nbgpu.launch.execute import execute  # noqa: PLC0415
        from nbgpu.launch.launcher import prepare  # noqa: PLC0415
        from nbgpu.notebook.widgets import background_output, foreground_output  # noqa: PLC0415

        with user_errors():
            plan = None if args.plan is None else self._variable("--plan", args.plan)
            prepared = prepare(code=cell, plan=plan, push=pushed, **options)
        if args.bg:
            run = execute(
                prepared,
                lambda run: background_output(run, args.view, quiet=args.quiet),
                announce=print,
                background=True,
                on_done=lambda r: self._deliver(r, options, announce=False),
            )
            return None
        # A failed run raises RunFailed: the ranks' output (tracebacks too) is in this cell.
        with self._pdb_on_failure(enabled=args.pdb):
            run = execute(
                prepared,
                foreground_output(args),
                announce=print,
                on_done=lambda r: self._deliver(r, options, announce=True),
            )
        if prepared.config.keep:
            print(
                f"[nbgpu] '{run.name}' is warm: %%torchrun --on {run.name} runs the next cell "
                f"in the same ranks; %gpu_runs shows it, %gpu_stop {run.name} ends it"
            )
            return None
        return run

    def _run_on(
        self, args: Namespace, cell: str, options: dict[str, Any], pushed: dict[str, Any]
    ) -> CellResult | None:
        """``%%torchrun --on NAME``: the cell on a warm job's ranks."""
        from nbgpu.launch.execute import execute_cell, prepare_cell  # noqa: PLC0415
        from nbgpu.notebook.widgets import foreground_output  # noqa: PLC0415

        keys = ("nproc", "pull", "pull_all_ranks", "timeout_s", "quiet", "script_args")
        with user_errors():
            run, request = prepare_cell(
                args.on, cell, push=pushed, ranks=args.ranks, **{k: options[k] for k in keys}
            )
        # A cell that raised is CellFailed (the ranks stay); a dead rank is RunFailed.
        with self._pdb_on_failure(enabled=args.pdb):
            return execute_cell(
                run,
                request,
                foreground_output(args),
                on_done=lambda r: self._deliver(r, options, announce=True),
            )

    @contextmanager
    def _pdb_on_failure(self, *, enabled: bool) -> Iterator[None]:
        """``--pdb``: a failed warm cell opens pdb on its lowest failed rank, then fails as
        it would have."""
        from nbgpu.launch.warm import CellFailed  # noqa: PLC0415

        try:
            yield
        except CellFailed as failure:
            if enabled:
                try:
                    self._debug([failure.result.run_name], None)
                except UsageError as exc:  # said in one line; the cell's failure is the error
                    print(f"[nbgpu] {exc}", file=sys.stderr)
            raise

    def _debug(self, target: list[str], commands: list[str] | None) -> None:
        from nbgpu.launch.debug import choose_rank, debug_target, post_mortem  # noqa: PLC0415
        from nbgpu.launch.execute import runs, to_screen, warm_run  # noqa: PLC0415

        with user_errors():
            name, rank = debug_target(target, runs())
            run = warm_run(name, "%gpu_debug")
            rank = choose_rank(run, rank)
            screen = to_screen(functools.partial(print, end="", flush=True), color=True)(run)
            post_mortem(run, rank, screen.sink, commands=commands)

    @magic_arguments()
    @argument(
        "target",
        nargs="*",
        metavar="NAME RANK",
        help="the warm job (default: the latest) and the rank (default: the lowest that failed)",
    )
    @argument(
        "-c",
        dest="commands",
        action="append",
        metavar="CMD",
        help="a pdb command to run instead of asking (repeatable); for saved notebooks and "
        "nbval, which cannot answer input()",
    )
    @line_magic
    def gpu_debug(self, line: str = "") -> None:
        """pdb on a rank whose warm cell failed (post-mortem): ``%gpu_debug 1``.

        pdb's output comes here and its prompt asks here: p x, where, up, list...; q or c
        ends it, and the job stays warm (the other ranks wait idle, their state kept).
        ``%%torchrun --on NAME --pdb`` opens it when a cell fails; ``breakpoint()`` in a
        warm cell stops its rank with the same prompt, and c lets it go on.
        """
        if (args := parse_or_help(self, "gpu_debug", line)) is None:
            return
        self._debug(args.target, args.commands)

    def _variable(self, flag: str, name: str) -> Any:
        """The notebook variable a flag names (``--plan p``, ``--push x``)."""
        namespace = self.shell.user_ns if self.shell is not None else {}
        if name not in namespace:
            raise UserInputError(f"{flag} {name}: no variable {name!r} in the notebook")
        return namespace[name]

    def _options(self, args: Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
        """``prepare()`` keywords from the flags (checked), and the ``--push`` values."""
        flags.check_keep_flags(args)
        if args.on is not None:
            flags.check_cell_flags(args)
        options = flags.prepare_options(args)
        return options, {n: self._variable("--push", n) for n in flags.pushed_names(args)}

    def _deliver(self, run: Run | CellResult, options: dict[str, Any], *, announce: bool) -> None:
        """The ``--pull`` values of a run or cell that ended, into the notebook."""
        names, all_ranks = options["pull"], options["pull_all_ranks"]
        if not names or self.shell is None:
            return
        got = [n for n in names if all_ranks or n in run.pulled]
        for name in got:
            value = [v.get(name) for v in run.pulled_all] if all_ranks else run.pulled[name]
            self.shell.user_ns[name] = value
        for problem in run.pull_problems:
            print(f"[nbgpu] {problem}", file=sys.stderr)
        if announce and got:
            print(f"[nbgpu] pulled into the notebook: {', '.join(got)}")

    @magic_arguments()
    @argument(
        "source",
        nargs="?",
        metavar="NAME|PATH",
        help="a run of this kernel (see %%gpu_runs), a log file or a run directory "
        "(default: the last failed run here)",
    )
    @line_magic
    def gpu_diagnose(self, line: str = "") -> Any:
        """Name the cause of a failed run, the rank that failed first, the evidence lines and
        the fixes."""
        if (args := parse_or_help(self, "gpu_diagnose", line)) is None:
            return None
        from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415
        from nbgpu.diagnose import diagnose  # noqa: PLC0415
        from nbgpu.launch.execute import runs  # noqa: PLC0415

        known = runs()
        if args.source is None:
            failed = [r for r in known.values() if r.state not in ("succeeded", "running")]
            if not failed:
                raise UsageError("no failed run in this kernel: %gpu_diagnose NAME|PATH")
            source: Any = failed[-1].dir
        else:
            source = known[args.source].dir if args.source in known else args.source
        with user_errors():
            return diagnose(source, inventory=take_inventory(scan_device_files=False))

    @magic_arguments()
    @argument("name", nargs="?", help="a warm job: the names its ranks hold (type, size, ranks)")
    @argument("--prune", action="store_true", help="remove the oldest run directories instead")
    @argument("--keep", metavar="N", help="with --prune: keep the last N runs")
    @argument("--budget", metavar="SIZE", help="with --prune: keep at most SIZE of runs")
    @line_magic
    def gpu_runs(self, line: str = "") -> Any:
        """List this kernel's runs: name, state, ranks, GPUs, port, age, quiet ranks (no
        output for NBGPU_SILENT_AFTER seconds, default 120: a hang shows up as silence;
        see %gpu_stacks), log directory. The result converts with .to_frame();
        nbgpu.runs() returns the Run objects.

        --prune removes the oldest run directories (of every kernel) beyond the retention
        policy: the last NBGPU_KEEP_RUNS runs (default 20) and at most NBGPU_RUNS_BUDGET
        (default 5G); --keep and --budget override them once. Runs in use and directories
        holding a KEEP file are never removed. nbgpu prunes before each new run too.

        %gpu_runs NAME lists the names a warm job's ranks hold after their last cell: type,
        size (a tensor's shape, dtype and bytes; a container's length) and which ranks.
        """
        if (args := parse_or_help(self, "gpu_runs", line)) is None:
            return None
        from nbgpu.launch import rundirs as retention  # noqa: PLC0415
        from nbgpu.launch.execute import runs_table  # noqa: PLC0415

        if not args.prune and (args.keep is not None or args.budget is not None):
            raise UsageError("%gpu_runs: --keep and --budget go with --prune")
        if args.name is not None and not args.prune:
            from nbgpu.launch.held import held_names  # noqa: PLC0415

            with user_errors():
                return held_names(args.name)
        if not args.prune:
            return runs_table()
        with user_errors():  # the policy checks the values (--keep 'x' is named there)
            return retention.prune(policy=retention.policy_from_options(args.keep, args.budget))

    @magic_arguments()
    @argument("run", help="a run name of this kernel, a run directory, or a run name on disk")
    @argument("--native", action="store_true", help="add native frames from py-spy if it may")
    @argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait (5)")
    @line_magic
    def gpu_stacks(self, line: str = "") -> Any:
        """Every rank's Python stack now, all at once, without ptrace: each rank dumps its
        threads' stacks (faulthandler) into stacks-rank{N}.txt in the run directory."""
        if (args := parse_or_help(self, "gpu_stacks", line)) is None:
            return None
        from nbgpu.launch.execute import runs  # noqa: PLC0415
        from nbgpu.launch.procs import rank_stacks  # noqa: PLC0415
        from nbgpu.launch.rundirs import find_run_dir  # noqa: PLC0415

        known = runs()
        with user_errors():
            where = known[args.run].dir if args.run in known else find_run_dir(args.run)
        return rank_stacks(where, timeout_s=args.timeout, native=args.native)

    @magic_arguments()
    @argument("name", nargs="?", help="the run to stop")
    @argument("--all", action="store_true", help="stop every running run of this kernel")
    @line_magic
    def gpu_stop(self, line: str = "") -> Any:
        """Stop a run (or --all): SIGTERM, then SIGKILL of every process, on one deadline."""
        if (args := parse_or_help(self, "gpu_stop", line)) is None:
            return None
        if not args.all and not args.name:
            raise UsageError("%gpu_stop NAME or %gpu_stop --all (see %gpu_runs for names)")
        from nbgpu.launch.execute import stop_runs  # noqa: PLC0415

        with user_errors():
            return stop_runs(None if args.all else args.name)


def keep_empty_cell_body(lines: list[str]) -> list[str]:
    """Input transformer: IPython answers an empty cell magic itself ("did you mean the line magic
    %torchrun?"); a blank body lets ``%%torchrun ARGS`` name a bad argument or the empty cell."""
    head = lines[0].split()[:1] if lines else []
    if head == ["%%torchrun"] and not any(line.strip() for line in lines[1:]):
        return [lines[0] if lines[0].endswith("\n") else lines[0] + "\n", "\n"]
    return lines


@context_matcher(identifier="nbgpu.torchrun")
def torchrun_matcher(context: CompletionContext) -> SimpleMatcherResult:
    """``%%torchrun --on <TAB>``: the warm jobs; ``--on w --pull <TAB>``: the names rank 0
    of ``w`` holds (each rank reports them after every cell)."""
    words = context.text_until_cursor.split()
    if context.cursor_line != 0 or not words or words[0] not in ("%%torchrun", "%torchrun"):
        return {"completions": []}
    # The flag before the word being typed (or before the cursor, after a space).
    flag = (words if context.text_until_cursor[-1:].isspace() else ["", *words[:-1]])[-1]
    # Nothing to offer before a run started: the launch engine is not even loaded then.
    run_module = sys.modules.get("nbgpu.launch.run")
    runs = {} if run_module is None else run_module.RUNS
    warm = {name: run.warm for name, run in runs.items() if run.warm is not None and not run.done}
    offered: list[str] = []
    if flag == "--on":
        offered = list(warm)
    elif flag == "--pull" and "--on" in words[:-1]:
        job = warm.get(words[words.index("--on") + 1])
        reports = [] if job is None else [job.held[rank] for rank in sorted(job.held)]
        offered = [entry["name"] for entry in (reports[0]["names"] if reports else [])]
    matches = [SimpleCompletion(n, type="variable") for n in offered if n.startswith(context.token)]
    return {"completions": matches, "suppress": bool(matches)}
