"""Blocks that the ranks of one node run one at a time (``--serial-imports``).

Eight ranks importing and compiling at once can exhaust host memory (``std::bad_alloc``);
a file lock in the run directory makes them take turns. ``filelock`` is imported only by
ranks that serialise.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from nbgpu.errors import UserInputError
from nbgpu.rank.job import RUN_DIR_ENV, _env, _in_job, _write, rank

__all__ = ["one_at_a_time"]

_LOCK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@contextlib.contextmanager
def one_at_a_time(
    name: str = "imports", environ: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Run the block in one rank of this node at a time (a file lock).

    Eight ranks importing and compiling at once can exhaust host memory
    (``std::bad_alloc``); taking turns bounds the peak to one rank's. The lock lives in
    ``NBGPU_RUN_DIR`` (else a private temporary directory keyed by
    ``TORCHELASTIC_RUN_ID``) and carries the host name, so ranks on other nodes do not
    wait even when the run directory is shared. ``[rank N] LOCK:`` lines on stderr say
    who waits, holds and releases.
    """
    from filelock import FileLock, Timeout  # noqa: PLC0415  (only ranks that serialise)

    if not _LOCK_NAME.fullmatch(name):
        raise UserInputError(
            f"lock name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    env = _env(environ)
    who = f"[rank {rank(env) if _in_job(env) else 0}]"
    # The node's name: SLURM's for ranks nbgpu started there (NBGPU_NODE), else the host's.
    node = env.get("NBGPU_NODE") or socket.gethostname()
    path = _lock_dir(env) / f"{name}.{node}.lock"
    lock = FileLock(str(path))
    asked = time.monotonic()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"{who} LOCK: waiting for {name!r} (another rank on this node holds it)")
        lock.acquire()
    acquired = time.monotonic()
    _say(f"{who} LOCK: acquired {name!r} after {acquired - asked:.1f} s")
    try:
        yield
    finally:
        # Said just before releasing, so that in the merged output of all ranks each
        # "released" comes before the next rank's "acquired".
        _say(f"{who} LOCK: released {name!r} after {time.monotonic() - acquired:.1f} s")
        lock.release()


def _say(line: str) -> None:
    _write(line + "\n", sys.stderr)


def _lock_dir(env: Mapping[str, str]) -> Path:
    run_dir = env.get(RUN_DIR_ENV, "").strip()
    if run_dir:
        return Path(run_dir)
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", env.get("TORCHELASTIC_RUN_ID", "") or "none")
    base = Path(tempfile.gettempdir()) / f"nbgpu-locks-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    info = base.lstat()
    # /tmp is shared: refuse a directory someone else made (or a symlink) for our locks.
    if not base.is_dir() or base.is_symlink() or info.st_uid != os.getuid():
        raise UserInputError(f"lock directory {base} is not a private directory of this user")
    directory = base / run_id
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory
