"""Run a notebook in a real Jupyter kernel and show it as text, cell by cell.

    python notebooks/run_headless.py notebooks/quickstart.ipynb [--write] [--timeout S]

This is what ``make demo`` shows and what ``tests/test_notebooks.py`` runs. The
kernel is this interpreter's own ipykernel (the venv's python, whatever kernelspecs
are installed elsewhere); its working directory is the notebook's folder, as in
nbval and JupyterLab.

A cell fails the run when the kernel replies with an error. That covers exceptions
and also a magic's ``UsageError``, which reaches the notebook only as a stderr line
(no ``error`` output), so nbval does not notice it. Cells marked like nbval's
``# NBVAL_RAISES_EXCEPTION`` (or tagged ``raises-exception``) may fail; cells marked
``# NBVAL_SKIP`` (or tagged ``nbval-skip``/``skip-execution``) are not run.

Exit codes: 0 every cell ran, 1 a cell failed (its error is printed), 2 bad usage.
Nothing is written back unless ``--write`` is given; then the notebook is saved with
its new outputs and execution counts (no timing metadata).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import ipykernel.kernelspec
import nbformat
import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from traitlets import default

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

SOURCE_HEAD_LINES = 4
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAISES = {"NBVAL_RAISES_EXCEPTION", "raises-exception", "nbval-raises-exception"}
_SKIP = {"NBVAL_SKIP", "nbval-skip", "skip-execution"}
_MARKERS = (
    "NBVAL_CHECK_OUTPUT",
    "NBVAL_IGNORE_OUTPUT",
    "NBVAL_RAISES_EXCEPTION",
    "NBVAL_SKIP",
)


class CellFailedError(Exception):
    """A code cell ended in an error the notebook did not declare."""

    def __init__(self, number: int, ename: str, evalue: str, traceback: list[str]) -> None:
        super().__init__(f"In [{number}]: {ename}: {evalue}")
        self.number = number
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback


class CurrentEnvKernelSpecs(KernelSpecManager):
    """Every kernel name means ipykernel in *this* interpreter (like nbval --nbval-current-env).

    A ``python3`` kernelspec elsewhere (``~/.local/share/jupyter``, ``/usr/share/jupyter``)
    may point at another Python; this one never does, and nothing is installed.
    """

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002  (one spec for all)
        return KernelSpec(
            resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict()
        )


class CurrentEnvKernelManager(AsyncKernelManager):
    """The kernel manager nbclient creates (and so shuts down): this venv's ipykernel."""

    @default("kernel_spec_manager")
    def _current_env_specs(self) -> KernelSpecManager:
        return CurrentEnvKernelSpecs()

    @default("transport_encryption")
    def _encrypt_if_possible(self) -> str:
        # CurveZMQ on the kernel's TCP sockets when pyzmq has it; this also keeps the
        # kernel from warning about plain-text TCP on every start.
        return "auto" if zmq.has("curve") else "disabled"


def _markers(cell: Any) -> set[str]:
    found = set(cell.get("metadata", {}).get("tags", []))
    for line in cell.source.splitlines():
        text = line.strip()
        if text.startswith("#"):
            found.add(text.lstrip("#").strip())
    return found


