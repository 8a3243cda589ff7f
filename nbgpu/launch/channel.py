"""The kernel's end of the private channel that carries a warm job's cells to its ranks.

One Unix socket, created by the kernel in its own 0700 directory (the run directory,
or a private ``mkdtemp`` when that path is too long for a socket address); each rank
connects once and says hello with the run's secret token. The kernel also checks the
peer's user id (``SO_PEERCRED``): only the user's own processes get in, nothing listens
on a network interface, and the pickles below never cross anything else.

A message is a pickled dict behind an 8-byte length. The ranks' end is
``nbgpu.rank.usercode`` (``serve``). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["CELL_MARK", "CellServer", "socket_path"]

_HEADER = struct.Struct("!Q")
# A socket address holds 108 bytes on Linux (less elsewhere): keep a margin.
_MAX_SOCKET_PATH = 100
_MAX_HELLO = 4096
#: How a rank's log marks where a warm cell begins: ``#### nbgpu cell 3 ####`` (the rank
#: prints the line the cell's message carries).
CELL_MARK = "#### nbgpu cell "


def socket_path(run_dir: Path) -> Path:
    """Where the job's socket lives: in its run directory when the address fits."""
    inside = run_dir / "cells.sock"
    if len(os.fsencode(inside)) <= _MAX_SOCKET_PATH:
        return inside
    # mkdtemp makes the directory 0700 for this user, like the run directory.
    return Path(tempfile.mkdtemp(prefix="nbgpu-")) / "cells.sock"


def _hello(body: bytes) -> dict[str, Any]:
    try:
        hello = json.loads(body)
    except ValueError:
        return {}
    return hello if isinstance(hello, dict) else {}


class _Peer:
    """One rank's connection and the bytes of its next message, read as they come."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.rank: int | None = None  # known once it has said hello
        self.pid = 0

    def messages(self) -> tuple[list[dict[str, Any]], bool]:
        """Complete messages now readable, and whether the rank has hung up."""
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return [], False
        except OSError:
            return [], True
        self.buffer += data
        return self.frames(), not data

    def frames(self) -> list[dict[str, Any]]:
        """The whole messages in the buffer; before the hello, only the hello (as JSON)."""
        out = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if self.rank is None and size > _MAX_HELLO:
                return [{}]  # not one of our ranks: an empty hello gets it hung up on
            if len(self.buffer) < _HEADER.size + size:
                break
            body = bytes(self.buffer[_HEADER.size : _HEADER.size + size])
            del self.buffer[: _HEADER.size + size]
            if self.rank is None:
                return [_hello(body)]  # what follows waits for the token check
            out.append(pickle.loads(body))  # noqa: S301  (a rank that showed the token)
        return out


class CellServer:
    """The kernel's end: accept the ranks, hear what they say, tell them all one thing."""

    def __init__(self, run_dir: Path, token: str) -> None:
        self.path = socket_path(run_dir)
        self._token = token
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)  # the socket file itself: this user only
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        self._listener.listen(64)
        self._listener.setblocking(False)  # noqa: FBT003  (socket API)
        self._pending: list[_Peer] = []  # connected, not yet introduced
        self.ranks: dict[int, _Peer] = {}
        self.gone: set[int] = set()  # ranks whose connection closed
        self.closed = False

    def poll(self, timeout_s: float) -> list[tuple[int, dict[str, Any]]]:
        """``(rank, message)`` pairs that arrived within *timeout_s* (returns on the first)."""
        if self.closed:
            return []
        watched = [self._listener, *(p.sock for p in self._pending), *(
            p.sock for r, p in self.ranks.items() if r not in self.gone)]  # fmt: skip
        try:
            ready, _, _ = select.select(watched, [], [], max(timeout_s, 0.0))
        except InterruptedError:
            return []
        out: list[tuple[int, dict[str, Any]]] = []
        for sock in ready:
            if sock is self._listener:
                self._accept()
                continue
            peer = self._peer(sock)
            if peer is None:
                continue
            messages, closed = peer.messages()
            if peer.rank is None:
                if not self._introduce(peer, messages, closed):
                    continue
                messages = peer.frames()  # anything it sent right after its hello
            rank = peer.rank
            if rank is None:
                continue
            out.extend((rank, m) for m in messages)
            if closed:
                self.gone.add(rank)
        return out

    def _peer(self, sock: socket.socket) -> _Peer | None:
        for peer in (*self._pending, *self.ranks.values()):
            if peer.sock is sock:
                return peer
        return None

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            sock, _ = self._listener.accept()
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                sock.close()  # not this user's process: never read a byte from it
                return
            sock.setblocking(False)  # noqa: FBT003  (socket API)
            self._pending.append(_Peer(sock))

    def _introduce(self, peer: _Peer, messages: list[dict[str, Any]], closed: bool) -> bool:
        """Whether *peer* is now a known rank (a wrong hello is hung up on)."""
        hello = messages[0] if messages else None
        if hello is None and not closed:
            return False  # the hello has not arrived whole yet
        self._pending.remove(peer)
        rank = hello.get("rank") if hello else None
        if (
            hello is None
            or hello.get("op") != "hello"
            or hello.get("token") != self._token
            or not isinstance(rank, int)
        ):
            peer.sock.close()
            return False
        peer.rank = rank
        peer.pid = int(hello.get("pid") or 0)
        self.ranks[rank] = peer
        return True

    def pids(self) -> dict[int, int]:
        """Each introduced rank's pid, as it said in its hello."""
        return {rank: peer.pid for rank, peer in self.ranks.items()}

    def send(self, ranks: list[int], message: dict[str, Any]) -> list[int]:
        """Send one message to *ranks*; the ranks it could not reach."""
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(body)) + body
        unreachable = []
        for rank in ranks:
            peer = self.ranks.get(rank)
            if peer is None or rank in self.gone:
                unreachable.append(rank)
                continue
            try:
                peer.sock.setblocking(True)  # noqa: FBT003  (a large push waits for the rank)
                peer.sock.sendall(frame)
            except OSError:
                self.gone.add(rank)
                unreachable.append(rank)
            finally:
                with contextlib.suppress(OSError):
                    peer.sock.setblocking(False)  # noqa: FBT003  (socket API)
        return unreachable

    def close(self) -> None:
        self.closed = True
        for peer in (*self._pending, *self.ranks.values()):
            with contextlib.suppress(OSError):
                peer.sock.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self.path.parent.name.startswith("nbgpu-") and self.path.parent.parent == Path(
            tempfile.gettempdir()
        ):
            shutil.rmtree(self.path.parent, ignore_errors=True)
