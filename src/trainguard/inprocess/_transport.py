"""Sockets of one iteration, so the abort can end every wait the iteration can block in.

gloo cannot abort a collective (its ``abort()`` and ``destroy_process_group`` leave a blocked
``all_reduce`` blocked until gloo's own timeout), and a c10d store wait cannot be cancelled, but
shutting down the *connected* TCP sockets under them makes the blocked call raise within
milliseconds. :func:`release_iteration` does that for every connected TCP socket the process
opened since the iteration began (:func:`mark_iteration_start`), whoever opened it: process groups
made by ``CallWrapper.init_process_group``, a plain ``init_process_group`` (and its own TCPStore),
``new_group`` inside a library (an ``AsyncCheckpointer``, Lightning), plus the per-iteration store
connection handed to the wrapped function (:func:`track_fds`). Listening sockets are never touched
(shutting gloo's listener aborts the process) and neither is any other socket to the restart
loop's own store port (the loop and the monitor thread talk to the store through them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import stat
import threading
from collections.abc import Iterator

from trainguard._core.logging import get_logger

__all__ = [
    "clear",
    "mark_iteration_start",
    "release_iteration",
    "shutdown_tracked",
    "snapshot",
    "track_fds",
    "tracked_fds",
    "tracking",
]

_log = get_logger("trainguard.inprocess")
_lock = threading.Lock()
_tracked: dict[int, tuple] = {}  # fd -> (laddr, raddr) at tracking time
_excluded_ports: set[int] = set()
_iteration_baseline: set[int] = set()


@dataclasses.dataclass(frozen=True)
class _Conn:
    laddr: tuple  # (host, port, ...) as getsockname() returns it
    raddr: tuple | None  # None: not connected (or listening)
    listening: bool

    @property
    def lport(self) -> int:
        return int(self.laddr[1])

    @property
    def rport(self) -> int | None:
        return None if self.raddr is None else int(self.raddr[1])


def _describe(fd: int) -> _Conn | None:
    """The TCP endpoints of descriptor ``fd``, or None when it is not a TCP socket."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        try:
            raddr: tuple | None = tuple(sock.getpeername())
        except OSError:
            raddr = None
        return _Conn(tuple(sock.getsockname()), raddr, listening)
    except OSError:
        return None
    finally:
        sock.close()


def _connections() -> dict[int, _Conn]:
    """This process's TCP sockets by descriptor (per-descriptor syscalls: no scan of the
    system-wide TCP table, which is slow on a busy host)."""
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return {}
    out = {}
    for fd in fds:
        c = _describe(fd)
        if c is not None:
            out[fd] = c
    return out


def snapshot() -> set[int]:
    """Descriptors of this process's TCP sockets now."""
    return set(_connections())


def exclude_port(port: int) -> None:
    """Never shut sockets whose local or remote port is ``port`` (the store's)."""
    _excluded_ports.add(int(port))


def track_fds(fds: set[int]) -> None:
    """Track these connected sockets whatever their port (the per-iteration store connection)."""
    with _lock:
        for fd in fds:
            c = _describe(fd)
            if c is not None and c.raddr and not c.listening:
                _tracked[fd] = (c.laddr, c.raddr)


def track_new(before: set[int]) -> list[int]:
    """Record the connected TCP sockets opened since ``before``; returns their descriptors."""
    added = []
    with _lock:
        for fd, c in _connections().items():
            if fd in before or not c.raddr or c.listening:
                continue
            if c.lport in _excluded_ports or c.rport in _excluded_ports:
                continue
            _tracked[fd] = (c.laddr, c.raddr)
            added.append(fd)
    return added


@contextlib.contextmanager
def tracking() -> Iterator[None]:
    """Track the sockets a process-group constructor opens inside the block."""
    before = snapshot()
    try:
        yield
    finally:
        track_new(before)


def mark_iteration_start() -> None:
    """Remember the TCP sockets open when an iteration begins (for the untracked fallback)."""
    global _iteration_baseline
    _iteration_baseline = snapshot()


def release_iteration() -> int:
    """Shut every connected socket opened since the iteration began (except the loop's own
    store connections) and every tracked one; returns how many were shut.

    Sockets the wrapped function opened for other purposes in this iteration are shut too: the
    iteration is being torn down and the next one recreates them. Safe from any thread; takes
    one ``/proc`` scan plus one ``shutdown`` per socket (milliseconds), never blocks.
    """
    track_new(_iteration_baseline)
    return shutdown_tracked()


def tracked_fds() -> dict[int, tuple]:
    with _lock:
        return dict(_tracked)


def shutdown_tracked() -> int:
    """``shutdown(SHUT_RDWR)`` every tracked socket still open with the same endpoints.

    Safe from any thread; descriptors are duplicated, never closed. Returns how many were shut.
    """
    shut = 0
    with _lock:
        items = list(_tracked.items())
    for fd, (laddr, raddr) in items:
        c = _describe(fd)
        if c is None or not c.raddr or (c.laddr, c.raddr) != (laddr, raddr):
            continue  # closed or the number was reused by another socket
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            sock.close()
    _log.debug("shut down %d process-group sockets", shut)
    return shut


def clear() -> None:
    with _lock:
        _tracked.clear()