def _headings(markdown: str) -> list[str]:
    """The Markdown headings of a cell (not ``#`` comments inside code fences)."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line)
    return found


def _source_head(source: str) -> list[str]:
    lines = [
        line
        for line in source.splitlines()
        if line.strip() and line.strip().lstrip("#").strip() not in _MARKERS
    ]
    head = lines[:SOURCE_HEAD_LINES]
    if len(lines) > SOURCE_HEAD_LINES:
        more = len(lines) - SOURCE_HEAD_LINES
        head.append(f"... ({more} more line{'s' if more > 1 else ''})")
    return head


def _output_text(output: Any) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return str(output.get("text", ""))
    if kind in ("execute_result", "display_data"):
        data = output.get("data", {})
        if "text/plain" in data:
            return str(data["text/plain"]) + "\n"
        return "".join(f"[{mime} output]\n" for mime in data)
    if kind == "error":
        return f"{output.get('ename')}: {output.get('evalue')}\n"
    return ""


def _usage_error_line(cell: Any) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and output.get("name") == "stderr":
            for line in str(output.get("text", "")).splitlines():
                if line.startswith("UsageError"):
                    return line
    return None


class HeadlessClient(NotebookClient):
    """An nbclient that prints each cell as it runs and stops at the first failure."""

    def __init__(self, nb: Any, *, out: Any, **kwargs: Any) -> None:
        # Errors are judged here, per cell: nbclient would let a UsageError that
        # arrives only on stderr through when a cell allows errors.
        # No widget state in the notebook's metadata: every live view leaves static
        # outputs (nbgpu.notebook.live), and state nobody can use only grows the file.
        super().__init__(nb, allow_errors=True, store_widget_state=False, **kwargs)
        self.out = out
        self._reply: dict[str, Any] | None = None
        self.on_cell_executed = self._remember_reply

    def _remember_reply(self, **kwargs: Any) -> None:
        self._reply = kwargs.get("execute_reply")

    def _print(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    async def async_execute_cell(
        self,
        cell: Any,
        cell_index: int,
        execution_count: int | None = None,
        store_history: bool = True,
    ) -> Any:
        if cell.cell_type == "markdown":
            for heading in _headings(cell.source):
                self._print(f"\n{heading}\n")
            return cell
        if cell.cell_type != "code" or not cell.source.strip():
            return cell
        markers = _markers(cell)
        head = _source_head(cell.source)
        if markers & _SKIP:
            self._print(f"\n[skipped] {head[0] if head else ''}\n")
            return cell
        number = self.code_cells_executed + 1
        prompt = f"In [{number}]: "
        self._print(
            "\n"
            + "\n".join(prompt + h if i == 0 else " " * len(prompt) + h for i, h in enumerate(head))
            + "\n"
        )
        self._reply = None
        cell = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        for output in cell.get("outputs", []):
            self._print(_output_text(output))
        if markers & _RAISES:
            return cell
        content = (self._reply or {}).get("content", {})
        if content.get("status") == "error":
            raise CellFailedError(
                number,
                content.get("ename", "Error"),
                content.get("evalue", ""),
                list(content.get("traceback", [])),
            )
        usage = _usage_error_line(cell)
        if usage is not None:
            raise CellFailedError(number, "UsageError", usage.partition(":")[2].strip(), [])
        return cell


def _resolve_overwrites(text: str) -> str:
    """What a terminal or JupyterLab shows of ``text``: a backspace deletes the character
    before it on its line (how nbgpu erases its live memory line), and after a ``\\r`` the
    line restarts."""
    kept: list[str] = []
    for char in text:
        if char != "\b":
            kept.append(char)
        elif kept and kept[-1] != "\n":
            kept.pop()
    text = re.sub(
        r"\r+\n", "\n", "".join(kept)
    )  # a carriage return before a newline changes nothing
    lines = text.split("\n")
    return "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line else line for line in lines)


def _as_a_front_end_saves(outputs: list[Any]) -> list[Any]:
    """Merge consecutive stream outputs and resolve ``\\b`` and ``\\r`` as JupyterLab does on save.

    nbclient stores every stream message as it came; a live line refreshed with ``\\r``
    (the memory summary of a run) would otherwise be kept as dozens of entries that a
    notebook saved from JupyterLab never contains.
    """
    merged: list[Any] = []
    for output in outputs:
        if (
            output.get("output_type") == "stream"
            and merged
            and merged[-1].get("output_type") == "stream"
            and merged[-1].get("name") == output.get("name")
        ):
            merged[-1]["text"] = merged[-1]["text"] + output["text"]
        else:
            merged.append(output)
    for output in merged:
        if output.get("output_type") == "stream":
            output["text"] = _resolve_overwrites(output["text"])
    return merged


def run_notebook(
    path: Path, *, timeout: float = 300.0, out: Any = None, write: bool = False
) -> int:
    """Execute *path*; print as it goes; return an exit code (see the module doc)."""
    out = sys.stdout if out is None else out
    nb = nbformat.read(path, as_version=4)
    client = HeadlessClient(
        nb,
        out=out,
        kernel_manager_class=CurrentEnvKernelManager,
        kernel_name="python3",
        timeout=timeout,
        startup_timeout=60,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    out.write(f"== {path} (kernel: {ipykernel.kernelspec.get_kernel_dict()['argv'][0]})\n")
    try:
        client.execute()
    except CellFailedError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        for line in exc.traceback:
            print(_ANSI.sub("", line), file=sys.stderr)
        return EXIT_FAILED
    except CellTimeoutError as exc:
        print(f"\nFAILED: a cell ran longer than {timeout:g} s: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except DeadKernelError as exc:
        print(f"\nFAILED: the kernel died: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if write:
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs = _as_a_front_end_saves(cell.outputs)
        nb.metadata.pop("widgets", None)  # widget state from an older run
        nbformat.write(nb, path)
        out.write(f"\nwrote {path}\n")
    out.write(f"\n== {path}: {client.code_cells_executed} code cells ran without error\n")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="run_headless.py", description="Run a notebook in a real kernel; print it as text."
    )
    parser.add_argument("notebook", type=Path, help="path to a .ipynb file")
    parser.add_argument(
        "--write",
        action="store_true",
        help="save the executed notebook (outputs, execution counts) in place",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds a single cell may run (default 300)",
    )
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"{args.notebook}: no such notebook")
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout:g}: expected seconds > 0")
    return run_notebook(args.notebook, timeout=args.timeout, write=args.write)


if __name__ == "__main__":
    sys.exit(main())
