"""Process utilities: spawn context, sentinel waits, terminate-with-grace, reaping.

Shutdown always escalates SIGTERM -> grace -> SIGKILL -> reap against one monotonic deadline, and
works on ``multiprocessing`` processes, ``subprocess.Popen`` objects and bare pids alike.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import time
from collections.abc import Iterable

import psutil

from trainguard._core.clock import Deadline

__all__ = [
    "ProcLike",
    "describe_exit",
    "pid_alive",
    "spawn_context",
    "terminate_pids",
    "terminate_processes",
]

ProcLike = multiprocessing.process.BaseProcess | subprocess.Popen


def spawn_context() -> multiprocessing.context.SpawnContext:
    """The ``spawn`` context: no forked copies of torch/CUDA state or threads."""
    return multiprocessing.get_context("spawn")


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def describe_exit(exitcode: int | None) -> str:
    """Human text for a ``multiprocessing`` / ``Popen`` exit code (negative = signal)."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _signal(proc: ProcLike, sig: int) -> None:
    try:
        if isinstance(proc, subprocess.Popen):
            if proc.poll() is None:
                proc.send_signal(sig)
        elif proc.pid is not None and proc.exitcode is None:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, OSError):
        pass


def _alive(proc: ProcLike) -> bool:
    if isinstance(proc, subprocess.Popen):
        return proc.poll() is None
    return proc.pid is not None and proc.exitcode is None and proc.is_alive()


def _join(proc: ProcLike, timeout_s: float) -> None:
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            pass
    elif proc.pid is not None:
        proc.join(max(timeout_s, 0.0))


def terminate_processes(
    procs: Iterable[ProcLike], grace_s: float = 5.0, first_signal: int = signal.SIGTERM
) -> None:
    """Stop every process: ``first_signal``, wait up to ``grace_s``, SIGKILL survivors, reap.

    Stopped (SIGSTOP) processes are sent SIGCONT first so they can act on SIGTERM.
    Blocks at most ``grace_s`` + 5 s. Safe on processes that already exited or never started.
    """
    procs = [p for p in procs if p is not None]
    for p in procs:
        _signal(p, signal.SIGCONT)
        _signal(p, first_signal)
    deadline = Deadline(grace_s)
    for p in procs:
        _join(p, deadline.remaining())
    for p in procs:
        if _alive(p):
            _signal(p, signal.SIGKILL)
    reap = Deadline(5.0)
    for p in procs:
        _join(p, reap.remaining())


def terminate_pids(pids: Iterable[int], grace_s: float = 5.0) -> list[int]:
    """Like :func:`terminate_processes` for bare pids (not necessarily our children).

    Returns the pids still alive after SIGKILL (normally empty).
    """
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return [p.pid for p in alive]


def sleep_precise(duration_s: float) -> None:
    """Sleep on the monotonic clock (used by fault injection and benchmarks)."""
    end = time.monotonic() + duration_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(left)
