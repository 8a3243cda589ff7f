"""A warm job's cell channel. On one node: the ranks' Unix socket (:class:`CellServer`, the
ranks' end is ``nbgpu.rank.usercode``) in a 0700 directory, the run directory's; each rank
and the kernel prove they hold the job's token (``multiprocessing``'s HMAC challenge, each
way) before anything is unpickled. Across nodes: the kernel's end (:class:`NodeChannel`) and
each node's relay (``python -m nbgpu.launch.relay RUN_DIR NODE NAME NPROC``, started by the
node's ``nbgpu.rank.slurm_node`` before it becomes the agent). Standard library only.

Across nodes the ranks' socket stays inside each node: the relay holds one in a 0700
directory under the node's own tmp, names it to its ranks (``NBGPU_CELLS``) and removes it
once they are all in. Between the relay and the kernel, one TCP connection per node carries
what each side says, in envelopes tagged with ranks; the messages inside are forwarded as
they are, so any op the kernel and the ranks exchange works across nodes unchanged:

- node to kernel: ``("joined", rank, pid)``, ``("said", rank, message)``, ``("gone", rank, None)``
- kernel to node: ``("send", ranks, message)``, ``("interrupt", ranks, None)`` (SIGINT there)

The kernel listens only while the nodes join: once the first node published the rendezvous
(``rdzv.json``), on its own address on the route to that node, port 0 (``relay.json``). It
takes one connection per node, each proving the job's token and then naming its node;
anything else is hung up on, and the listener closes once every node is in. A relay whose
kernel connection closes (the job ended, or the kernel died) exits, which closes its ranks'
connections: they leave their loop, and the node's agent, then ``srun``, end.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from nbgpu._children import die_with_parent, sigint_held

__all__ = ["CELLS_ENV", "RELAY_FILE", "CellServer", "NodeChannel", "main", "token_hello"]

#: The ranks' socket on their node, which a rank prefers over ``bootstrap.json``'s channel.
CELLS_ENV = "NBGPU_CELLS"
RELAY_FILE = "relay.json"  # where the kernel listens for the nodes: {"host", "port"}
_WAIT_FOR_KERNEL_S = 120.0  # a relay waits this long for relay.json


_MAX_SOCKET_PATH = 100  # a socket address holds 108 bytes on Linux (less elsewhere)
# A peer (a rank, or a node's relay) must answer the challenge and introduce itself within
# this (ours do at once); a silent one is hung up on instead of holding up the kernel.
_HANDSHAKE_S = 2
_MESSAGE_S = 60  # a peer stalled this long in the middle of one message is gone


def token_hello(conn: Connection, authkey: bytes) -> dict[str, Any] | None:
    """The peer's hello, once both ends proved they hold the job's token (an HMAC challenge
    each way, before anything is unpickled); None for anything else or nothing in time."""
    try:
        deliver_challenge(conn, authkey)  # it proves it holds the token...
        answer_challenge(conn, authkey)  # ...and so do we
        hello = conn.recv()
    except (AuthenticationError, EOFError, OSError):
        return None
    return hello if isinstance(hello, dict) else None


class _KernelEnd:
    """What both kernel ends share: :meth:`poll`, which hands over every message it read.
    The stop button (a KeyboardInterrupt) may come while it waits, or once it has read
    whole messages (``sigint_held``): those are kept for the next poll, so an interrupt
    loses no rank's answer."""

    closed = False
    _kept: list[tuple[int, dict[str, Any]]]

    def _waitables(self) -> dict[Any, int]:
        """What to wait on: each connection with its key for :meth:`_take`, the listener."""
        raise NotImplementedError

    def _take(self, key: int, conn: Connection, out: list[tuple[int, dict[str, Any]]]) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        raise NotImplementedError

    def poll(self, timeout_s: float) -> list[tuple[int, dict[str, Any]]]:
        """``(rank, message)`` pairs that arrived within *timeout_s* (returns on the first)."""
        if self.closed:
            return []
        out, self._kept = self._kept, []
        try:
            waitables = self._waitables()
            ready = wait(list(waitables), timeout=0 if out else max(timeout_s, 0.0))
            with sigint_held():
                for item in ready:
                    if isinstance(item, Connection):  # every whole message so far (one at least)
                        self._take(waitables[item], item, out)
                    else:
                        self._accept()
        except KeyboardInterrupt:
            self._kept = out
            raise
        return out


