"""Free TCP ports on 127.0.0.1, for servers that tests and benchmarks start themselves."""

from __future__ import annotations

import socket

__all__ = ("free_port", "free_ports")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of 127.0.0.1 (held open together while picked, so no
    two are the same; a server started on one later may still lose it to another
    process, which the callers' start-up checks report)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    """One free port of 127.0.0.1 (see :func:`free_ports`); also a closed port for
    "server unreachable" tests."""
    (port,) = free_ports(1)
    return port
