"""The launch flags, declared once for ``%%torchrun`` and ``nbgpu run``: both faces build their
parsers from :data:`FLAGS` and get ``prepare()``'s keywords from :func:`prepare_options`.
"""

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.launch.config import BACKENDS, SlurmOptions, parse_env_pairs, parse_nproc, start_only

__all__ = [
    "FLAGS", "NOTEBOOK", "TERMINAL", "Flag", "add_flags", "arguments", "check_cell_flags",
    "check_keep_flags", "prepare_options", "pushed_names",
]  # fmt: skip

NOTEBOOK = "notebook"
TERMINAL = "terminal"
_BOTH = frozenset({NOTEBOOK, TERMINAL})
NOTEBOOK_ONLY = frozenset({NOTEBOOK})
TERMINAL_ONLY = frozenset({TERMINAL})


# Help words that differ by face: what the user runs, and the commands they can type there.
_WORDS = {
    "code": {NOTEBOOK: "cell", TERMINAL: "script"},
    "name": {NOTEBOOK: "%gpu_runs and %gpu_stop show it", TERMINAL: "its directory's name"},
    "memory": {NOTEBOOK: "%gpu_memory NAME", TERMINAL: "nbgpu memory RUNDIR"},
    "plan": {NOTEBOOK: " (p = %gpu_plan ...)", TERMINAL: " file (nbgpu plan --json)"},
}


