"""A stalled job explained: where each rank is stuck, and the stall as a diagnosis.

PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE``) keeps each rank's last collectives:
process group, sequence number, op, tensor sizes, completed or not. The oldest collective
still pending anywhere is the one the job waits in; a rank whose record stops before it never
entered it, one whose record holds another op or sizes at that number entered a different
one. The stacks (faulthandler's dump, as ``%gpu_stacks`` takes it) say where those ranks are.

A stalled job's logs say only how it ended (NCCL's watchdog timeout, on every rank alike);
the stall's record names the rank: nbgpu's ``stall.json``, or the ``nccl_trace_rank_N``
files NCCL dumps on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``). It becomes the root cause,
ahead of the timeouts it explains.
"""

import io
import json
import os
import pickle
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nbgpu._render import span
from nbgpu._serial import read_json_object
from nbgpu.diagnose.catalog import STALLED, cause
from nbgpu.diagnose.report import Evidence, FoundCause
from nbgpu.diagnose.sources import Inputs

__all__ = ["Collective", "Frame", "RankPlace", "Stall", "find_stall", "parse_stacks", "read_trace",
           "stall_cause", "with_stall"]  # fmt: skip

# Frames from these places are machinery, not where the user's code is: installed packages
# (any interpreter's), the standard library, frozen modules, and nbgpu's own rank code. A
# path match, not a "/nbgpu/" anywhere: run directories live under ~/.cache/nbgpu/.
_LIBRARY = re.compile(r"[/\\](?:site-packages|dist-packages)[/\\]|^<")
_OWN = (
    str(Path(__file__).resolve().parents[1]) + os.sep,
    *{sysconfig.get_path(name) + os.sep for name in ("stdlib", "platstdlib")},
)
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: what a rank entered, and whether it came out."""

    group: str
    seq: int
    op: str
    sizes: tuple[tuple[int, ...], ...]
    done: bool
    created_ns: int

    @property
    def signature(self) -> tuple[str, tuple[tuple[int, ...], ...]]:
        return (self.op, self.sizes)

    def words(self) -> str:
        sizes = ", ".join("x".join(map(str, s)) or "scalar" for s in self.sizes)
        return f"{self.op} #{self.seq}" + (f" [{sizes}]" if sizes else "")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def library(self) -> bool:
        return bool(_LIBRARY.search(self.file)) or self.file.startswith(_OWN)

    def words(self) -> str:
        return f"{Path(self.file).name}:{self.line} {self.function}()"


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's main thread is (innermost frame first) and what that line says."""

    frames: tuple[Frame, ...]
    worker: tuple[Frame, ...] = ()  # a data-loader worker's stack, when the rank waits on one

    def words(self, source: dict[str, list[str]] | None = None) -> str:
        """``train.py:88 load_batch(): time.sleep(600)`` in its own code; in a library it
        called, ``train.py:90 step() → torch.distributed.distributed_c10d.barrier`` (that
        package's innermost frame: the call made, not the selector or lock it ended in)."""
        at = next((i for i, f in enumerate(self.frames) if not f.library), None)
        if at is None:
            return self.frames[0].words() if self.frames else "no Python stack"
        user = self.frames[at]
        out = user.words()
        if at == 0:
            said = _source_line(user, source)
            out += f": {said}" if said else ""
        else:
            package = _module_of(self.frames[at - 1].file).split(".")[0]
            inner = next(f for f in self.frames if _module_of(f.file).split(".")[0] == package)
            out += f" → {_module_of(inner.file)}.{inner.function}"
        if self.worker:
            wuser = next((f for f in self.worker if not f.library), self.worker[0])
            line = _source_line(wuser, source)
            out += f"; its DataLoader worker is in {wuser.words()}" + (f": {line}" if line else "")
        return out


