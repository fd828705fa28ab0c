"""Rank process helpers; ending ranks: cooperative exit, then SIGTERM -> grace -> SIGKILL of groups.

Each rank leads its own process group (pgid == its pid), so signalling the group also reaches
grandchildren (DataLoader workers, helpers); ``_core.procs.terminate_processes`` also kills the
ranks' descendants that left the group. Ranks are reaped only at the very end, inside that call:
until then an exited rank is a zombie, its pid cannot be reused, and signalling its group cannot
hit an unrelated process.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from trainguard._core.clock import Deadline
from trainguard._core.ipc import send_frame
from trainguard._core.procs import terminate_processes
from trainguard.runner._child import SHUTDOWN

__all__ = ["exit_status", "sigint_ignored", "stop_ranks"]

_TERM_GRACE_S = 5.0


def _wait_exited(procs: Sequence[Any], timeout_s: float) -> None:
    """Block until every started proc's sentinel fires or ``timeout_s`` passes (no reaping)."""
    deadline = Deadline(timeout_s)
    waiting = {p.sentinel: p for p in procs if p.pid is not None}
    while waiting and not deadline.expired():
        for sentinel in multiprocessing.connection.wait(list(waiting), deadline.remaining()):
            waiting.pop(sentinel, None)


def stop_ranks(procs: Sequence[Any], inboxes: Sequence[int], grace_s: float = 10.0) -> None:
    """Stop and reap every rank; blocks at most ``grace_s`` + ~12 s.

    Args:
        procs: the rank processes (some may never have started).
        inboxes: inbox fds to send a cooperative SHUTDOWN to; empty when the runner is unusable
            (survivors could be blocked in a collective and would never read it).
        grace_s: how long cooperative exit may take (seconds).
    """
    if inboxes:
        for fd in inboxes:
            with contextlib.suppress(OSError):
                send_frame(fd, SHUTDOWN)
        _wait_exited(procs, grace_s)
    # SIGCONT + SIGTERM to each rank and its group, grace, SIGKILL of groups and trees, reap
    terminate_processes([p for p in procs if p.pid is not None], _TERM_GRACE_S, groups=True)


def exit_status(proc: Any) -> int | None:
    """Exit code (negative = signal) without reaping, so the rank's pid/pgid stays reserved."""
    if proc.pid is None:
        return None
    deadline = Deadline(2.0)
    while True:  # the sentinel closes a moment before the process becomes waitable
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, AttributeError, OSError):
            return proc.exitcode
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if deadline.expired():
            return None
        time.sleep(0.002)


@contextlib.contextmanager
def sigint_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
