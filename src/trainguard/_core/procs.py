"""Process utilities: spawn context, exit descriptions, and the one process-shutdown routine.

:func:`terminate_processes` is the only shutdown mechanism in trainguard. It works on
``multiprocessing`` processes, ``subprocess.Popen`` objects and bare pids alike, and always
escalates against one monotonic deadline:

1. snapshot each target's descendants (psutil, by parent pid: this also finds descendants that
   called ``setsid``/``setpgid`` and left the process group);
2. SIGCONT (a stopped process cannot act on a signal) and ``first_signal`` to each target's main
   process (and, with ``groups=True``, to its process group);
3. wait up to ``grace_s`` for the targets to exit (pidfd/sentinel waits, no sleep-polling);
4. SIGKILL every survivor of the whole tree (targets, the descendants seen in step 1 and any
   seen now, and the groups with ``groups=True``);
5. reap our own children and wait for the rest, bounded by the same deadline.

Follows: torchelastic ``MultiprocessContext._close`` (signal, one deadline, SIGKILL, join);
differences: the whole tree including setsid descendants, SIGCONT first, a bounded final reap.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable

import psutil

from trainguard._core.clock import Deadline

__all__ = [
    "ExitWatch",
    "ProcLike",
    "describe_exit",
    "descendants",
    "pid_alive",
    "spawn_context",
    "terminate_processes",
]

ProcLike = multiprocessing.process.BaseProcess | subprocess.Popen
Target = ProcLike | int

REAP_S = 5.0  # after SIGKILL: how long the final reap may take (seconds)


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


def exit_status(pid: int) -> str:
    """How child ``pid`` ended (``killed by signal SIGKILL``, ``exit code 3``) without reaping
    it (``waitid`` with ``WNOWAIT``: its owner's ``Popen.poll`` still gets the status); ``exited``
    when that cannot be read (already reaped, or not our child). Never blocks."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except (ChildProcessError, OSError, AttributeError):
        return "exited"
    if info is None:
        return "still running"
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return describe_exit(-info.si_status)
    return describe_exit(info.si_status)


class ExitWatch:
    """Call ``on_exit(pid, how)`` from a named daemon thread as soon as process ``pid`` exits
    (``how`` as :func:`exit_status` gives it), unless :meth:`cancel` came first.

    The thread waits on a pidfd (the kernel's exit notification, no polling) in chunks of
    ``CHUNK_S`` and never reaps the process: its owner keeps its exit status. Use it to notice an
    idle helper process dying (a SIGKILL, the OOM killer) when nothing reads its pipe; cancel it
    before stopping the process on purpose. Without pidfds (Linux < 5.3) it watches nothing.
    """

    CHUNK_S = 5.0  # each wait is bounded; cancel() wakes the thread at once anyway

    def __init__(self, pid: int, on_exit: Callable[[int, str], None], name: str) -> None:
        self.pid = pid
        self._on_exit = on_exit
        self._cancelled = threading.Event()
        self._fds_lock = threading.Lock()  # the wake pipe is closed by the thread, under it
        self._fds_open = False
        self._thread: threading.Thread | None = None
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        self._wake_r, self._wake_w = os.pipe()
        self._fds_open = True
        self._thread = threading.Thread(target=self._run, args=(pidfd,), name=name, daemon=True)
        self._thread.start()

    def _run(self, pidfd: int) -> None:
        try:
            while not self._cancelled.is_set():
                ready = select.select([pidfd, self._wake_r], [], [], self.CHUNK_S)[0]
                if pidfd in ready and not self._cancelled.is_set():
                    self._on_exit(self.pid, exit_status(self.pid))
                    return
        finally:
            with self._fds_lock:
                self._fds_open = False
                for fd in (pidfd, self._wake_r, self._wake_w):
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def cancel(self, timeout_s: float = 2.0) -> None:
        """Stop watching (idempotent, any thread); joins the thread for up to ``timeout_s`` s.
        Called from ``on_exit`` itself it only marks the watch cancelled."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        thread = self._thread
        if thread is None:
            return
        with self._fds_lock, contextlib.suppress(OSError):
            if self._fds_open:
                os.write(self._wake_w, b"x")
        if thread is not threading.current_thread():
            thread.join(timeout_s)


def _own_lineage() -> set[int]:
    """This process and its ancestors: never signalled, even when found in a target's tree."""
    me = psutil.Process()
    out = {me.pid}
    with contextlib.suppress(psutil.Error):
        out.update(p.pid for p in me.parents())
    return out


def descendants(pids: Iterable[int]) -> list[psutil.Process]:
    """Every live descendant of ``pids`` (by parent pid, so setsid descendants are included),
    excluding the calling process and its ancestors. Never raises for vanished pids."""
    skip = _own_lineage()
    out: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            if child.pid not in skip:
                out.setdefault(child.pid, child)
    return list(out.values())


class _Root:
    """One target: its pid, our handle on it (if any) and a pidfd to wait on."""

    def __init__(self, target: Target) -> None:
        self.handle = None if isinstance(target, int) else target
        self.pid: int | None = target if isinstance(target, int) else target.pid
        self.pidfd: int | None = None
        self.done = self.pid is None or not self._running()  # pid kept: its group may live on
        if self.done or self.pid is None:
            return
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def _running(self) -> bool:
        h = self.handle
        if isinstance(h, subprocess.Popen):
            return h.poll() is None
        if h is not None:
            return h.exitcode is None
        return psutil.pid_exists(self.pid or 0)  # a zombie still needs its reap

    def signal(self, sig: int, group: bool = False) -> None:
        if self.pid is None:
            return
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)  # only meaningful when it leads its group
        if self._exited():
            return  # exited (maybe unreaped): its pid is not ours to signal any more
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)

    def _exited(self) -> bool:
        if self.pid is None or self.done:
            return True
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return not self._running()

    def reap(self, timeout_s: float) -> bool:
        """Collect the exit status if the target is our child; True once it is gone."""
        h = self.handle
        if self.pid is None or self.done:
            return True
        if isinstance(h, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.wait(timeout=max(timeout_s, 0.0))
            return h.poll() is not None
        if h is not None:
            h.join(max(timeout_s, 0.0))
            return h.exitcode is not None
        if not _wait_fds([self.pidfd] if self.pidfd is not None else [], timeout_s):
            return not pid_alive(self.pid)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, os.WNOHANG)
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _live_pids(roots: list[_Root]) -> list[int]:
    return [r.pid for r in roots if r.pid is not None and not r.done]


