"""Every magic's argument line and every CLI subcommand's arguments, generated (issue 26).

Flags that reach beyond this process are left out of the vocabulary: ``--slurm`` (asks the
SLURM controller through srun) and ``--probe`` (a CUDA probe subprocess per example; the
doctor gets ``--no-probe``). ``%%torchrun`` gets an empty cell (its line form: no cell), so
every flag is parsed and checked and no run starts; ``nbgpu run`` never names an existing
script.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from nbgpu.cli import _build_parser
from nbgpu.launch import flags
from tests.fuzz.harness import arg_lines, fuzz_settings, judge_call, judge_cli, token_lists

LEFT_OUT = {"--slurm", "--probe", "-h", "--help"}  # -h: one token of NASTY says it


def _options(parser: argparse.ArgumentParser) -> list[str]:
    names = [o for a in parser._actions for o in a.option_strings]
    return [n for n in names if n not in LEFT_OUT]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = _build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def _exists(token: str) -> bool:
    try:
        return Path(token).expanduser().exists()
    except (RuntimeError, ValueError):  # ~nosuchuser, a NUL
        return False


SUB = _subparsers()
LAUNCH = [n for names, _ in flags.arguments(flags.NOTEBOOK) for n in names if n.startswith("-")]
MAGICS = {
    "gpu_status": ["--json", "--env", "--nodes", "--partition"],
    "gpu_doctor": ["--nproc", "--json"],
    "gpu_clean": ["--yes", "-y", "--dry-run", "--grace"],
    "gpu_plan": [*_options(SUB["plan"]), "--widget"],
    "gpu_memory": ["--png", "--no-figure", "kernel"],
    "gpu_diagnose": ["kernel", "no-such-run"],
    "gpu_runs": ["--prune", "--keep", "--budget"],
    "gpu_stacks": ["--native", "--timeout"],
    "gpu_debug": ["-c", "where", "w", "1"],
    "gpu_stop": ["--all"],
    "gpu_watch": ["--interval", "--history", "--view", "--stop"],
}
EXAMPLES = 30


@pytest.mark.parametrize("name", MAGICS)
@fuzz_settings(EXAMPLES)
@given(data=st.data())
def test_line_magic_arguments(shell, name, data):
    """%NAME LINE: a result or one line."""
    line = data.draw(arg_lines(MAGICS[name]), label="line")
    if name == "gpu_doctor":
        line += " --no-probe"
    judge_call(f"%{name}", f"%{name} {line!r}", lambda: shell.run_line_magic(name, line))
    if name == "gpu_watch":
        shell.run_line_magic("gpu_watch", "--stop")


@fuzz_settings(EXAMPLES)
@given(line=arg_lines(["--mem-sample", "load model"]))
def test_gpu_phase_arguments(shell, line):
    judge_call(
        "%%gpu_phase",
        f"%%gpu_phase {line!r}",
        lambda: shell.run_cell_magic("gpu_phase", line, "pass"),
    )


@st.composite
def torchrun_lines(draw):
    """A head of launch flags, and with half the lines '--' and the ranks' own arguments."""
    head = draw(token_lists([*LAUNCH, "2", "4", "auto"]))
    if draw(st.booleans()):
        return " ".join([*head, "--", *draw(token_lists(["--lr", "3e-4", "--help", "--"]))])
    return draw(st.one_of(st.just(" ".join(head)), arg_lines(LAUNCH)))


@fuzz_settings(2 * EXAMPLES)
@given(line=torchrun_lines(), as_cell=st.booleans())
def test_torchrun_arguments(shell, line, as_cell):
    if as_cell:  # a blank cell (as the input transformer passes it): parsed, checked, not run
        call = lambda: shell.run_cell_magic("torchrun", line, "\n")  # noqa: E731
        judge_call("%%torchrun", f"%%torchrun {line!r}", call)
    else:
        judge_call(
            "%%torchrun", f"%torchrun {line!r}", lambda: shell.run_line_magic("torchrun", line)
        )


@pytest.mark.parametrize("sub", SUB)
@fuzz_settings(EXAMPLES)
@given(data=st.data())
def test_cli_arguments(sandbox, sub, data):  # noqa: ARG001  (the sandbox is the point)
    """nbgpu SUB ARGS: exit 0 or 1, or exit 2 with one line."""
    argv = data.draw(token_lists(_options(SUB[sub])), label="argv")
    if sub == "run":  # never a script that exists: no run starts
        assume(not any(_exists(t) for t in argv))
    if sub == "doctor":
        argv = [*argv, "--no-probe"]
    judge_cli(f"nbgpu {sub}", [sub, *argv])


@fuzz_settings(EXAMPLES)
@given(argv=token_lists([*SUB, "--help"]))
def test_cli_without_a_command(sandbox, argv):  # noqa: ARG001
    judge_cli("nbgpu", argv)
