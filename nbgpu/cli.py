"""``nbgpu`` in a terminal (``nbgpu -h``): the same engine as the magics, as text.

Only parses arguments and calls the API (``nbgpu.api``, ``nbgpu.launch``,
``nbgpu.plan``, ``nbgpu.diagnose``). Exit codes: 0 fine; 1 a problem was found (doctor
findings to fix, a run that failed, a plan that is not ready, a diagnosed failure, a
process clean could not stop); 2 a usage error (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nbgpu.errors import NbgpuError, UserInputError

if TYPE_CHECKING:
    from nbgpu.devices.clean import CleanPlan, CleanReport
    from nbgpu.devices.doctor import DoctorReport

__all__ = ["clean_result", "doctor_result", "main", "status_result"]

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        # argparse prints the whole usage block; one line is what we promise.
        raise UserInputError(f"{self.prog}: {message} (see `{self.prog} -h`)")


def _flag(p: argparse.ArgumentParser, name: str, help_: str) -> None:
    p.add_argument(name, action="store_true", help=help_)


def _add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help="7B, 7.5e9, a model name (Qwen/Qwen2.5-7B-Instruct) or config.json"
    )
    # dest: the flags are estimate_memory's keywords, some under a shorter name.
    p.add_argument("--strategy", default="ddp", help="ddp, zero1, zero2, zero3, fsdp or distopt")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="GPUs in the job")
    p.add_argument("--micro", type=int, dest="micro_batch", metavar="N", help="micro batch per GPU")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample")
    p.add_argument("--precision", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--grad-dtype", metavar="P", help="gradients' precision (fp32: Megatron-LM)")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam or sgd")
    p.add_argument("--offload", metavar="WHAT", help="to the host: optimizer, params or both")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="ranks per host (offload)")
    p.add_argument("--tp", type=int, dest="tensor_parallel", metavar="N", help="TP degree")
    p.add_argument("--pp", type=int, dest="pipeline_parallel", metavar="N", help="PP degree")
    p.set_defaults(tensor_parallel=1, pipeline_parallel=1)
    p.add_argument("--role", default="train", help="train (default) or inference")
    _flag(p, "--checkpointing", "full activation checkpointing")
    _flag(p, "--no-flash", "attention scores materialised (5·a·s²·b)")
    p.add_argument("--kv-tokens", type=int, metavar="N", help="inference: KV tokens per GPU")
    p.add_argument("--budget", metavar="SIZE", help="per-GPU memory to fit, e.g. 80GB")
    p.add_argument(
        "--max-micro",
        choices=["auto"],
        help="with --budget: report the estimate at the largest micro batch that fits",
    )
    _flag(p, "--json", "print the estimate as JSON")


def _estimate(args: argparse.Namespace) -> int:
    from nbgpu.estimate import estimate_memory, largest_micro_batch  # noqa: PLC0415

    skip = ("command", "model", "budget", "max_micro", "json", "checkpointing", "no_flash")
    kwargs = {k: v for k, v in vars(args).items() if k not in skip}
    kwargs["activation_checkpointing"] = args.checkpointing
    kwargs["flash_attention"] = not args.no_flash
    if args.max_micro is not None:
        if args.budget is None:
            raise UserInputError("--max-micro auto needs --budget SIZE (e.g. 80GB)")
        result = largest_micro_batch(args.model, args.budget, **kwargs)
    else:
        result = estimate_memory(args.model, budget=args.budget, **kwargs)
    print(result.to_json() if args.json else result.text())
    return EXIT_PROBLEM if result.fits is False else EXIT_OK


def _status_arguments(p: argparse.ArgumentParser) -> None:
    _flag(p, "--json", "print a JSON snapshot (a fleet file NBGPU_SIMULATE accepts)")
    _flag(p, "--probe", "create a CUDA context per GPU in a subprocess to catch busy GPUs")
    p.add_argument(
        "--env", metavar="CVD", help="show cuda:N -> GPU for this CUDA_VISIBLE_DEVICES value"
    )
    _flag(
        p, "--slurm", "every node of the SLURM allocation (or of --nodes N requested for the look)"
    )
    p.add_argument("--nodes", type=int, metavar="N", help="with --slurm")
    p.add_argument("--partition", metavar="P", help="with --slurm")


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    _flag(p, "--no-probe", "skip the active CUDA probe")
    p.add_argument(
        "--nproc", type=int, metavar="N", help="check a planned number of ranks per node"
    )
    _flag(p, "--json", "print the report as JSON")


def _clean_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    _flag(p, "--dry-run", "only list")
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL (default 3)",
    )


def _diagnose_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a log file, a run directory, or - for standard input")
    _flag(p, "--json", "print the diagnosis as JSON")
    _flag(p, "--inventory", "add this machine's GPUs (holders, modes) to the findings")
    p.add_argument(
        "--max-evidence",
        type=int,
        default=5,
        metavar="N",
        help="evidence lines per finding (default 5)",
    )
    _flag(p, "--full-scan", "read every line (default: skip lines no cause can match)")
    p.add_argument("--name", help="a label for the report")


def _memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUNDIR", help="a run directory, or the name of a recent run")
    p.add_argument("--png", metavar="FILE", help="also draw the figure into FILE")
    _flag(p, "--json", "print the report as JSON")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from nbgpu.plan_cli import add_plan_arguments  # noqa: PLC0415

    add_plan_arguments(p)


def _runs_arguments(p: argparse.ArgumentParser) -> None:
    _flag(p, "--prune", "remove the oldest runs beyond the policy")
    p.add_argument("--keep", type=int, metavar="N", help="keep the last N runs (0: all)")
    p.add_argument(
        "--budget", metavar="SIZE", help="keep at most SIZE of runs, e.g. 5G (0: no limit)"
    )
    _flag(p, "--json", "print JSON")


def _stacks_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a run directory, or a run name under the runs directory")
    p.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="wait for dumps (default 5)"
    )
    _flag(p, "--native", "add native frames with py-spy if installed")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    from nbgpu.launch.flags import add_flags  # noqa: PLC0415

    add_flags(p)


# name: (help, its arguments), in `nbgpu -h`'s order.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "status": ("every GPU: health, memory, holders, cuda:N mapping", _status_arguments),
    "doctor": ("each GPU's health, the launch environment, and fixes", _doctor_arguments),
    "clean": ("stop your own stale GPU holders, after asking", _clean_arguments),
    "diagnose": ("name the cause of a failed run, its first rank, fixes", _diagnose_arguments),
    "memory": ("memory by phase and rank of a run, as a table and figure", _memory_arguments),
    "plan": ("place roles on GPUs, check batch sizes, sweeps, scaling", _plan_arguments),
    "estimate": ("per-GPU memory of a model, term by term, no trials", _add_estimate_arguments),
    "runs": ("run directories on disk; --prune applies the retention policy", _runs_arguments),
    "stacks": ("every rank's Python stack now (hung runs)", _stacks_arguments),
    "run": ("run a script as a torchrun job, streaming every rank", _run_arguments),
}


def _build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command, each with its arguments; given *command*, only that one (the others'
    arguments would import the launch and plan layers for nothing, and each sub-parser costs
    about a millisecond: `nbgpu status` is timed against nvitop, bench/RESULTS.md section 2)."""
    parser = _Parser(prog="nbgpu", description="Probe, plan, launch and diagnose multi-GPU jobs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (help_, add_arguments) in _COMMANDS.items():
        if command in (None, name):
            add_arguments(sub.add_parser(name, help=help_))
    return parser


def _run_script(args: argparse.Namespace) -> int:
    from nbgpu.launch.execute import execute, to_screen  # noqa: PLC0415
    from nbgpu.launch.flags import prepare_options  # noqa: PLC0415
    from nbgpu.launch.launcher import prepare  # noqa: PLC0415

    options = prepare_options(args)
    plan = None
    if args.plan is not None:
        from nbgpu.plan import plan_from_json  # noqa: PLC0415

        plan = plan_from_json(args.plan)
    prepared = prepare(script=args.script, plan=plan, face="terminal", **options)
    write = functools.partial(print, end="", flush=True)
    tty = sys.stdout.isatty()
    run = execute(
        prepared,
        to_screen(write, quiet=args.quiet, color=tty, live_status=tty),
        announce=lambda line: print(line, file=sys.stderr),
        check=False,
    )
    print(run.text(), file=sys.stderr)
    return EXIT_OK if run.state == "succeeded" else EXIT_PROBLEM


def _runs(args: argparse.Namespace) -> int:
    from nbgpu.launch import rundirs as retention  # noqa: PLC0415

    if not args.prune and (args.keep is not None or args.budget is not None):
        raise UserInputError("nbgpu runs: --keep and --budget go with --prune")
    if args.prune:
        result: Any = retention.prune(policy=retention.policy_from_options(args.keep, args.budget))
    else:
        result = retention.list_run_dirs()
    print(result.to_json() if args.json else result.text())
    return EXIT_OK


def _stacks(args: argparse.Namespace) -> int:
    from nbgpu.launch.procs import rank_stacks  # noqa: PLC0415
    from nbgpu.launch.rundirs import find_run_dir  # noqa: PLC0415

    result = rank_stacks(find_run_dir(args.run), timeout_s=args.timeout, native=args.native)
    print(result.text())
    return EXIT_OK if result.complete else EXIT_PROBLEM


def _diagnose(args: argparse.Namespace) -> int:
    from nbgpu.diagnose import diagnose  # noqa: PLC0415

    if args.max_evidence < 1:
        raise UserInputError(f"--max-evidence {args.max_evidence}: expected a whole number >= 1")
    source: Any = sys.stdin.buffer if args.source == "-" else args.source
    inventory = None
    if args.inventory:
        from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415

        inventory = take_inventory(scan_device_files=False)
    result = diagnose(
        source,
        inventory=inventory,
        name=args.name,
        max_evidence=args.max_evidence,
        full_scan=args.full_scan or None,
    )
    print(result.to_json() if args.json else result.text())
    return EXIT_PROBLEM if result.status == "failure" else EXIT_OK


def _memory(args: argparse.Namespace) -> int:
    from nbgpu.api import memory  # noqa: PLC0415

    report = memory(args.run)
    if args.png:
        report.png(args.png)
    print(report.to_json() if args.json else report.text())
    if args.png and not args.json:
        print(f"figure: {args.png}")
    return EXIT_OK if report.ranks else EXIT_PROBLEM


def _confirm_on_tty(plan: CleanPlan) -> bool:
    print(plan.text())
    if not sys.stdin.isatty():
        print("stdin is not a terminal: nothing stopped; re-run with --yes to stop them.")
        return False
    answer = input(f"Stop these {len(plan.candidates)} processes? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def status_result(args: argparse.Namespace, visible: str | None) -> Any:
    """``nbgpu status`` and ``%gpu_status``: this node's GPUs, or every SLURM node's."""
    if not args.slurm:
        from nbgpu.api import status  # noqa: PLC0415

        return status(probe=args.probe, visible_devices=visible)
    from nbgpu.launch.config import SlurmOptions  # noqa: PLC0415
    from nbgpu.launch.slurm import cluster_status  # noqa: PLC0415

    options = SlurmOptions(partition=args.partition)
    return cluster_status(nodes=args.nodes, options=options, environ=os.environ, probe=args.probe)


def doctor_result(args: argparse.Namespace, face: str) -> DoctorReport:
    """``nbgpu doctor`` and ``%gpu_doctor``: the report, --nproc checked first."""
    if args.nproc is not None and args.nproc < 1:
        raise UserInputError(f"--nproc {args.nproc}: expected a whole number >= 1")
    from nbgpu.api import doctor  # noqa: PLC0415

    return doctor(probe=not args.no_probe, nproc=args.nproc, face=face)


def clean_result(args: argparse.Namespace, confirm: Callable[[CleanPlan], bool]) -> CleanReport:
    """``nbgpu clean`` and ``%gpu_clean``: what was stopped, --grace checked first."""
    if args.grace < 0:
        raise UserInputError(f"--grace {args.grace}: expected seconds >= 0")
    from nbgpu.api import clean  # noqa: PLC0415

    return clean(yes=args.yes, dry_run=args.dry_run, grace_s=args.grace, confirm=confirm)


def _run(args: argparse.Namespace) -> int:
    if args.command == "status":
        result: Any = status_result(args, args.env)
        print(result.to_json() if args.json else result.text())
        return EXIT_OK
    if args.command == "doctor":
        report = doctor_result(args, "terminal")
        print(report.to_json() if args.json else report.text())
        return EXIT_OK if report.ok else EXIT_PROBLEM
    if args.command == "clean":
        cleaned = clean_result(args, _confirm_on_tty)
        print(cleaned.text())
        failed = [o for o in cleaned.outcomes if o.result.startswith("failed")]
        return EXIT_PROBLEM if failed else EXIT_OK
    commands = {
        "run": _run_script,
        "diagnose": _diagnose,
        "estimate": _estimate,
        "memory": _memory,
        "runs": _runs,
        "stacks": _stacks,
    }
    if args.command in commands:
        return commands[args.command](args)
    if args.command == "plan":
        from nbgpu.plan_cli import plan_from_args, render_plan_output  # noqa: PLC0415

        result = plan_from_args(args)
        print(render_plan_output(result, args) or result.text())
        return EXIT_OK if result.ok else EXIT_PROBLEM
    raise UserInputError(
        "nbgpu: choose a command: status, doctor, clean, run, runs, stacks, memory, plan, "
        "estimate or diagnose (see `nbgpu -h`)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    command = args[0] if args and args[0] in _COMMANDS else None
    if command == "run" and not {"-h", "--help", "--slurm"} & set(args):
        from nbgpu.launch.spare import agent_started_early  # noqa: PLC0415

        # The agent first: it imports torch while the run is prepared.
        with agent_started_early():
            return _main(_build_parser(command), args)
    return _main(_build_parser(command), args)


def _main(parser: argparse.ArgumentParser, args: list[str]) -> int:
    try:
        return _run(parser.parse_args(args))
    except UserInputError as exc:
        print(f"nbgpu: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NbgpuError as exc:
        print(f"nbgpu: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    except BrokenPipeError:
        # The reader went away (`nbgpu status | head`): not our error. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print("nbgpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
