"""Network helpers: free ports on the loopback interface."""

from __future__ import annotations

import socket

__all__ = ["free_port", "reserve_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """Bind (without listening) a TCP socket with ``SO_REUSEADDR`` to ``port`` (0: a free one).

    While the returned socket stays open the kernel hands its port to no other ``bind(0)``, yet a
    server that sets ``SO_REUSEADDR`` itself (c10d's TCPStore does) can still bind and listen on
    it: a race-free way to pick a port for a child process. Close it once the child listens or
    the port is no longer needed.

    Raises:
        OSError: ``port`` is in use by a listening socket (``EADDRINUSE``) or ``host`` is invalid.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
