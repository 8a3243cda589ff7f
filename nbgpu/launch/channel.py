"""The kernel's end of the private channel that carries a warm job's cells to its ranks.

One Unix socket in a 0700 directory (the run directory, or a private ``mkdtemp`` when
that path is too long). A peer of another user (``SO_PEERCRED``) is hung up on before a
byte is read; then ``multiprocessing.connection`` proves both ends hold the job's token
(an HMAC challenge each way, no pickle before it) and frames pickled dicts. The ranks'
end is ``nbgpu.rank.usercode``. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import tempfile
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path
from typing import Any

__all__ = ["CELL_MARK", "CellServer"]

# A socket address holds 108 bytes on Linux (less elsewhere): keep a margin.
_MAX_SOCKET_PATH = 100
# A peer that connects must answer the challenge and introduce itself within this
# (our ranks do at once); a silent one is hung up on instead of blocking the kernel.
_HANDSHAKE_S = 2
# How long a rank may stall in the middle of one message before it counts as gone.
_MESSAGE_S = 60
#: How a rank's log marks where a warm cell begins: ``#### nbgpu cell 3 ####`` (the rank
#: prints the line the cell's message carries).
CELL_MARK = "#### nbgpu cell "


def _receive_timeout(sock: socket.socket, seconds: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))


class CellServer:
    """The kernel's end: accept the ranks, hear what they say, tell them all one thing."""

    def __init__(self, run_dir: Path, token: str) -> None:
        self.path = run_dir / "cells.sock"
        self._temp_dir: Path | None = None
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            self._temp_dir = Path(tempfile.mkdtemp(prefix="nbgpu-"))
            self.path = self._temp_dir / "cells.sock"
        self._authkey = token.encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)  # the socket file itself: this user only
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        self._listener.listen(64)
        self._listener.setblocking(False)  # noqa: FBT003  (socket API)
        self.ranks: dict[int, Connection] = {}
        self._pids: dict[int, int] = {}
        self.gone: set[int] = set()  # ranks whose connection closed
        self.closed = False

    def poll(self, timeout_s: float) -> list[tuple[int, dict[str, Any]]]:
        """``(rank, message)`` pairs that arrived within *timeout_s* (returns on the first)."""
        if self.closed:
            return []
        live = {conn: rank for rank, conn in self.ranks.items() if rank not in self.gone}
        try:
            ready = wait([self._listener, *live], timeout=max(timeout_s, 0.0))
        except InterruptedError:
            return []
        out: list[tuple[int, dict[str, Any]]] = []
        for item in ready:
            if item is self._listener:
                self._accept()
            elif isinstance(item, Connection):
                self._read(live[item], item, out)
        return out

    def _read(self, rank: int, conn: Connection, out: list[tuple[int, dict[str, Any]]]) -> None:
        """Every whole message *rank* has sent so far (at least one: it was readable)."""
        try:
            out.append((rank, conn.recv()))
            while conn.poll():
                out.append((rank, conn.recv()))
        except (EOFError, OSError):
            self.gone.add(rank)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            sock.close()  # not this user's process: never read a byte from it
            return
        sock.setblocking(True)  # noqa: FBT003  (socket API)
        _receive_timeout(sock, _HANDSHAKE_S)
        conn = Connection(sock.detach())
        try:  # the peer's hello, once both ends proved they hold the token
            deliver_challenge(conn, self._authkey)  # it proves it has the token...
            answer_challenge(conn, self._authkey)  # ...and so do we
            hello = conn.recv()
        except (AuthenticationError, EOFError, OSError):
            hello = None
        rank = hello.get("rank") if isinstance(hello, dict) else None
        if not isinstance(hello, dict) or hello.get("op") != "hello" or not isinstance(rank, int):
            conn.close()  # not one of our ranks (or not in time): hung up on
            return
        with socket.socket(fileno=os.dup(conn.fileno())) as same:
            _receive_timeout(same, _MESSAGE_S)
        self.ranks[rank] = conn
        self._pids[rank] = int(hello.get("pid") or 0)

    def pids(self) -> dict[int, int]:
        """Each introduced rank's pid, as it said in its hello."""
        return dict(self._pids)

    def send(self, ranks: list[int], message: dict[str, Any]) -> None:
        """Send one message to each of *ranks* that is connected (a failure: it is gone)."""
        for rank in ranks:
            conn = self.ranks.get(rank)
            if conn is not None and rank not in self.gone:
                try:
                    conn.send(message)  # a large push waits for the rank to take it
                except OSError:
                    self.gone.add(rank)

    def close(self) -> None:
        self.closed = True
        for conn in self.ranks.values():
            with contextlib.suppress(OSError):
                conn.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
