"""Following a running job's memory records: a one-line node summary, a timeline.

:class:`MemoryFollower` reads only the bytes each ``mem-rank{N}.jsonl`` gained since
the last call (a partial last line waits for the next call). Standard library only.
"""

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbgpu.profile.recorder import node_memory
from nbgpu.profile.records import Base, host_value, read_node
from nbgpu.sizes import fmt_bytes

__all__ = ["MemoryFollower"]


def _of(used: int, total: int | None) -> str:
    # Each value in its own unit: 50 MiB of 23.5 GiB, never 0.0/23.5 GiB.
    return fmt_bytes(used) + (f" of {fmt_bytes(total)}" if total else "")


@dataclass
class RankLive:
    label: str
    offset: int = 0
    pending: bytes = b""
    last: dict[str, Any] = field(default_factory=dict)
    open: dict[int, str] = field(default_factory=dict)  # phase id -> name, in start order
    closed: bool = False
    points: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=3000))
    node: str | None = None  # over several nodes: where the rank runs (rank{R}.node)
    mem_total: int | None = None  # its node's MemTotal, from its first record
    host_bytes: int | None = None  # its host memory at the last reading (records.host_value)
    base: Base = None

    @property
    def phase(self) -> str | None:
        return list(self.open.values())[-1] if self.open else None


class MemoryFollower:
    """Incremental reader of a run directory's memory records."""

    def __init__(self, run_dir: Path, nproc: int, *, several_nodes: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.several_nodes = several_nodes  # ranks on other machines: sums per node
        self.ranks = {r: RankLive(f"rank{r}") for r in range(nproc)}
        self.mem_total = node_memory().total_bytes
        self._last_poll = 0.0

    def poll(self) -> None:
        for rank, live in self.ranks.items():
            path = self.run_dir / f"mem-rank{rank}.jsonl"
            try:
                with path.open("rb") as handle:
                    handle.seek(live.offset)
                    data = handle.read(8 << 20)
            except OSError:
                continue
            live.offset += len(data)
            *lines, live.pending = (live.pending + data).split(b"\n")
            for raw in lines:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self._take(live, record)

    def _take(self, live: RankLive, record: dict[str, Any]) -> None:
        kind = record.get("k")
        if kind == "proc" and isinstance(record.get("mem_total"), int):
            live.mem_total = record["mem_total"]
        if kind == "begin" and isinstance(record.get("id"), int):
            live.open[record["id"]] = str(record.get("phase"))
        elif kind == "end":
            live.open.pop(record.get("id", -1), None)
        elif kind == "close":
            live.closed = True
            return
        if "rss" in record:
            live.last = record
            live.host_bytes, live.base = host_value(record, live.base)
            if live.host_bytes is not None and isinstance(record.get("t"), int | float):
                live.points.append((float(record["t"]), live.host_bytes))

    def summary(self) -> str | None:
        """``mem: node 3.1 GiB of 23.5 GiB · max rank3: 900.0 MiB in 'imports' · available 18.0 GiB``;
        over several nodes each node's sum against its own memory (busiest first, at most 3)."""
        self.poll()
        alive = [r for r in self.ranks.values() if r.last and not r.closed]
        if not alive:
            return None
        if self.several_nodes:
            for rank, live in self.ranks.items():
                live.node = live.node if live.node is not None else read_node(self.run_dir, rank)
        by_node: dict[str | None, list[RankLive]] = {}
        for live in alive:
            by_node.setdefault(live.node if self.several_nodes else None, []).append(live)
        sums = [(sum(r.host_bytes or 0 for r in rs), name, rs) for name, rs in by_node.items()]
        sums.sort(key=lambda item: -item[0])
        top = max(alive, key=lambda r: r.host_bytes or 0)
        if len(sums) == 1:
            total, _name, ranks = sums[0]
            mem_total = self.mem_total if not self.several_nodes else ranks[0].mem_total
            line = f"mem: node {_of(total, mem_total)} (Σ PSS of {len(alive)} ranks)"
        else:
            each = [f"{name} {_of(total, ranks[0].mem_total)}" for total, name, ranks in sums[:3]]
            more = f" +{len(sums) - 3} nodes" if len(sums) > 3 else ""
            line = f"mem: {', '.join(each)}{more} (Σ PSS per node)"
        where = f" on {top.node}" if self.several_nodes and top.node else ""
        line += f" · max {top.label}{where}: {fmt_bytes(top.host_bytes or 0)}"
        if top.phase:
            line += f" in '{top.phase}'"
        if isinstance(avail := top.last.get("avail"), int):
            line += f" · available {fmt_bytes(avail)}"
        return line

    def due(self, every_s: float = 1.0) -> bool:
        """True at most once per *every_s* (the live line's and the widget's rate)."""
        now = time.monotonic()
        if now - self._last_poll < every_s:
            return False
        self._last_poll = now
        return True
