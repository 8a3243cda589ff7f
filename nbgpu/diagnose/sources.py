"""Where logs come from: strings, files, run directories, streams; run.json and error files.

:func:`resolve` turns what the user passed into :class:`Inputs`: the logs to stream (each
with the rank it belongs to, when its name says so), torchelastic error files, and the
launcher's ``run.json``. The run directory layout is nbgpu's launcher's::

    <rundir>/run.json           name, nproc, nnodes, gpus, cuda_visible_devices,
                                agent_exit_code, warm (cell, log_offsets), and per rank:
                                rank, local_rank, exit_code, signal, ended_at
    <rundir>/rank{N}.log        rank N's stdout and stderr, raw bytes
    <rundir>/rank{N}.node       over several nodes: the node rank N ran on
    <rundir>/error-rank{N}.json the error file torch's ``@record`` writes for rank N
    <rundir>/agent.log          torchrun's output; on failure its ChildFailedError banner

Any other directory is searched (a few levels deep) for ``*.log``, ``*.txt``, ``*.out``,
``*.err`` and torchelastic's ``error.json`` files; torchelastic's ``--log-dir`` layout
(``attempt_0/<local_rank>/stdout.log``) gives each file its rank. Files are read in
chunks, never whole. A missing path is a one-line ``UserInputError``; a malformed
run.json or error file becomes a note, never an exception.
"""

import contextlib
import itertools
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from nbgpu.diagnose.lines import Stamp
from nbgpu.diagnose.scan import ExitRecord
from nbgpu.errors import UserInputError, user_path
from nbgpu.profile.records import read_node

__all__ = ["STALL_FILE", "ErrorRecord", "Inputs", "LogInput", "RunInfo", "chunks",
           "load_error_file", "load_run_json", "resolve"]  # fmt: skip

_CHUNK_BYTES = 1024 * 1024
_LOG_SUFFIXES = (".log", ".txt", ".out", ".err")
_MAX_FILES = 2000
_MAX_DEPTH = 4
_MAX_JSON_BYTES = 8 * 1024 * 1024
_RANK_LOG = re.compile(r"^rank[_-]?(\d+)\.(?:log|txt|out|err)$")
_ERROR_FILE = re.compile(r"^error(?:[_-]rank[_-]?(\d+))?\.json$")
# NCCL's flight-recorder dump on a watchdog timeout (TORCH_NCCL_DUMP_ON_TIMEOUT): the
# prefix TORCH_NCCL_DEBUG_INFO_TEMP_FILE names (default /tmp/nccl_trace_rank_) + the rank.
_FLIGHT_DUMP = re.compile(r"^nccl_trace_rank_(\d+)$")
STALL_FILE = "stall.json"  # what nbgpu's follow loop writes when it finds a stall
_ACCEPTED = "a log file, a run directory, '-' for stdin, a stream, or the log text itself"


@dataclass(frozen=True)
class LogInput:
    name: str  # shown in evidence: "rank1.log", "<text>", "<stdin>"
    path: Path | None = None
    default_rank: int | None = None  # rank of lines without a rank prefix
    data: bytes | None = None
    stream: IO[Any] | None = None
    offset: int = 0  # where in the file to start (a warm job: the last cell's start)


@dataclass(frozen=True)
class RunInfo:
    """The launcher's record of a run (``run.json``)."""

    path: Path
    name: str | None
    nproc: int | None
    nnodes: int | None
    gpus: tuple[int, ...] | None  # physical GPUs the run was given, in rank order
    cuda_visible_devices: str | None
    ranks: tuple[ExitRecord, ...]  # each rank's end as run.json has it (stamp: ended_at)
    agent_exit_code: int | None
    cell: int | None = None  # a warm job: the cell it was in (or had run last) when it ended
    cell_offsets: dict[int, int] = field(default_factory=dict)  # rank -> its log's size then
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> node, over several nodes
    python: str | None = None  # the interpreter the ranks ran (the launcher's own)

    @property
    def world_size(self) -> int | None:
        return None if self.nproc is None else self.nproc * (self.nnodes or 1)


@dataclass(frozen=True)
class ErrorRecord:
    """A torchelastic error file (written by ``torch.distributed.elastic...errors.record``)."""

    rank: int | None
    path: Path
    message: str
    callstack: str
    stamp: Stamp | None
    error_code: int | None


@dataclass
class Inputs:
    kind: str  # text | file | dir | run | stream
    label: str  # what the report calls the input
    logs: list[LogInput] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)
    run: RunInfo | None = None
    notes: list[str] = field(default_factory=list)
    flight: dict[int, Path] = field(default_factory=dict)  # rank -> flight-recorder dump
    stall: Path | None = None  # nbgpu's stall.json