@dataclass(frozen=True)
class Flag:
    """One launch flag: its names, argparse keywords, and help (``{word}``: see _WORDS)."""

    names: tuple[str, ...]
    help: str
    options: Mapping[str, Any] = field(default_factory=dict)
    faces: frozenset[str] = _BOTH
    by_face: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # overrides
    per_cell: bool = False  # may be given with --on (a warm job's next cell)

    @property
    def dest(self) -> str:
        """The attribute argparse stores it in (its first long name, as argparse does)."""
        return self.shown.lstrip("-").replace("-", "_")

    @property
    def shown(self) -> str:
        """The name messages use: the first long one (``--nodes``, not ``--nnodes``)."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    def given(self, args: argparse.Namespace) -> bool:
        """Whether the user typed this flag (its value differs from the default)."""
        default = self.options.get(
            "default", False if "store_true" in str(self.options.get("action")) else None
        )
        return getattr(args, self.dest, default) not in (default, None, [], False)

    def argparse_keywords(self, face: str) -> dict[str, Any]:
        keywords = {**self.options, **self.by_face.get(face, {})}
        text = str(keywords.get("help", self.help))
        for word, by_face in _WORDS.items():
            text = text.replace("{" + word + "}", by_face[face])
        keywords["help"] = text.replace("%", "%%")  # argparse formats help with %
        return keywords


FLAGS: tuple[Flag, ...] = (
    Flag(
        ("nproc",),
        "processes on this node (default: the healthy visible GPUs)",
        {"nargs": "?"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("-n", "--nproc"),
        "processes on this node (default: the healthy visible GPUs)",
        {"metavar": "N"},
        faces=TERMINAL_ONLY,
    ),
    Flag(
        ("--nproc-per-node",),
        "processes per node (the same as the count; reads well next to --nodes)",
        {"type": int, "metavar": "N"},
        per_cell=True,
    ),
    Flag(
        ("--nodes", "--nnodes"),
        "nodes to run on: with --slurm SLURM starts one agent on each; "
        "without, start the same {code} on every node with --rdzv-endpoint",
        {"type": int, "default": 1, "metavar": "N"},
    ),
    Flag(
        ("--slurm",),
        "launch through SLURM: use the allocation this kernel runs in "
        "(SLURM_JOB_ID), or request one for the run; srun starts torchrun on each node",
        {"action": "store_true"},
    ),
    Flag(("--partition",), "with --slurm: the partition to request nodes from", {"metavar": "P"}),
    Flag(
        ("--time",),
        "with --slurm: the allocation's time limit (SLURM's form: 30, 1:00:00)",
        {"metavar": "T"},
    ),
    Flag(("--account",), "with --slurm: the account to charge", {"metavar": "A"}),
    Flag(
        ("--gpus-per-node",),
        "with --slurm: GPUs to request on each node (one rank per GPU "
        "unless --nproc-per-node says otherwise)",
        {"type": int, "metavar": "G"},
    ),
    Flag(
        ("--slurm-arg",),
        "with --slurm: one more srun option, as written (repeatable), e.g. --slurm-arg=--exclusive",
        {"action": "append", "default": [], "metavar": "ARG"},
    ),
    Flag(
        ("--node-rank",),
        "without SLURM: this node's rank among --nodes (default: c10d assigns it)",
        {"type": int, "metavar": "R"},
    ),
    Flag(
        ("--rdzv-endpoint",),
        "without SLURM: HOST:PORT where every node's ranks meet (torchrun's c10d rendezvous)",
        {"metavar": "HOST:PORT"},
    ),
    Flag(
        ("--rdzv-timeout",),
        "with --nodes: seconds the nodes wait for each other at the "
        "rendezvous (default 120 with --slurm, 600 without)",
        {"type": float, "metavar": "S"},
    ),
    Flag(
        ("--gpus",),
        "physical GPUs to use (sets CUDA_VISIBLE_DEVICES); unknown or unhealthy "
        "GPUs are refused with the reason",
        {"metavar": "0,1,3"},
    ),
    Flag(
        ("--plan",),
        "take GPUs, nproc and port from a plan{plan}",
        by_face={NOTEBOOK: {"metavar": "VAR"}, TERMINAL: {"metavar": "FILE"}},
    ),
    Flag(("--role",), "with --plan: which role to launch"),
    Flag(
        ("--force",),
        "launch even on unhealthy GPUs or with more ranks than GPUs",
        {"action": "store_true"},
    ),
    Flag(("--name",), "a name for the run: {name}"),
    Flag(
        ("--bg",),
        "run in the background; output stays in this cell",
        {"action": "store_true"},
        faces=NOTEBOOK_ONLY,
    ),
    Flag(
        ("--keep",),
        "keep the ranks, their variables, process group and CUDA context after "
        "the cell: a warm job that runs later cells with --on NAME",
        {"action": "store_true"},
        faces=NOTEBOOK_ONLY,
    ),
    Flag(
        ("--on",),
        "run the cell on the ranks of the warm job NAME (started with --keep)",
        {"metavar": "NAME"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("--ranks",),
        "with --on: run the cell on these ranks only (0, 0,2 or 1-3); the others stay idle, "
        "their state untouched",
        {"metavar": "0,2"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("--pdb",),
        "with --keep or --on: a failed cell opens pdb on the first failed rank's traceback, "
        "here (see %gpu_debug)",
        {"action": "store_true"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("--idle-timeout",),
        "with --keep: end the warm job after S seconds without a cell "
        "(default: never; %gpu_runs shows it)",
        {"type": float, "metavar": "S"},
        faces=NOTEBOOK_ONLY,
    ),
    Flag(
        ("--master-port",),
        "rendezvous port (default: a free one; never 29500 by accident)",
        {"type": int, "metavar": "P"},
    ),
    Flag(
        ("--timeout",),
        "stop the whole run after S seconds (with --on: interrupt the cell)",
        {"type": float, "metavar": "S"},
        per_cell=True,
    ),
    Flag(
        ("--hang-after",),
        "a job with no output and a collective pending for S seconds is stalled: find the "
        "rank and the line (default 120; 0: never look; %gpu_runs shows it)",
        {"type": float, "metavar": "S"},
    ),
    Flag(
        ("--on-hang",),
        "what a stall does after its report: report (the job goes on: a slow step may "
        "finish) or stop",
        {"choices": ["report", "stop"], "default": "report"},
    ),
    Flag(
        ("--env",),
        "extra environment for the ranks (repeatable)",
        {"action": "append", "default": [], "metavar": "K=V"},
    ),
    Flag(
        ("--push",),
        "notebook variables to send into every rank (pickled)",
        {"metavar": "a,b"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("--pull",),
        "variables to bring back from rank 0 into the notebook (a,b)",
        {"metavar": "NAME"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("--all-ranks",),
        "with --pull: a list with every rank's value",
        {"action": "store_true"},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(
        ("--serial-imports",),
        "run the {code}'s leading imports one rank at a time (a file "
        "lock): cuts the import storm's host memory peak",
        {"action": "store_true"},
    ),
    Flag(("--mem-limit",), "per-rank address-space limit, e.g. 60G", {"metavar": "SIZE"}),
    Flag(
        ("--mem-sample",),
        "seconds between memory samples in every rank (default 0.1; 0: phases only); see {memory}",
        {"default": "0.1", "metavar": "S"},
    ),
    Flag(
        ("--backend",),
        "default process-group backend for nbgpu.rank.init()",
        {"choices": list(BACKENDS)},
    ),
    Flag(
        ("--strict",),
        "refuse to start when the {code} asks for CUDA that this machine's torch cannot give "
        "(a CPU build, no GPU visible); without it that is one line and the run starts",
        {"action": "store_true"},
    ),
    Flag(("--quiet",), "do not stream rank output", {"action": "store_true"}, per_cell=True),
    Flag(
        ("--view",),
        "per-rank tabs with state badges (widgets) or prefixed text; auto: "
        "widgets for background runs (with a Stop button) when ipywidgets is available, text "
        "in the foreground",
        {"default": "auto", "choices": ["auto", "text", "widgets"]},
        faces=NOTEBOOK_ONLY,
        per_cell=True,
    ),
    Flag(("script",), "the Python script every rank runs", faces=TERMINAL_ONLY),
    Flag(
        ("script_args",),
        "arguments for the script",
        {"nargs": argparse.REMAINDER},
        faces=TERMINAL_ONLY,
    ),
)


def arguments(face: str) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """``(names, argparse keywords)`` of every flag *face* has, in declaration order."""
    return [(f.names, f.argparse_keywords(face)) for f in FLAGS if face in f.faces]


def add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for names, keywords in arguments(TERMINAL):
        parser.add_argument(*names, **keywords)
    return parser


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


# Flags whose parsed value is prepare()'s keyword of the same name, as it is.
_AS_PARSED = ("gpus", "role", "force", "name", "serial_imports", "mem_limit", "mem_sample",
              "backend", "master_port", "quiet", "node_rank", "rdzv_endpoint", "on_hang")  # fmt: skip


def prepare_options(args: argparse.Namespace) -> dict[str, Any]:
    """``prepare()``'s keywords from either face's parsed flags, each checked; ``push`` and
    ``pull`` come back as names (a notebook variable or a plan file is the face's to resolve)."""
    nproc = None if args.nproc is None else parse_nproc(str(args.nproc))
    per_node = getattr(args, "nproc_per_node", None)
    if per_node is not None:
        if nproc is not None and nproc != per_node:
            raise UserInputError(
                f"nproc {nproc} and --nproc-per-node {per_node} disagree: give one of them"
            )
        nproc = parse_nproc(str(per_node))
    ranks = getattr(args, "ranks", None)
    if ranks is not None and getattr(args, "on", None) is None:
        raise UserInputError(
            f"--ranks {ranks}: a new job runs on every rank; --ranks picks ranks of a warm job "
            "for one cell: add --on NAME (a warm job starts with %%torchrun N --keep --name NAME)"
        )
    pull = _names(getattr(args, "pull", None))
    if getattr(args, "all_ranks", False) and not pull:
        raise UserInputError("--all-ranks needs --pull NAME")
    script_args = list(getattr(args, "script_args", None) or [])
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return {
        **{key: getattr(args, key) for key in _AS_PARSED},
        "nproc": nproc,
        "timeout_s": args.timeout,
        "env": parse_env_pairs(args.env),
        "pull": pull,
        "pull_all_ranks": bool(getattr(args, "all_ranks", False)),
        "script_args": script_args,
        "keep": bool(getattr(args, "keep", False)),
        "strict": bool(getattr(args, "strict", False)),
        "idle_timeout_s": getattr(args, "idle_timeout", None),
        "nnodes": args.nodes,
        "slurm": _slurm_options(args),
        "rdzv_timeout_s": args.rdzv_timeout,
        "hang_after_s": args.hang_after,
    }


def _slurm_options(args: argparse.Namespace) -> SlurmOptions | None:
    """``--slurm`` and its options; the options alone are a mistake worth naming."""
    given = {
        "--partition": args.partition,
        "--time": args.time,
        "--account": args.account,
        "--gpus-per-node": args.gpus_per_node,
        "--slurm-arg": args.slurm_arg or None,
    }
    if not args.slurm:
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:
            raise UserInputError(f"{stray[0]} asks SLURM for something: add --slurm")
        return None
    return SlurmOptions(
        args.partition, args.time, args.account, args.gpus_per_node, tuple(args.slurm_arg or ())
    )


def check_cell_flags(args: argparse.Namespace) -> None:
    """With ``--on``: refuse flags that only apply when a job starts (one line)."""
    for flag in FLAGS:
        if NOTEBOOK in flag.faces and not flag.per_cell and flag.given(args):
            raise start_only(flag.shown, args.on)


def check_keep_flags(args: argparse.Namespace) -> None:
    """``--keep``/``--on`` with ``--bg``: a warm job's cells run in the foreground;
    ``--pdb`` debugs a warm job's rank."""
    if getattr(args, "pdb", False) and not (args.keep or args.on):
        raise UserInputError(
            "--pdb debugs a failed cell of a warm job, whose ranks stay up: give it with --keep "
            "or --on NAME"
        )
    if args.bg and (args.keep or args.on):
        which = "--keep" if args.keep else f"--on {args.on}"
        raise UserInputError(
            f"--bg with {which}: a warm job runs its cells in the foreground, one at a time "
            "(interrupt keeps the ranks); drop --bg, or run a long job cold with --bg"
        )


def pushed_names(args: argparse.Namespace) -> list[str]:
    """``--push a,b`` as names (the notebook resolves them to values)."""
    return _names(getattr(args, "push", None))