@dataclass
class Stall:
    """The collective a job waits in, who waits, who never came, who came to another."""

    collective: Collective
    waiting: list[int]
    absent: dict[int, int] = field(default_factory=dict)  # rank -> last sequence it entered
    different: dict[int, Collective] = field(default_factory=dict)
    unanswered: list[int] = field(default_factory=list)  # ranks that gave no record
    places: dict[int, RankPlace] = field(default_factory=dict)
    waited_s: float | None = 0.0  # None: not known (a dump has no clock)

    @property
    def culprits(self) -> list[int]:
        return sorted({*self.absent, *self.different, *self.unanswered})

    def lines(self, source: dict[str, list[str]] | None = None) -> list[str]:
        waited = "" if self.waited_s is None else f" {span(self.waited_s)}"
        head = f"stalled{waited} in {self.collective.words()}"
        if self.waiting:
            who = "rank" if len(self.waiting) == 1 else "ranks"
            head += f" ({who} {','.join(map(str, self.waiting))} waiting)"
        out = [head]
        for rank in self.culprits:
            where = self.places.get(rank)
            at = f": it is in {where.words(source)}" if where else ""
            if rank in self.unanswered:
                said = f"rank {rank} gave no flight record (stopped, or native code holds it)"
            elif rank in self.absent:
                said = f"rank {rank} never entered it"
            else:
                said = f"rank {rank} entered {self.different[rank].words()} instead"
            out.append(said + at)
        if not self.culprits and len(self.waiting) > 1:
            out.append(
                "every rank entered it: the transport is stuck (a peer's network or device), "
                "not the code"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        c = self.collective
        return {
            "op": c.op,
            "seq": c.seq,
            "group": c.group,
            "sizes": [list(s) for s in c.sizes],
            "waited_s": None if self.waited_s is None else round(self.waited_s, 1),
            "waiting": self.waiting,
            "never_entered": {str(r): s for r, s in sorted(self.absent.items())},
            "no_record": self.unanswered,
            "entered_other": {
                str(r): {"op": o.op, "seq": o.seq, "sizes": [list(s) for s in o.sizes]}
                for r, o in sorted(self.different.items())
            },
            "where": {
                str(r): [f"{f.file}:{f.line} {f.function}" for f in p.frames[:8]]
                for r, p in sorted(self.places.items())
            },
        }


def _module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    if "site-packages" in parts:
        return ".".join(parts[parts.index("site-packages") + 1 :])
    return parts[-1] if parts else ""


def _source_line(frame: Frame, source: dict[str, list[str]] | None) -> str:
    lines = (source or {}).get(frame.file)
    if lines is None:
        try:
            lines = Path(frame.file).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        if source is not None:
            source[frame.file] = lines
    return lines[frame.line - 1].strip() if 0 < frame.line <= len(lines) else ""


class _PlainData(pickle.Unpickler):
    """A flight-recorder pickle holds only dicts, lists, strings and numbers: refuse any
    class, so a dump found on disk can never run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not flight-recorder data")


def read_trace(data: bytes) -> dict[str, Any]:
    """A flight-recorder dump, JSON (``_dump_fr_trace_json``, nbgpu's records) or pickle
    (NCCL's dump on timeout), as a dict; ValueError for anything else."""
    text = data[:1] in (b"{", b"[")
    try:
        found = json.loads(data) if text else _PlainData(io.BytesIO(data)).load()
    except Exception as exc:  # a truncated or foreign file: pickle raises many kinds
        raise ValueError(f"not a flight-recorder dump ({type(exc).__name__})") from exc
    if not isinstance(found, dict):
        raise ValueError("not a flight-recorder dump (no table at the top)")  # noqa: TRY004
    return found


def collectives(trace: dict[str, Any]) -> list[Collective]:
    return [
        Collective(
            group=str((e.get("process_group") or ["0"])[0]),
            seq=int(e.get("collective_seq_id", 0)),
            op=str(e.get("profiling_name", "?")).split(":", 1)[-1],
            sizes=tuple(tuple(int(n) for n in s) for s in e.get("input_sizes") or []),
            done=bool(e.get("retired")) or e.get("state") == "completed",
            created_ns=int(e.get("time_created_ns", 0)),
        )
        for e in trace.get("entries") or []
        if not e.get("is_p2p")
    ]


def parse_stacks(text: str) -> list[tuple[Frame, ...]]:
    """faulthandler's dump, one stack per thread (innermost frame first); the thread that
    took the signal (the main thread, where the user's code runs) first."""
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        if m := _THREAD.match(line):
            threads.append((m.group(1) == "Current thread", []))
        elif (m := _FRAME.match(line)) and threads:
            threads[-1][1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    threads.sort(key=lambda t: not t[0])
    return [tuple(frames) for _, frames in threads if frames]


def main_thread(stacks: list[tuple[Frame, ...]]) -> tuple[Frame, ...]:
    """The stack whose outermost frame is not a thread's bootstrap."""
    for frames in stacks:
        if frames and frames[-1].function not in ("_bootstrap", "_bootstrap_inner"):
            return frames
    return stacks[0] if stacks else ()


def find_stall(
    traces: dict[int, dict[str, Any]], *, now_ns: int, world: list[int] | None = None
) -> Stall | None:
    """The oldest pending collective across ranks (their records by rank), and who is not
    in it; None when no rank waits in a collective (the job computes, or waits on something
    else). *world*: every rank of the job, to name those that gave no record."""
    by_rank = {rank: collectives(t) for rank, t in traces.items()}
    pending = [c for cs in by_rank.values() for c in cs if not c.done]
    if not pending:
        return None
    oldest = min(pending, key=lambda c: (c.created_ns, c.seq))
    group, seq = oldest.group, oldest.seq
    at: dict[int, Collective] = {}
    last: dict[int, int] = {}
    for rank, cs in sorted(by_rank.items()):  # a tie between two ops: the lowest rank's leads
        mine = [c for c in cs if c.group == group]
        if group != "0" and not mine:
            continue  # not a member of that sub-group
        last[rank] = max((c.seq for c in mine), default=0)
        if (found := next((c for c in mine if c.seq == seq), None)) is not None:
            at[rank] = found
    usual = Counter(at[r].signature for r in sorted(at) if not at[r].done).most_common(1)[0][0]
    # Every rank is in the default group; a sub-group's members are those that recorded it.
    unanswered = sorted(set(world or []) - set(by_rank)) if group == "0" else []
    waiting = [r for r in sorted(at) if at[r].signature == usual and not at[r].done]
    return Stall(
        collective=next(at[r] for r in waiting),
        waiting=waiting,
        absent={r: entered for r, entered in sorted(last.items()) if r not in at},
        unanswered=unanswered,
        different={r: at[r] for r in sorted(at) if at[r].signature != usual},
        waited_s=max(0.0, (now_ns - oldest.created_ns) / 1e9),
    )


# -- the stall as a diagnosis ------------------------------------------------------------


def _recorded(inputs: Inputs) -> tuple[list[str], dict[str, Any]] | None:
    """What nbgpu said when it found the stall, and its record."""
    if inputs.stall is None:
        return None
    data = read_json_object(inputs.stall)
    if isinstance(data.get("lines"), list):
        return [str(line) for line in data["lines"]], data
    return None


def _from_dumps(inputs: Inputs) -> tuple[list[str], dict[str, Any]] | None:
    traces: dict[int, dict[str, Any]] = {}
    for rank, path in sorted(inputs.flight.items()):
        try:
            traces[rank] = read_trace(path.read_bytes())
        except (OSError, ValueError) as exc:  # noqa: PERF203  (one file per rank, once)
            inputs.notes.append(f"{path.name}: not read as a flight record ({exc})")
    stall = find_stall(traces, now_ns=0)
    if stall is None:
        return None
    stall.waited_s = None  # a dump has no clock: how long it waited is not in it
    return stall.lines(), stall.to_dict()


def stall_cause(inputs: Inputs) -> FoundCause | None:
    """The stall the inputs record, as a found cause (its lines are the evidence)."""
    source = inputs.stall.name if inputs.stall is not None else ""
    if (found := _recorded(inputs)) is None:
        found, source = _from_dumps(inputs), "flight recorder"
    if found is None:
        return None
    lines, data = found
    culprits = sorted(
        int(r) for key in ("never_entered", "entered_other") for r in data.get(key) or {}
    )
    return STALLED.found(
        "root",
        0.9,
        ranks=tuple(culprits),
        first_rank=culprits[0] if culprits else None,
        evidence=tuple(Evidence(source, None, line) for line in lines),
    )


def with_stall(causes: tuple[FoundCause, ...], stall: FoundCause) -> tuple[FoundCause, ...]:
    """The stall as the root; a root found in the logs stays the root when it is a primary
    failure (a crash explains a stall), and becomes its consequence when it is what the
    stall looks like from outside (a timeout, an NCCL error)."""
    root = next((c for c in causes if c.root), None)
    if root is not None and not cause(root.cause).secondary:
        return (*causes, replace(stall, role="also"))
    demoted = tuple(replace(c, role="consequence") if c.root else c for c in causes)
    return (stall, *demoted)
