"""Process handling for benchmarks: launch rank groups, bound them in time, reap everything.

Ranks run in their own sessions (a terminal's Ctrl-C reaches only the benchmark, which then stops
them). The benchmark makes itself a child subreaper, so daemons that double-fork away from a rank
(NVRx's monitor process, for one) are re-parented to it and are found and reaped on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from types import FrameType

import psutil

from trainguard._core.procs import terminate_processes

__all__ = ["RankGroup", "become_subreaper", "exit_on_signals", "kill_descendants"]

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux ``prctl``); returns False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def kill_descendants(grace_s: float = 3.0) -> list[int]:
    """SIGTERM -> ``grace_s`` -> SIGKILL every live descendant, and reap; returns pids killed."""
    pids = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                pids.append(child.pid)
    if pids:
        terminate_processes(pids, grace_s=grace_s)
    _reap_zombies()
    return pids


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into exceptions so ``finally`` blocks stop the ranks.

    SIGINT is installed explicitly: a shell starts background jobs with SIGINT ignored.
    """

    def _raise(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, _raise) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class RankGroup:
    """Processes started together, logged to files, waited on against one deadline.

    Use as a context manager: leaving it (normally, on error or Ctrl-C) stops and reaps the
    processes and every descendant they left behind.
    """

    def __init__(self, log_dir: str, name: str) -> None:
        self.log_dir = log_dir
        self.name = name
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: Sequence[str], env: dict[str, str], tag: str) -> subprocess.Popen:
        with open(os.path.join(self.log_dir, f"{self.name}_{tag}.log"), "wb") as log:
            proc = subprocess.Popen(
                list(cmd),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # the child keeps its own copy of the log descriptor
        self.procs.append(proc)
        return proc

    def wait(self, timeout_s: float) -> tuple[list[int | None], bool]:
        """Wait for all processes; returns (exit codes, timed_out). Never blocks past timeout_s."""
        end = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                return [p.poll() for p in self.procs], True
        return [p.returncode for p in self.procs], False

    def log_tail(self, tag: str, lines: int = 15) -> str:
        path = os.path.join(self.log_dir, f"{self.name}_{tag}.log")
        try:
            with open(path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> RankGroup:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        kill_descendants()