def chunks(log: LogInput, size: int = _CHUNK_BYTES) -> Iterator[bytes | bytearray]:
    """The log's bytes in chunks (text streams encoded as UTF-8). A file's chunks share one
    buffer: use each before asking for the next."""
    if log.data is not None:
        for start in range(0, len(log.data), size):
            yield log.data[start : start + size]
        return
    if log.stream is not None:
        while piece := log.stream.read(size):
            yield piece.encode("utf-8", "surrogateescape") if isinstance(piece, str) else piece
        return
    if log.path is not None:
        # One reused buffer: a fresh megabyte per read costs page faults on every chunk.
        buffer = bytearray(size)
        view = memoryview(buffer)
        with log.path.open("rb") as handle:
            handle.seek(log.offset)
            while got := handle.readinto(buffer):
                yield buffer if got == size else bytes(view[:got])


def _epoch(value: object) -> Stamp | None:
    """A run.json / error-file time: epoch seconds (number or digits) or ISO text."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    with contextlib.suppress(ValueError):
        return Stamp("epoch", float(value))
    try:
        moment = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00").replace("_", "T"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return Stamp("epoch", moment.timestamp())


def _int(value: object) -> int | None:
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _gpus(value: object) -> tuple[int, ...] | None:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if parts and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def _load_json(
    path: Path, notes: list[str], unreadable: str, invalid: str, need: str = ""
) -> dict[str, Any] | None:
    """The JSON object in ``path`` (with a ``need`` key), else None and a note: ``unreadable``
    (``{}``: the error) or ``invalid``."""
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            notes.append(f"{path.name}: larger than 8 MiB, ignored")
            return None
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        notes.append(f"{path.name}: " + unreadable.format(exc.__class__.__name__))
        return None
    if isinstance(data, dict) and (not need or need in data):
        return data
    notes.append(f"{path.name}: {invalid}")
    return None


def load_run_json(path: Path, notes: list[str]) -> RunInfo | None:
    """Parse ``run.json``; anything malformed becomes a note."""
    data = _load_json(path, notes, "unreadable ({}), ignored", "expected a JSON object, ignored")
    if data is None:
        return None
    ranks = [
        ExitRecord(
            rank=rank,
            local_rank=_int(item.get("local_rank")),
            exit_code=_int(item.get("exit_code")),
            signal=(item.get("signal") or None) if isinstance(item.get("signal"), str) else None,
            stamp=_epoch(item.get("ended_at")),
            source=path.name,
            lineno=None,
        )
        for item in data.get("ranks") or []
        if isinstance(item, dict) and (rank := _int(item.get("rank"))) is not None
    ]
    cvd = data.get("cuda_visible_devices")
    name = data.get("name")
    warm = data["warm"] if isinstance(data.get("warm"), dict) else {}
    offsets = warm["log_offsets"] if isinstance(warm.get("log_offsets"), dict) else {}
    return RunInfo(
        path=path.parent,
        name=name if isinstance(name, str) else None,
        nproc=_int(data.get("nproc")),
        nnodes=_int(data.get("nnodes")),
        gpus=_gpus(data.get("gpus")),
        cuda_visible_devices=cvd if isinstance(cvd, str) else None,
        ranks=tuple(sorted(ranks, key=lambda r: r.rank or 0)),  # every one has a rank
        agent_exit_code=_int(data.get("agent_exit_code")),
        python=python if isinstance(python := data.get("python"), str) and python else None,
        cell=_int(warm.get("cell")),
        cell_offsets={
            rank: offset
            for key, value in offsets.items()
            if (rank := _int(key)) is not None and (offset := _int(value)) is not None
        },
    )


def load_error_file(path: Path, rank: int | None, notes: list[str]) -> ErrorRecord | None:
    """Parse a torchelastic error file (both the dict and the newer string ``message``)."""
    invalid = "no 'message' field; not a torchelastic error file"
    data = _load_json(path, notes, "not a readable error file ({})", invalid, need="message")
    if data is None:
        return None
    message = data["message"]
    callstack = ""
    stamp = _epoch(data.get("timestamp"))
    code = None
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        if isinstance(extra, dict):
            callstack = str(extra.get("py_callstack") or "")
            # nbgpu's ranks add a sub-second clock: whole seconds cannot order ranks
            # that fail within the same second (every rank of a bad init does).
            stamp = _epoch(extra.get("nbgpu_time")) or _epoch(extra.get("timestamp")) or stamp
        code = _int(message.get("errorCode"))
        text = str(message.get("message") or "")
    else:
        text = str(message)
    return ErrorRecord(rank, path, text, callstack, stamp, code)


def _looks_like_text(value: str) -> bool:
    if not value.strip() or "\n" in value or "\r" in value or len(value) > 4096 or "\x00" in value:
        return True  # "" would otherwise be Path(""), the current directory
    try:
        if user_path(value).exists():
            return False
    except OSError:  # a name too long for the file system is text
        return True
    # A single line: text if it reads like a message, a path if it reads like a path.
    if value.endswith((*_LOG_SUFFIXES, ".json")) or ("/" in value and " " not in value):
        return False
    return " " in value.strip() or ":" in value


def _rank_from_path(path: Path, root: Path) -> int | None:
    if (m := _RANK_LOG.match(path.name) or _ERROR_FILE.match(path.name)) and m.group(1):
        return int(m.group(1))
    # torchelastic --log-dir: <run_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log
    parent = path.parent
    if parent != root and parent.name.isdigit() and parent.parent.name.startswith("attempt_"):
        return int(parent.name)
    return None


def _walk(root: Path) -> Iterator[Path]:
    for directory, subdirs, files in os.walk(root):
        deep = len(Path(directory).relative_to(root).parts) >= _MAX_DEPTH
        subdirs[:] = [] if deep else sorted(d for d in subdirs if not d.startswith("."))
        yield from (Path(directory) / name for name in sorted(files) if not name.startswith("."))


def _directory(root: Path) -> Inputs:
    inputs = Inputs(kind="dir", label=str(root))
    run_json = root / "run.json"
    if run_json.is_file():
        inputs.run = load_run_json(run_json, inputs.notes)
        if inputs.run and inputs.run.name:
            inputs.label = f"run '{inputs.run.name}' ({root})"
    for path in itertools.islice(_walk(root), _MAX_FILES):
        if not path.is_file():
            continue
        rel = str(path.relative_to(root))
        rank = _rank_from_path(path, root)
        if m := _FLIGHT_DUMP.match(path.name):
            inputs.flight[int(m.group(1))] = path
        elif path.name == STALL_FILE and path.parent == root:
            inputs.stall = path
        elif _ERROR_FILE.match(path.name):
            if (record := load_error_file(path, rank, inputs.notes)) is not None:
                inputs.errors.append(record)
        elif path.name.endswith(_LOG_SUFFIXES):
            offset = 0
            if inputs.run is not None and rank is not None and _RANK_LOG.match(path.name):
                offset = inputs.run.cell_offsets.get(rank, 0)
            inputs.logs.append(LogInput(rel, path=path, default_rank=rank, offset=offset))
    if inputs.run is not None:
        for path in root.glob("rank*.node"):
            rank = _int(path.name[len("rank") : -len(".node")])
            if rank is not None and (node := read_node(root, rank)) is not None:
                inputs.run.nodes[rank] = node
        if inputs.run.cell_offsets:
            inputs.notes.append(
                f"a warm job: the rank logs are read from the start of cell {inputs.run.cell}, "
                "the cell it ended in (the earlier cells' output is above it in the same logs)"
            )
    if run_json.is_file() or any(_RANK_LOG.match(log.name) for log in inputs.logs):
        inputs.kind = "run"
    return inputs


def resolve(source: object, *, name: str | None = None) -> Inputs:
    """What to read for ``source``; raises ``UserInputError`` for a path that does not exist."""
    if isinstance(source, str) and source == "-":
        log = LogInput(name or "<stdin>", stream=getattr(sys.stdin, "buffer", sys.stdin))
        return Inputs(kind="stream", label="<stdin>", logs=[log])
    if isinstance(source, bytes | bytearray) or (
        isinstance(source, str) and _looks_like_text(source)
    ):
        data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else source
        label = name or "<text>"
        return Inputs(kind="text", label=label, logs=[LogInput(label, data=bytes(data))])
    if hasattr(source, "read") and not isinstance(source, str | os.PathLike):
        label = name or str(getattr(source, "name", "<stream>"))
        return Inputs(kind="stream", label=label, logs=[LogInput(label, stream=source)])  # type: ignore[arg-type]  # duck-typed stream
    # A run object: nbgpu's own Run (.dir), or anything with .run_dir / .directory.
    if not isinstance(source, str | os.PathLike):
        found = (getattr(source, attribute, None) for attribute in ("run_dir", "directory", "dir"))
        source = next((d for d in found if isinstance(d, str | os.PathLike)), source)
    if not isinstance(source, str | os.PathLike):
        raise UserInputError(f"cannot diagnose a {type(source).__name__}: expected {_ACCEPTED}")
    path = user_path(source)
    if not path.exists():
        raise UserInputError(
            f"{os.fspath(source)!r}: no such file or directory (expected {_ACCEPTED})"
        )
    if path.is_dir():
        return _directory(path)
    rank = _rank_from_path(path, path.parent)
    if _FLIGHT_DUMP.match(path.name):  # one rank's dump: read its siblings too
        dumps = ((_FLIGHT_DUMP.match(p.name), p) for p in path.parent.iterdir())
        flight = {int(m.group(1)): dump for m, dump in dumps if m}
        return Inputs(kind="file", label=str(path.parent), flight=flight)
    if _ERROR_FILE.match(path.name):
        inputs = Inputs(kind="file", label=str(path))
        if (record := load_error_file(path, rank, inputs.notes)) is not None:
            inputs.errors.append(record)
        return inputs
    log = LogInput(name or path.name, path=path, default_rank=rank)
    return Inputs(kind="file", label=str(path), logs=[log])