class CellServer(_KernelEnd):
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
        self.pids: dict[int, int] = {}  # each introduced rank's, as its hello said
        self.gone: set[int] = set()  # ranks whose connection closed
        self.closed = False
        self._kept = []

    def _waitables(self) -> dict[Any, int]:
        live = {conn: rank for rank, conn in self.ranks.items() if rank not in self.gone}
        return {self._listener: -1, **live}

    def _take(self, rank: int, conn: Connection, out: list[tuple[int, dict[str, Any]]]) -> None:
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
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", _HANDSHAKE_S, 0))
        conn = Connection(sock.detach())
        hello = token_hello(conn, self._authkey)
        rank = None if hello is None else hello.get("rank")
        if hello is None or hello.get("op") != "hello" or not isinstance(rank, int):
            conn.close()  # not one of our ranks (or not in time): hung up on
            return
        with socket.socket(fileno=os.dup(conn.fileno())) as same:
            same.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", _MESSAGE_S, 0))
        self.ranks[rank] = conn
        self.pids[rank] = int(hello.get("pid") or 0)

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to *ranks* (their user code gets KeyboardInterrupt; the rank stays)."""
        for pid in filter(None, map(self.pids.get, ranks)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGINT)

    def send(self, ranks: list[int], message: dict[str, Any]) -> None:
        """Send one message to each of *ranks* that is connected (a failure: it is gone)."""
        for rank in ranks:
            conn = self.ranks.get(rank)
            if conn is not None and rank not in self.gone:
                try:
                    with sigint_held():  # a large push waits for the rank to take it
                        conn.send(message)
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


def _address_towards(host: str) -> str:
    """This machine's address on the route to *host* (what the nodes reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: picks the route, sends nothing
        return str(probe.getsockname()[0])


def _set_option(conn: Connection, level: int, option: int, value: int | bytes) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as same:
        same.setsockopt(level, option, value)


def _receive_timeout(conn: Connection, seconds: int) -> None:
    _set_option(conn, socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))


def _no_delay(conn: Connection) -> None:
    # Small messages both ways, often two in a row ("started", then "done"): without it
    # Nagle's algorithm holds the second one until the first is acknowledged (up to 40 ms).
    _set_option(conn, socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class NodeChannel(_KernelEnd):
    """The kernel's end across nodes, with ``CellServer``'s interface (``poll``, ``send``,
    ``interrupt``, ``ranks``, ``pids``, ``gone``, ``closed``, ``close``)."""

    def __init__(self, run_dir: Path, token: str, nnodes: int) -> None:
        self.run_dir = run_dir
        self.nnodes = nnodes
        self._authkey = token.encode()
        self._listener: socket.socket | None = None
        self.address: tuple[str, int] | None = None  # where it listened (relay.json)
        self.nodes: dict[int, Connection] = {}  # node number -> its relay's connection
        self.ranks: dict[int, int] = {}  # rank -> its node's number
        # A rank's pid is its node's, meaningless on this machine: interrupts go through
        # the relay, and no local process is read for the ranks' memory.
        self.pids: dict[int, int] = {}
        self.gone: set[int] = set()
        self.closed = False
        self._kept = []

    def _waitables(self) -> dict[Any, int]:
        if self._listener is None and self.address is None:
            self._listen()
        by_conn = {conn: node for node, conn in self.nodes.items() if not conn.closed}
        return by_conn if self._listener is None else {self._listener: -1, **by_conn}

    def _listen(self) -> None:
        """Listen once the first node said where it is: on our address towards it."""
        try:
            host = json.loads((self.run_dir / "rdzv.json").read_text(encoding="utf-8"))["host"]
            address = _address_towards(str(host))
        except (OSError, ValueError, KeyError, TypeError):
            return  # not yet (the first node has not started)
        self._listener = socket.create_server((address, 0), backlog=self.nnodes)
        self._listener.setblocking(False)  # noqa: FBT003  (socket API)
        self.address = (address, int(self._listener.getsockname()[1]))
        tmp = self.run_dir / f".{RELAY_FILE}.tmp"
        tmp.write_text(json.dumps(dict(zip(("host", "port"), self.address, strict=True))))
        tmp.replace(self.run_dir / RELAY_FILE)  # atomic: a node never reads half of it

    def _accept(self) -> None:
        if self._listener is None:
            return
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)  # noqa: FBT003  (socket API)
        conn = Connection(sock.detach())
        _receive_timeout(conn, _HANDSHAKE_S)
        hello = token_hello(conn, self._authkey)  # TCP has no peer credentials: the token is all
        node = None if hello is None else hello.get("node")
        known = isinstance(node, int) and 0 <= node < self.nnodes and node not in self.nodes
        if hello is None or hello.get("op") != "node" or not known:
            conn.close()  # not one of the job's nodes, or one already in: hung up on
            return
        _receive_timeout(conn, _MESSAGE_S)
        _no_delay(conn)
        self.nodes[int(hello["node"])] = conn
        if len(self.nodes) == self.nnodes:
            self._stop_listening()  # every node is in: nobody else needs to reach us

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with contextlib.suppress(OSError):
            (self.run_dir / RELAY_FILE).unlink()

    def _take(self, node: int, conn: Connection, out: list[tuple[int, dict[str, Any]]]) -> None:
        """Every whole envelope the node sent so far (one at least)."""
        try:
            self._open(node, conn.recv(), out)
            while conn.poll():
                self._open(node, conn.recv(), out)
        except (EOFError, OSError):
            self._lose(node)

    def _open(self, node: int, envelope: tuple[str, int, Any], out: list[Any]) -> None:
        kind, rank, body = envelope
        if kind == "said":
            out.append((rank, body))
        elif kind == "joined":
            self.ranks[rank] = node
        elif kind == "gone":
            self.gone.add(rank)

    def _lose(self, node: int) -> None:
        """A relay hung up (its node ended or died): its ranks are gone."""
        with contextlib.suppress(OSError):
            self.nodes[node].close()
        self.gone.update(rank for rank, on in self.ranks.items() if on == node)

    def _tell(self, kind: str, ranks: list[int], body: Any) -> None:
        for node, conn in self.nodes.items():
            mine = [rank for rank in ranks if self.ranks.get(rank) == node]
            if mine and not conn.closed:
                try:
                    with sigint_held():
                        conn.send((kind, mine, body))  # pickled once per node, not per rank
                except OSError:
                    self._lose(node)

    def send(self, ranks: list[int], message: dict[str, Any]) -> None:
        """Send one message to each of *ranks*, through their nodes' relays."""
        self._tell("send", [rank for rank in ranks if rank not in self.gone], message)

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to *ranks*, sent by their nodes' relays (their user code gets
        KeyboardInterrupt; the rank stays)."""
        self._tell("interrupt", ranks, None)

    def close(self) -> None:
        self.closed = True
        self._stop_listening()
        for conn in self.nodes.values():
            with contextlib.suppress(OSError):
                conn.close()  # each relay exits, closing its ranks' connections


# The node's side: one relay process per node of a warm job.


def _leave(local: Path) -> NoReturn:
    """End the relay: its exit closes every rank's connection (they leave their loop)."""
    shutil.rmtree(local, ignore_errors=True)
    os._exit(0)


