"""Master ports: distinct, free TCP ports for the roles and runs of a plan.

:func:`pick_ports` is pure: it asks an injected ``port_is_free(port) -> bool`` about
each port in turn, so plans are deterministic under test. :func:`port_is_free` is the
one place in ``plan/`` that touches the system: it binds a socket and lets it go. A port
free now can be taken before the job starts (hand-started sweep runs often all use 12345); distinct
ports per plan stop *our* runs from colliding, and the launcher re-checks at start.

Imports only the standard library (``socket`` for the one bind); never pynvml or psutil.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterable

__all__ = ["DEFAULT_BASE_PORT", "MAX_PORT", "PortChecker", "pick_ports", "port_is_free"]

#: torchrun's own default MASTER_PORT; plans count up from it.
DEFAULT_BASE_PORT = 29500
MAX_PORT = 65535
# How far past the base port to look before giving up: a box with a thousand ports taken
# in a row has a problem a plan cannot solve.
SCAN_LIMIT = 1000

PortChecker = Callable[[int], bool]


def port_is_free(port: int) -> bool:
    """True if a TCP socket can bind *port* on the loopback address right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            # EACCES (privileged port) is as unusable as EADDRINUSE for a job.
            return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True


def pick_ports(
    count: int,
    *,
    base_port: int = DEFAULT_BASE_PORT,
    taken: Iterable[int] = (),
    is_free: PortChecker = port_is_free,
) -> tuple[int, ...]:
    """*count* distinct ports from *base_port* upward that are free and not in *taken*.

    Returns fewer when the scan limit or port 65535 is reached first; the caller says so.
    """
    avoid = set(taken)
    found: list[int] = []
    port = base_port
    while len(found) < count and port <= min(MAX_PORT, base_port + SCAN_LIMIT):
        if port not in avoid and is_free(port):
            found.append(port)
        port += 1
    return tuple(found)