def _pid_of(target: Target) -> int | None:
    return target if isinstance(target, int) else target.pid


def _wait_fds(fds: list[int], timeout_s: float) -> bool:
    """Block until every pidfd in ``fds`` is readable (its process exited) or the timeout."""
    deadline = Deadline(timeout_s)
    pending = list(fds)
    while pending:
        ready, _, _ = select.select(pending, [], [], deadline.remaining())
        pending = [fd for fd in pending if fd not in ready]
        if pending and deadline.expired():
            return False
    return True


def _wait_gone(procs: list[psutil.Process], deadline: Deadline) -> list[int]:
    """Wait for killed descendants to vanish (reaping those adopted by us); returns survivors."""
    def alive() -> list[psutil.Process]:
        out = []
        for p in procs:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, os.WNOHANG)  # ours when we are their subreaper
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    left = alive()
    while left and not deadline.expired():
        time.sleep(deadline.chunk(0.01))  # not our children: no handle to wait on
        left = alive()
    return [p.pid for p in left]


def _wait_roots(roots: list[_Root], deadline: Deadline) -> None:
    fds = [r.pidfd for r in roots if r.pidfd is not None]
    _wait_fds(fds, deadline.remaining())
    for r in roots:  # no pidfd (old kernel): the handle's own bounded wait
        if r.pidfd is None and r.pid is not None and not deadline.expired():
            r.reap(deadline.remaining())


def terminate_processes(
    targets: Iterable[Target | None],
    grace_s: float = 5.0,
    first_signal: int = signal.SIGTERM,
    *,
    groups: bool = False,
    tree: bool = True,
) -> list[int]:
    """Stop every target and its process tree; see the module docstring for the steps.

    Args:
        targets: ``multiprocessing`` processes, ``Popen`` objects or pids (``None`` and processes
            that never started or already exited are skipped).
        grace_s: seconds the main processes get to act on ``first_signal`` before SIGKILL.
        first_signal: the polite signal (SIGKILL skips the grace period).
        groups: also signal each target's process group (targets that lead their own group;
            reaches grandchildren orphaned before the call).
        tree: also SIGKILL the targets' descendants at the end.

    Returns:
        pids still alive after SIGKILL (normally empty).

    Blocks at most ``grace_s`` + :data:`REAP_S` seconds. Safe on processes that already exited;
    the calling process is never signalled, nor are its ancestors unless named in ``targets``
    (a monitor process stopping its own trainer).
    """
    me = os.getpid()  # a named target is signalled even if it is our ancestor (a monitor's
    # trainer), but never the caller itself; descendants skip the caller and its ancestors
    roots = [_Root(t) for t in targets if t is not None and _pid_of(t) != me]
    live = [r for r in roots if r.pid is not None and (groups or not r.done)]
    polite = Deadline(0.0 if first_signal == signal.SIGKILL else max(grace_s, 0.0))
    end = Deadline(polite.timeout_s + REAP_S)
    seen = {p.pid: p for p in descendants(_live_pids(live))} if tree else {}
    try:
        for r in live:
            r.signal(signal.SIGCONT, groups)
            r.signal(first_signal, groups)
        _wait_roots(live, polite)
        if tree:
            for p in descendants(_live_pids(live)):
                seen.setdefault(p.pid, p)
        for r in live:
            r.signal(signal.SIGKILL, groups)
        for p in seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the creation time: a reused pid is never hit
        survivors = [r.pid for r in live if r.pid and not r.reap(end.remaining())]
        return survivors + _wait_gone(list(seen.values()), end)
    finally:
        for r in roots:
            r.close()
