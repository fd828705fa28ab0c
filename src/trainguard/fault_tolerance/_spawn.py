"""Starting workers: forked from the per-node fork server (warm) or spawned fresh (cold).

Both paths run the script through ``_bootstrap`` (parent-death signal, automatic heartbeat, stack
dumps), put each worker in its own process group and connect its stdout/stderr to pipes read by
the log pump. A warm worker is a child of the fork server, which reports its exit status; a cold
one is the launcher's child. Every worker gets a pidfd for exit detection either way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from trainguard._core.clock import Deadline
from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_msg
from trainguard._core.procs import terminate_processes

__all__ = ["ForkServer", "Worker", "spawn_cold", "stop_helper", "stop_helpers"]

MSG = 1
_log = logging.getLogger("trainguard.fault_tolerance")


@dataclasses.dataclass
class Worker:
    """One running worker of one cycle."""

    rank: int
    local_rank: int
    pid: int
    warm: bool
    started_ns: int
    popen: subprocess.Popen[bytes] | None = None
    exitcode: int | None = None
    exit_ns: int = 0


def spawn_cold(mode: str, target: str, args: list[str], env: dict[str, str], out_fd: int,
               err_fd: int) -> subprocess.Popen[bytes]:
    """A fresh ``python -u -m ..._bootstrap`` (or the bootstrap exec-ing ``--no-python``)."""
    cmd = [sys.executable, "-u", "-m", "trainguard.fault_tolerance._bootstrap", mode, target,
           *args]
    # its own process group (Popen's process_group= exists from Python 3.11 on; before, a new
    # session also makes the worker lead its own group)
    group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                             else {"start_new_session": True})
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out_fd,
                            stderr=err_fd, **group)


def stop_helper(proc: subprocess.Popen[bytes], sock: socket.socket, wait_s: float = 1.0,
                grace_s: float = 1.0) -> None:
    """Stop a launcher helper process (fork server, rank monitor) that listens on ``sock``.

    Sends it ``{"op": "stop"}``, waits up to ``wait_s`` seconds for it to exit on its own, then
    escalates through ``_core.procs.terminate_processes`` (SIGTERM, ``grace_s`` seconds, SIGKILL
    of its tree) and closes ``sock``. Blocks at most about ``wait_s + grace_s`` seconds plus the
    reap; never raises for a helper that is already gone. Idempotent.
    """
    stop_helpers([(proc, sock)], wait_s, grace_s)


def stop_helpers(helpers: Sequence[tuple[subprocess.Popen[bytes], socket.socket]],
                 wait_s: float = 1.0, grace_s: float = 1.0) -> None:
    """:func:`stop_helper` for several helpers at once: every one is asked to stop first, then
    all of them get one shared ``wait_s`` deadline and one escalation, so stopping N helpers
    blocks about as long as stopping the slowest one (at most ``wait_s + grace_s`` plus the
    reap), not N times that. Never raises for helpers already gone. Idempotent."""
    for proc, sock in helpers:
        if proc.poll() is None:
            try:
                send_msg(sock.fileno(), MSG, {"op": "stop"})
            except (OSError, ValueError):  # ValueError: the socket is already closed
                pass
    deadline = Deadline(wait_s)
    for proc, _ in helpers:
        try:
            proc.wait(max(0.0, deadline.remaining()))
        except subprocess.TimeoutExpired:
            pass
    terminate_processes([proc for proc, _ in helpers], grace_s=grace_s)
    for _, sock in helpers:
        sock.close()


class ForkServer:
    """Launcher-side handle of ``_forkserver`` (one per node, persistent across cycles)."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]) -> None:
        parent, child = socket.socketpair()
        self.sock = parent
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "trainguard.fault_tolerance._forkserver",
             str(child.fileno()), str(os.getpid()), *preload],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.reader = FrameReader(parent.fileno(), 4096)
        self.ready = False
        self.reason = ""
        self.exited: list[tuple[int, int]] = []
        self._next_id = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the server preloaded (True) or failed/timed out (False, ``reason`` set)."""
        msg = self._recv(timeout_s)
        if msg is None:
            self.reason = self.reason or f"fork server not ready within {timeout_s:.0f} s"
        elif msg.get("op") == "ready":
            self.ready = True
        else:
            self.reason = str(msg.get("reason", msg))
        if not self.ready:
            self.close()
        return self.ready

    def _recv(self, timeout_s: float) -> dict[str, Any] | None:
        if not select.select([self.sock], [], [], timeout_s)[0]:
            return None
        try:
            return decode_msg(self.reader.recv()[1])[0]
        except (EOFError, OSError, FrameError) as exc:
            self.reason = f"fork server exited ({exc})"
            self.ready = False
            return None

    def spawn(self, mode: str, target: str, args: list[str], env: dict[str, str],
              out_fd: int, err_fd: int, timeout_s: float = 10.0) -> int:
        """Fork one worker; returns its pid. Raises OSError when the server is unusable."""
        self._next_id += 1
        req = {"op": "spawn", "id": self._next_id, "mode": mode, "target": target,
               "args": args, "env": env, "cwd": os.getcwd(), "parent": self.proc.pid}
        send_msg(self.sock.fileno(), MSG, req)
        socket.send_fds(self.sock, [b"F"], [out_fd, err_fd])
        deadline = Deadline(timeout_s)
        while not deadline.expired():
            msg = self._recv(deadline.remaining())
            if msg is None:
                break
            if msg.get("op") == "exited":
                self.exited.append((int(msg["pid"]), int(msg["status"])))
            elif msg.get("op") == "spawned" and msg.get("id") == self._next_id:
                return int(msg["pid"])
        self.ready = False
        raise OSError(self.reason or f"fork server did not fork within {timeout_s:.0f} s")

    def poll_events(self) -> list[tuple[int, int]]:
        """Exit statuses reported so far (pid, status; negative = signal); non-blocking."""
        while self.ready and select.select([self.sock], [], [], 0)[0]:
            msg = self._recv(0)
            if msg is None:
                break
            if msg.get("op") == "exited":
                self.exited.append((int(msg["pid"]), int(msg["status"])))
        out, self.exited = self.exited, []
        return out

    def close(self) -> None:
        """Stop the server (its children die with it: parent-death signal). Idempotent."""
        stop_helper(self.proc, self.sock)
        self.ready = False