def _join(run_dir: Path, token: str, node: int, name: str) -> Connection:
    """Connect to the kernel once it listens (``relay.json``), prove the token, say hello."""
    deadline = time.monotonic() + _WAIT_FOR_KERNEL_S
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            where = json.loads((run_dir / RELAY_FILE).read_text(encoding="utf-8"))
            address = (str(where["host"]), int(where["port"]))
            break
        if time.monotonic() > deadline:
            raise OSError(f"the kernel did not listen for the nodes within {_WAIT_FOR_KERNEL_S} s")
        time.sleep(0.02)
    kernel = Client(address, family="AF_INET", authkey=token.encode())
    _no_delay(kernel)
    kernel.send({"op": "node", "node": node, "name": name})
    return kernel


def _carry_down(kernel: Connection, server: CellServer, local: Path) -> None:
    """What the kernel says, to the ranks it names (a thread)."""
    while True:
        try:
            kind, ranks, body = kernel.recv()
        except (EOFError, OSError):
            _leave(local)
        if kind == "send":
            server.send(ranks, body)
        elif kind == "interrupt":
            server.interrupt(ranks)


def _carry_up(kernel: Connection, server: CellServer, local: Path, nproc: int) -> NoReturn:
    """What the ranks say (and who joined or hung up), to the kernel."""
    joined: set[int] = set()
    told_gone: set[int] = set()
    while True:
        said = server.poll(1.0)
        try:
            for rank in sorted(server.ranks.keys() - joined):
                kernel.send(("joined", rank, server.pids.get(rank)))
                joined.add(rank)
                if len(joined) == nproc:  # every rank of the node is in: nobody else may
                    shutil.rmtree(local, ignore_errors=True)  # join, and nothing stays on disk
            for rank, message in said:
                kernel.send(("said", rank, message))
            for rank in sorted(server.gone - told_gone):
                kernel.send(("gone", rank, None))
                told_gone.add(rank)
        except OSError:
            _leave(local)


def main(argv: list[str]) -> NoReturn:
    if len(argv) != 4:
        raise SystemExit("usage: python -m nbgpu.launch.relay RUN_DIR NODE NAME NPROC")
    run_dir, node, name, nproc = Path(argv[0]), int(argv[1]), argv[2], int(argv[3])
    die_with_parent(signal.SIGTERM, os.getppid())  # the node's agent: the job on this node
    token = str(json.loads((run_dir / "bootstrap.json").read_text(encoding="utf-8"))["token"])
    # The ranks' socket on this node's own disk, not the shared run directory: a Unix
    # socket on a network filesystem reaches no other node, and nobody else needs it.
    local = Path(tempfile.mkdtemp(prefix="nbgpu-cells-"))  # 0700

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        _leave(local)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = CellServer(local, token)
    print(server.path, flush=True)  # the node process points its ranks at it
    try:
        kernel = _join(run_dir, token, node, name)
    except (OSError, AuthenticationError) as exc:
        print(f"nbgpu relay on {name}: no channel to the kernel ({exc})", file=sys.stderr)
        _leave(local)
    threading.Thread(
        target=_carry_down, args=(kernel, server, local), name="nbgpu-relay", daemon=True
    ).start()
    _carry_up(kernel, server, local, nproc)


if __name__ == "__main__":
    main(sys.argv[1:])
