"""``nbgpu`` in a terminal: the same engine as the magics, as text.

    nbgpu status [--json] [--probe] [--env CVD]
    nbgpu doctor [--no-probe] [--nproc N] [--json]
    nbgpu clean  [--yes] [--dry-run] [--grace S]

Only parses arguments and calls :mod:`nbgpu.api`. Exit codes: 0 fine, 1 the
doctor found a problem that needs fixing (or clean could not stop a process),
2 a usage error (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from nbgpu.errors import NbgpuError, UserInputError

__all__ = ["main"]

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        # argparse prints the whole usage block; one line is what we promise.
        raise UserInputError(f"{self.prog}: {message} (see `{self.prog} -h`)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nbgpu", description="Probe, diagnose and clean up GPUs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("status", help="every GPU: health, memory, holders, cuda:N mapping")
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON snapshot (a fleet file NBGPU_SIMULATE accepts)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="create a CUDA context per GPU in a subprocess to catch busy GPUs",
    )
    p.add_argument(
        "--env",
        metavar="CVD",
        default=None,
        help="show cuda:N -> GPU for this CUDA_VISIBLE_DEVICES value",
    )

    p = sub.add_parser("doctor", help="verdict per GPU, launch environment, and fixes")
    p.add_argument("--no-probe", action="store_true", help="skip the active CUDA probe")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="check a planned number of ranks per node",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("clean", help="stop your own stale GPU holders, after asking")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    p.add_argument("--dry-run", action="store_true", help="only list")
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL (default 3)",
    )
    return parser


def _confirm_on_tty(plan: Any) -> bool:
    print(plan.text())
    if not sys.stdin.isatty():
        print("stdin is not a terminal: nothing stopped; re-run with --yes to stop them.")
        return False
    answer = input(f"Stop these {len(plan.candidates)} processes? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _run(args: argparse.Namespace) -> int:
    from nbgpu import api  # noqa: PLC0415  (keeps `nbgpu -h` instant)

    if args.command == "status":
        inventory = api.status(probe=args.probe, visible_devices=args.env)
        print(inventory.to_json() if args.json else inventory.text())
        return EXIT_OK
    if args.command == "doctor":
        if args.nproc is not None and args.nproc < 1:
            raise UserInputError(f"--nproc {args.nproc}: expected a whole number >= 1")
        report = api.doctor(probe=not args.no_probe, nproc=args.nproc)
        print(report.to_json() if args.json else report.text())
        return EXIT_OK if report.ok else EXIT_PROBLEM
    if args.command == "clean":
        if args.grace < 0:
            raise UserInputError(f"--grace {args.grace}: expected seconds >= 0")
        cleaned = api.clean(
            yes=args.yes, dry_run=args.dry_run, grace_s=args.grace, confirm=_confirm_on_tty
        )
        print(cleaned.text())
        failed = [o for o in cleaned.outcomes if o.result.startswith("failed")]
        return EXIT_PROBLEM if failed else EXIT_OK
    raise UserInputError("nbgpu: choose a command: status, doctor or clean (see `nbgpu -h`)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        return _run(args)
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
