"""Trainer-side handle of the persistent writer process, and the pool of staging arenas."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from typing import Any

from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_msg
from trainguard._core.logging import get_logger
from trainguard._core.procs import describe_exit, terminate_processes
from trainguard.checkpointing._staging import Arena

__all__ = ["ArenaPool", "WriterDied", "WriterProcess"]

_log = get_logger("trainguard.checkpointing")
_MSG = 1  # the one frame kind on the writer socket: a _core.ipc message (JSON + payload)


class WriterDied(Exception):
    """Internal: the writer process is gone (its exit is described in the message)."""


class WriterProcess:
    """One persistent ``spawn``-ed writer for this rank; restarted lazily after a death or kill."""

    def __init__(self, rank: int, nice: int = 0) -> None:
        self.rank, self.nice = rank, nice
        self.proc: Any = None
        self.conn: Any = None
        self.pidfd: int | None = None
        self.ready = False
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_started(self) -> None:
        """Start the writer if it is not running (returns at once; the child imports torch).

        The writer is ``python -m ...async_ckpt._worker`` (a fresh interpreter like ``spawn``, but
        without re-running the trainer's ``__main__``), talking ``_core.ipc`` messages over a
        socketpair.
        """
        if self.alive():
            return
        self.stop(grace_s=0.0)
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.checkpointing.async_ckpt._worker",
                 str(child.fileno()), str(os.getpid()), str(self.rank), str(self.nice)],
                pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.proc, self.ready = proc, False
        self.pidfd = os.pidfd_open(proc.pid)
        self.sock = parent
        self.conn = FrameReader(parent.fileno())
        self.sent_arenas: set[str] = set()
        self.starts += 1
        _log.debug("started checkpoint writer pid %d", proc.pid)

    def describe(self) -> str:
        if self.proc is None:
            return "writer not started"
        return f"writer pid {self.proc.pid} ({describe_exit(self.proc.poll())})"

    def send(self, header: dict[str, Any], payload: bytes | None = None,
             arena: Arena | None = None) -> None:
        """Send one request (plus the arena's fd the first time). Raises WriterDied if broken."""
        try:
            new = arena is not None and arena.name not in self.sent_arenas
            send_msg(self.sock.fileno(), _MSG, {**header, "arena_fd": new}, payload or b"")
            if new and arena is not None and arena.fd is not None:
                socket.send_fds(self.sock, [b"F"], [arena.fd])
                self.sent_arenas.add(arena.name)
        except (OSError, ValueError, AttributeError) as exc:
            raise WriterDied(f"cannot reach {self.describe()}: {exc}") from exc

    def recv(self, timeout_s: float) -> tuple[dict[str, Any], bytes | None] | None:
        """One reply within ``timeout_s`` seconds, or None. Raises WriterDied when it is dead
        (or was killed meanwhile by :meth:`kill` from another thread)."""
        conn, pidfd = self.conn, self.pidfd
        if conn is None or pidfd is None:
            raise WriterDied("writer not running (stopped or aborted)")
        try:
            ready, _, _ = select.select([conn.fd, pidfd], [], [], timeout_s)
            if conn.fd in ready:
                reply, extra = decode_msg(conn.recv()[1])
                if reply.get("ready"):
                    self.ready = True
                    return {"ready": True}, None
                return reply, (extra if reply.get("has_extra") else None)
        except (EOFError, OSError, ValueError, FrameError) as exc:
            self._reap()
            raise WriterDied(f"{self.describe()} died (pipe closed)") from exc
        if pidfd in ready:
            self._reap()
            raise WriterDied(self.describe())
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask the writer to exit, then SIGTERM -> SIGKILL after ``grace_s``; reaps it."""
        if self.proc is None:
            return
        if grace_s > 0 and self.alive():
            try:
                send_msg(self.sock.fileno(), _MSG, {"op": "exit"})
                self.proc.wait(grace_s)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        terminate_processes([self.proc], grace_s=min(grace_s, 2.0))
        self._close_handles()

    def signal_kill(self) -> None:
        """SIGKILL the writer without reaping it or closing handles (safe from any thread: the
        owning thread sees the death through the pidfd and reaps it)."""
        proc = self.proc
        if proc is None:
            return
        import signal

        try:
            proc.send_signal(signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass

    def kill(self) -> None:
        """SIGKILL and reap now (abort path)."""
        if self.proc is None:
            return
        import signal

        terminate_processes([self.proc], grace_s=0.5, first_signal=signal.SIGKILL)
        self._close_handles()

    def _reap(self) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            terminate_processes([proc], grace_s=0.5)

    def _close_handles(self) -> None:
        if self.conn is not None:
            self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.proc, self.conn, self.pidfd = None, None, None


class ArenaPool:
    """Reusable arenas: at most ``max_arenas``, and at most ``budget_bytes`` in total if set.

    Host memory for staging is therefore bounded by min(max_arenas x state, budget).
    """

    def __init__(self, max_arenas: int, budget_bytes: int | None = None) -> None:
        self.max_arenas, self.budget_bytes = max_arenas, budget_bytes
        self.free: list[Arena] = []
        self.busy: dict[int, Arena] = {}

    @staticmethod
    def size_for(nbytes: int) -> int:
        """Capacity allocated for a state of ``nbytes`` (5% headroom for growth)."""
        return int(nbytes * 1.05) + 4096

    def count(self) -> int:
        return len(self.free) + len(self.busy)

    def can_acquire(self, nbytes: int) -> bool:
        if any(a.capacity >= nbytes for a in self.free):
            return True
        busy = sum(a.capacity for a in self.busy.values())  # free ones get replaced
        within = self.budget_bytes is None or busy + self.size_for(nbytes) <= self.budget_bytes
        return len(self.busy) + 1 <= self.max_arenas and within

    def acquire(self, nbytes: int, req_id: int, on_retire, prefault: bool = False) -> Arena:
        """A free arena of >= ``nbytes``, or a new one replacing the (too small) free ones;
        ``on_retire(arena)`` runs before an arena is closed. Call after :meth:`can_acquire`.
        A new arena's pages are faulted in here only with ``prefault`` (``warmup``); otherwise
        the first copy into it touches them (in the background for an overlapped save)."""
        fitting = [a for a in self.free if a.capacity >= nbytes]
        if fitting:
            arena = fitting[0]
            self.free.remove(arena)
        else:
            for old in self.free:
                on_retire(old)
                old.close()
            self.free = []
            arena = Arena(self.size_for(nbytes), prefault=prefault)
        self.busy[req_id] = arena
        return arena

    def release(self, req_id: int) -> None:
        arena = self.busy.pop(req_id, None)
        if arena is not None:
            self.free.append(arena)

    def close(self) -> None:
        for arena in [*self.free, *self.busy.values()]:
            arena.close()
        self.free, self.busy = [], {}
