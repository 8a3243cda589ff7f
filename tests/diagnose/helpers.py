"""Shared helpers for the diagnose tests: corpus files and run directories."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).parent / "corpus"
HELDOUT = CORPUS / "heldout"
_SOURCE = re.compile(r"^# source: (\S+)")
_EXPECT_RANK = re.compile(r"^# expect-rank: (\d+)")

__all__ = ["CORPUS", "HELDOUT", "CorpusLog", "corpus_logs", "write_run"]


class CorpusLog:
    """One fixture log: its expected cause (the directory), source URL and text."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cause = path.parent.name
        lines = path.read_text(encoding="utf-8").splitlines()
        self.source = ""
        self.expect_rank: int | None = None
        body = []
        for line in lines:
            m, r = _SOURCE.match(line), _EXPECT_RANK.match(line)
            if m:
                self.source = m.group(1)
            if r:
                self.expect_rank = int(r.group(1))
            # Header lines become blank lines: line numbers stay those of the file.
            body.append("" if (m or r) else line)
        self.text = "\n".join(body) + "\n"

    @property
    def id(self) -> str:
        return f"{self.cause}/{self.path.name}"

    @property
    def project(self) -> str:
        parts = self.source.split("/")
        return (
            "/".join(parts[3:5]) if self.source.startswith("https://github.com/") else self.source
        )


def corpus_logs(root: Path = CORPUS) -> Iterator[CorpusLog]:
    for path in sorted(root.glob("*/*.log")):
        if root == CORPUS and path.parent.parent != CORPUS:
            continue
        yield CorpusLog(path)


def write_run(
    directory: Path,
    *,
    ranks: Sequence[Mapping[str, Any]],
    logs: Mapping[int, str],
    nproc: int | None = None,
    gpus: str | None = None,
    cuda_visible_devices: str | None = None,
    errors: Mapping[int, Any] | None = None,
    agent: str | None = None,
    agent_exit_code: int = 1,
) -> Path:
    """A run directory in the launcher's layout (run.json, rank logs, error files)."""
    directory.mkdir(parents=True, exist_ok=True)
    run = {
        "name": directory.name,
        "nproc": nproc if nproc is not None else len(ranks),
        "nnodes": 1,
        "gpus": gpus,
        "cuda_visible_devices": cuda_visible_devices,
        "master_port": 29611,
        "started_at": 1700000000.0,
        "ended_at": 1700000100.0,
        "ranks": list(ranks),
        "agent_exit_code": agent_exit_code,
    }
    (directory / "run.json").write_text(json.dumps(run))
    for rank, text in logs.items():
        (directory / f"rank{rank}.log").write_bytes(text.encode())
    for rank, data in (errors or {}).items():
        (directory / f"error-rank{rank}.json").write_text(json.dumps(data))
    if agent is not None:
        (directory / "agent.log").write_text(agent)
    return directory
