"""Trainer-side handle of the persistent writer process, and the pool of staging arenas."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from typing import Any

from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_msg
from trainguard._core.logging import get_logger
from trainguard._core.procs import ExitWatch, describe_exit, terminate_processes
from trainguard.checkpointing._staging import Arena

__all__ = ["ArenaPool", "WriterDied", "WriterProcess"]

_log = get_logger("trainguard.checkpointing")
_MSG = 1  # the one frame kind on the writer socket: a _core.ipc message (JSON + payload)


class WriterDied(Exception):
    """Internal: the writer process is gone (its exit is described in the message)."""


class WriterProcess:
    """Handle of one persistent writer process for this rank (or of none, between uses).

    The process behind a handle can change: a dead one is replaced lazily, and an idle one can be
    handed to the process-wide pool of warm writers (:meth:`detach`, see ``_pool``) and later
    taken by this or another checkpointer's handle (:meth:`ensure_started`), so an in-process
    restart or a new checkpointer does not wait for a fresh interpreter to import torch.

    Counters (observable for tests): ``starts`` - processes this handle spawned cold;
    ``taken`` - warm processes it took from the pool.

    A process that dies unasked (``kill -9``, the OOM killer), idle or not, is noticed at once
    by an :class:`~trainguard._core.procs.ExitWatch` thread: one WARNING names its pid, rank and
    exit signal. An idle one is replaced at once in the writer pool (when enabled), so the next
    request, which finds it dead, takes the replacement warm (:meth:`ensure_started`) instead of
    waiting for a new interpreter to import torch; requests in flight fail as before.
    """

    def __init__(self, rank: int, nice: int = 0, warm_dcp: bool = False,
                 spare: bool = False) -> None:
        self.rank, self.nice = rank, nice
        self.spare = spare  # keep a warm spare writer in the pool while attached (_pool)
        self.started_at = 0.0  # time.monotonic() when the current process was spawned
        self.dcp_asked = False  # the current process was asked to import DCP (by any owner)
        self.warm_dcp = warm_dcp  # its owner writes DCP: every process it gets imports DCP early
        self.proc: Any = None
        self.conn: Any = None
        self.pidfd: int | None = None
        self.ready = False
        self.starts = 0
        self.taken = 0
        self.owed = 0  # requests (save, commit) sent whose reply has not been read
        self.park_on_release = True  # release(): an idle writer goes to the pool (else stopped)
        self.sent_arenas: set[str] = set()
        self.backlog: list[tuple[dict[str, Any], bytes | None, Arena | None]] = []
        self.pooled = False  # parked in the pool (for the death warning only)
        self._watch: ExitWatch | None = None

    def _watch_exit(self) -> None:
        """Warn as soon as the current process dies unasked (see the class docstring)."""
        self._unwatch()
        if self.proc is not None:
            self._watch = ExitWatch(self.proc.pid, self._died,
                                    name=f"tg-ckpt-writer-watch-{self.proc.pid}")

    def _unwatch(self) -> None:
        """Before stopping the process on purpose (or handing it over): no warning then."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    def _died(self, pid: int, how: str) -> None:
        """ExitWatch thread: one line; the process is reaped here (no zombie waits for the
        owner's next request), and the owner's next request gets a new writer."""
        proc = self.proc
        if proc is not None and proc.pid == pid:
            proc.poll()  # reaps it (Popen's own lock: never races the owner's wait)
            if proc.returncode is not None:
                how = describe_exit(proc.returncode)
        if self.pooled:
            what = "pooled idle checkpoint writer"
            then = "the pool drops it when a checkpointer next takes a writer"
        elif self.owed:
            what = "checkpoint writer"
            then = f"{self.owed} request(s) in flight fail; the next save() starts a new writer"
        else:
            what = "idle checkpoint writer"
            then = "the next save() starts a new writer"
            from trainguard.checkpointing.async_ckpt import _pool

            # only one that had started: a writer that cannot start must not respawn forever
            if self.ready and _pool.spawn(self.rank, self.nice, warm_dcp=self.warm_dcp):
                then = "a new one is starting in the writer pool for the next save()"
        _log.warning("%s pid %d of rank %d died (%s); %s", what, pid, self.rank, how, then)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def idle(self) -> bool:
        """Alive and owing no reply (requests waiting in :attr:`backlog` for a writer that is
        still starting do not count): it holds nothing of its owner but mapped arenas."""
        return self.owed == 0 and self.alive()

    def ensure_started(self) -> None:
        """Attach a writer if none is running: a warm one from the pool (same ``nice``), else a
        new process (returns at once; the child imports torch meanwhile).

        The writer is ``python -m ...async_ckpt._worker`` (a fresh interpreter like ``spawn``, but
        without re-running the trainer's ``__main__``), talking ``_core.ipc`` messages over a
        socketpair.
        """
        if self.alive():
            return
        self.stop(grace_s=0.0)
        from trainguard.checkpointing.async_ckpt import _pool

        warm = _pool.take(self.nice, self.warm_dcp)
        if warm is not None:
            self._adopt(warm)
            try:
                self.send({"op": "reset", "rank": self.rank})  # the worker logs as our rank
                self._send_warm()
            except WriterDied:  # died in the pool just now: start a fresh one instead
                self.stop(grace_s=0.0)
            else:
                self.taken += 1
                _log.debug("took warm checkpoint writer pid %d from the pool", self.proc.pid)
                self._want_spare()
                return
        self.spawn()
        self._want_spare()

    def _want_spare(self) -> None:
        if self.spare:
            from trainguard.checkpointing.async_ckpt import _pool

            _pool.want_spare(self)

    def spawn(self) -> None:
        """Start a new writer process on this (empty) handle; returns at once."""
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
        self.proc, self.ready, self.owed = proc, False, 0
        self.started_at = time.monotonic()
        self.pidfd = os.pidfd_open(proc.pid)
        self.sock = parent
        self.conn = FrameReader(parent.fileno())
        self.sent_arenas, self.backlog = set(), []
        self.starts += 1
        self.dcp_asked = False
        self._watch_exit()
        _log.debug("started checkpoint writer pid %d", proc.pid)
        self._send_warm()

    def _send_warm(self) -> None:
        """Ask the process to import DCP now (``warm_dcp``); sent at once, not kept back like
        requests: the worker reads it right after its torch import, and owes no reply."""
        if self.warm_dcp and not self.dcp_asked:
            self._send_now({"op": "warm", "dcp": True}, None, None)
            self.dcp_asked = True

    def detach(self) -> WriterProcess | None:
        """Move an idle process out of this handle into a new handle (for the pool); the worker
        is told to unmap every arena it was sent. None (and nothing moved) when not idle."""
        if not self.idle():
            return None
        self.backlog = []  # never sent: the owner drops these requests
        try:
            self._send_now({"op": "reset"}, None, None)
        except WriterDied:
            return None
        out = WriterProcess(self.rank, self.nice, self.warm_dcp or self.dcp_asked)
        out._adopt(self)
        return out

    def _adopt(self, other: WriterProcess) -> None:
        """Take ``other``'s process and handles; ``other`` is left empty."""
        other._unwatch()
        self.proc, self.sock, self.conn = other.proc, other.sock, other.conn
        self.pidfd, self.ready, self.owed = other.pidfd, other.ready, 0
        self.started_at, self.dcp_asked = other.started_at, other.dcp_asked
        self.sent_arenas, self.backlog, other.backlog = set(), [], []
        other.proc, other.conn, other.pidfd, other.ready = None, None, None, False
        self._watch_exit()

    def release(self) -> None:
        """Owner gone (finalizer, ``close``): an idle writer goes to the pool when
        ``park_on_release`` is set, otherwise (or when busy) it is stopped (up to ~4 s)."""
        if self.spare:
            from trainguard.checkpointing.async_ckpt import _pool

            _pool.unwant_spare(self)
        if self.park_on_release:
            warm = self.detach()
            if warm is not None:
                from trainguard.checkpointing.async_ckpt import _pool

                _pool.park(warm)
                return
        self.stop(grace_s=2.0)

    def describe(self) -> str:
        if self.proc is None:
            return "writer not started"
        return f"writer pid {self.proc.pid} ({describe_exit(self.proc.poll())})"

    def send(self, header: dict[str, Any], payload: bytes | None = None,
             arena: Arena | None = None) -> None:
        """Send one request (plus the arena's fd the first time). Raises WriterDied if broken.

        Until the writer is ready (still importing torch) requests wait here, in order, and go
        out when its ready message is read (:meth:`recv`, or here): a writer that is still
        starting then holds nothing of its owner, so an abort parks it (keeping its import
        progress) instead of killing it."""
        if not self.ready:
            self.poll_ready()
        if not self.ready:
            if self.proc is None:
                raise WriterDied("writer not running (stopped or aborted)")
            self.backlog.append((header, payload, arena))
            return
        self._send_now(header, payload, arena)

    def poll_ready(self) -> None:
        """Read the ready message if it has arrived (before it nothing else can arrive)."""
        conn = self.conn
        if conn is None:
            return
        try:
            readable = select.select([conn.fd], [], [], 0)[0]
        except (OSError, ValueError):
            return
        if readable:
            self.recv(0.0)

    def send_now(self, header: dict[str, Any]) -> None:
        """Send a request that owes no reply at once, even to a writer still importing torch
        (it reads it right after); raises WriterDied if the writer is unreachable."""
        self._send_now(header, None, None)

    def _send_now(self, header: dict[str, Any], payload: bytes | None,
                  arena: Arena | None) -> None:
        try:
            new = arena is not None and arena.name not in self.sent_arenas
            send_msg(self.sock.fileno(), _MSG, {**header, "arena_fd": new}, payload or b"")
            if header.get("op") in ("save", "commit"):
                self.owed += 1
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
                    backlog, self.backlog = self.backlog, []
                    for item in backlog:
                        self._send_now(*item)
                    return {"ready": True}, None
                self.owed = max(0, self.owed - 1)
                return reply, (extra if reply.get("has_extra") else None)
        except (EOFError, OSError, ValueError, FrameError) as exc:
            self._reap()
            raise WriterDied(f"{self.describe()} died (pipe closed)") from exc
        if pidfd in ready:
            self._reap()
            raise WriterDied(self.describe())
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask the writer to exit, then SIGTERM -> SIGKILL after ``grace_s``; reaps it. A writer
        not known to be ready (still importing torch: it holds nothing) gets SIGTERM at once."""
        if self.proc is None:
            return
        self._unwatch()
        if grace_s > 0 and self.alive() and self.ready:
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

        self._unwatch()
        try:
            proc.send_signal(signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass

    def kill(self) -> None:
        """SIGKILL and reap now (abort path)."""
        if self.proc is None:
            return
        import signal

        self._unwatch()
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
        self._unwatch()
        if self.conn is not None:
            self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.proc, self.conn, self.pidfd, self.owed = None, None, None, 0
        self.backlog = []


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
