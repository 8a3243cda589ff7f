"""A rank's place in its job, read from torchrun's environment: rank, sizes, rank 0.

Every function reads ``environ`` (default ``os.environ``), so tests pass a dict.
``is_main()`` and ``print0()`` treat a process outside any job as the single rank 0; the
other queries raise a one-line ``UserInputError`` there. Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TextIO

from nbgpu.errors import UserInputError

__all__ = [
    "NOT_IN_JOB",
    "RUN_DIR_ENV",
    "is_main",
    "local_rank",
    "local_world_size",
    "print0",
    "rank",
    "world_size",
]

#: The one line every job query raises outside a distributed job.
NOT_IN_JOB = "not inside a distributed job: RANK is unset (launch with %%torchrun N or torchrun)"
#: Set by the launcher: the run directory (per-rank logs, locks, results).
RUN_DIR_ENV = "NBGPU_RUN_DIR"


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _in_job(env: Mapping[str, str]) -> bool:
    return bool(env.get("RANK", "").strip())


def _job_int(env: Mapping[str, str], key: str) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        if key == "RANK" or not _in_job(env):
            raise UserInputError(NOT_IN_JOB)
        raise UserInputError(
            f"not inside a torchrun job: RANK is set but {key} is unset (launch with "
            "%%torchrun N or torchrun, which set both)"
        )
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UserInputError(f"{key}={raw!r} is not a whole number >= 0 as torchrun sets it")
    return value


def rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank (``RANK``), 0 .. world_size-1."""
    return _job_int(_env(environ), "RANK")


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``): the ``cuda:N`` it should use."""
    env = _env(environ)
    _job_int(env, "RANK")  # outside a job, say so in the words of RANK
    return _job_int(env, "LOCAL_RANK")


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks in the job (``WORLD_SIZE``)."""
    env = _env(environ)
    _job_int(env, "RANK")
    return _job_int(env, "WORLD_SIZE")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks on this node (``LOCAL_WORLD_SIZE``)."""
    env = _env(environ)
    _job_int(env, "RANK")
    return _job_int(env, "LOCAL_WORLD_SIZE")


def is_main(environ: Mapping[str, str] | None = None) -> bool:
    """True on global rank 0, and in a process outside any job (RANK unset).

    A single process is the whole job, so code guarded by ``is_main()`` runs the same in
    the notebook kernel and on rank 0 of ``%%torchrun``.
    """
    env = _env(environ)
    return not _in_job(env) or _job_int(env, "RANK") == 0


def print0(
    *values: object,
    sep: str | None = " ",
    end: str | None = "\n",
    file: TextIO | None = None,
    flush: bool = False,
    environ: Mapping[str, str] | None = None,
) -> None:
    """``print`` on global rank 0 only (and in a single process, like ``is_main``)."""
    if is_main(environ):
        text = (" " if sep is None else sep).join(map(str, values))
        _write(text + ("\n" if end is None else end), file or sys.stdout, flush=flush)


def _write(text: str, stream: TextIO, *, flush: bool = True) -> None:
    # One write per line: print() writes the text and its end separately, and ranks that
    # share a pipe (bare torchrun) would splice each other's lines in between.
    stream.write(text)
    if flush:
        stream.flush()
