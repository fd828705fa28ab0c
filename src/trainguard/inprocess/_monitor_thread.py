"""Monitor thread (trainer side) and delivery of the restart interrupt to the main thread.

:class:`MonitorThread` (one per iteration, daemon, own store connection) waits on the
iteration's "interrupted" key. When it appears it waits ``last_call_wait`` to collect concurrent
faults, reads the records, takes the ``atomic()`` lock (a blocking acquire, no spinning), runs
``abort`` and the registered reset callbacks, then interrupts the main thread through
:class:`Interrupter`.

:class:`Interrupter` raises :class:`RankShouldRestart` in the main thread exactly once per
iteration. On the main thread it sends a real-time signal with ``signal.pthread_kill``; the
handler (installed only while the wrapper runs) raises, and the signal also breaks blocking
system calls such as ``time.sleep`` or ``socket.recv`` (EINTR). Where no handler of ours is in
place (wrapper on another thread, handler replaced by user code) it falls back to
``PyThreadState_SetAsyncExc``, delivered at the next bytecode boundary. An undelivered interrupt
is re-sent every ``resend_s`` (never in a tight loop).

Follows: NVRx MonitorThread; differences: signal delivery for C-call hangs, one raise per
iteration (no endless re-raise), no busy waiting.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from trainguard._core.hooks import run_reset_callbacks
from trainguard._core.logging import get_logger
from trainguard.inprocess import _coord as co
from trainguard.inprocess.exceptions import RankShouldRestart

__all__ = ["Interrupter", "MonitorThread", "RestartInfo"]

_log = get_logger("trainguard.inprocess")
INTERRUPT_SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGUSR2) + (
    5 if hasattr(signal, "SIGRTMIN") else 0
)


def _set_async_exc(ident: int, exc: type | None) -> None:
    fn = ctypes.pythonapi.PyThreadState_SetAsyncExc
    fn(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(0))


class Interrupter:
    """Delivers one :class:`RankShouldRestart` per :meth:`arm` to the wrapper's thread."""

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.on_main = threading.current_thread() is threading.main_thread()
        self._lock = threading.Lock()
        self._pending: str | None = None
        self._claimed = True
        self._prev = None
        self._installed = False

    def install(self) -> None:
        """Install the signal handler (main thread only); undone by :meth:`restore`."""
        if self.on_main:
            self._prev = signal.signal(INTERRUPT_SIGNAL, self._handler)
            self._installed = True

    def restore(self) -> None:
        self.close()
        self.restore_unraisable_hook()
        if self._installed:
            signal.signal(INTERRUPT_SIGNAL, self._prev)
            self._installed = False

    def arm(self) -> None:
        with self._lock:
            self._pending, self._claimed = None, False

    @property
    def claimed(self) -> bool:
        return self._claimed

    def fire(self, summary: str) -> None:
        """Interrupt the main thread (monitor thread); later calls only re-send."""
        with self._lock:
            if self._claimed:
                return
            self._pending = summary
        if self._installed and signal.getsignal(INTERRUPT_SIGNAL) == self._handler:
            signal.pthread_kill(self.ident, INTERRUPT_SIGNAL)
        else:
            _set_async_exc(self.ident, RankShouldRestart)

    def unclaim(self) -> None:
        """The delivered interrupt was swallowed (e.g. raised inside ``__del__``): deliver anew."""
        with self._lock:
            if self._pending is None:
                return
            self._claimed = False
            summary = self._pending
        # Not from here: a signal to ourselves would run its handler inside the hook again.
        threading.Timer(0.01, self.fire, args=(summary,)).start()

    def install_unraisable_hook(self) -> None:
        """Catch a RankShouldRestart that CPython reports as unraisable and re-deliver it."""
        self._prev_unraisable = sys.unraisablehook

        def hook(unraisable) -> None:
            if unraisable.exc_type is not None and issubclass(unraisable.exc_type,
                                                              RankShouldRestart):
                self.unclaim()
            else:
                self._prev_unraisable(unraisable)

        sys.unraisablehook = hook

    def restore_unraisable_hook(self) -> None:
        prev = getattr(self, "_prev_unraisable", None)
        if prev is not None:
            sys.unraisablehook = prev
            self._prev_unraisable = None

    def _handler(self, signum, frame) -> None:
        with self._lock:
            if self._claimed or self._pending is None:
                return
            self._claimed = True
            summary = self._pending
        raise RankShouldRestart(summary)

    def acknowledge(self) -> None:
        """Main thread caught the interrupt: no further delivery this iteration."""
        with self._lock:
            self._claimed = True
        _set_async_exc(self.ident, None)  # clears an undelivered async exception

    def close(self) -> None:
        self.acknowledge()


@dataclasses.dataclass
class RestartInfo:
    records: list
    interrupt_time: float


_POLL_S = 0.02


class MonitorThread(threading.Thread):
    """Watches one iteration for interruptions (see module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        keys: co.Keys,
        iteration: int,
        abort: Callable | None,
        frozen_state_fn: Callable,
        interrupter: Interrupter,
        atomic_lock: threading.RLock,
        interval_s: float,
        last_call_wait_s: float,
        resend_s: float,
    ) -> None:
        super().__init__(name=f"trainguard-monitor-it{iteration}", daemon=True)
        self.store, self.keys, self.iteration = store, keys, iteration
        self.abort, self.frozen_state_fn = abort, frozen_state_fn
        self.interrupter, self.atomic_lock = interrupter, atomic_lock
        self.interval_s, self.last_call_wait_s, self.resend_s = (
            interval_s, last_call_wait_s, resend_s)
        self._state_lock = threading.Lock()
        self._stopped = threading.Event()
        self.firing = False
        self.info: RestartInfo | None = None
        self.conn_fds: set[int] = set()

    def run(self) -> None:
        key = self.keys.it(self.iteration, "interrupted")
        # Poll with check() rather than timed store.wait(): every timed-out c10d wait logs two
        # C++ warnings (a flood over a long run), and ending a wait early means shutting its
        # socket, which logs a stack trace. A poll costs one store round trip (~50 us).
        poll_s = min(self.interval_s, _POLL_S)
        try:
            while not self._stopped.is_set():
                if not self.store.check([key]):
                    self._stopped.wait(poll_s)
                    continue
                self._terminate()
                return
        except Exception:  # noqa: BLE001 - store gone at shutdown; log and leave
            if not self._stopped.is_set():
                _log.exception("monitor thread of iteration %d failed", self.iteration)

    def _terminate(self) -> None:
        if self._stopped.wait(self.last_call_wait_s):
            return
        records = co.read_interruptions(self.store, self.keys, self.iteration)
        while not self.atomic_lock.acquire(timeout=self.interval_s):
            if self._stopped.is_set():
                return
        try:
            with self._state_lock:
                if self._stopped.is_set():
                    return
                self.firing = True
            self.info = RestartInfo(records, time.time())
            self._run_abort()
            self.interrupter.fire(co.summarize(records))
        finally:
            self.atomic_lock.release()
        # Until the main thread takes over (stop), re-send an undelivered or swallowed interrupt.
        while not self._stopped.wait(self.resend_s):
            if not self.interrupter.claimed:
                _log.warning("restart interrupt not yet delivered; sending it again")
                self.interrupter.fire(co.summarize(records))

    def _run_abort(self) -> None:
        if self.abort is not None:
            try:
                self.abort(self.frozen_state_fn())
            except Exception:  # noqa: BLE001 - abort errors are logged only
                _log.exception("abort hook failed")
        run_reset_callbacks()

    def stop(self) -> bool:
        """Stop watching; returns True if an interrupt is already being delivered."""
        with self._state_lock:
            self._stopped.set()
            return self.firing

    def close(self, timeout_s: float) -> None:
        """Stop and join (at most ``timeout_s`` s). A thread still inside a store wait at
        interpreter exit makes the C++ runtime abort, so its connection is shut to end the
        wait at once (``conn_fds``: descriptors of this thread's own store connection)."""
        self._stopped.set()
        if not self.is_alive() or self is threading.current_thread():
            return
        self.join(timeout_s)
        if self.is_alive():  # stuck in a store call: end it by shutting its connection
            for fd in self.conn_fds:
                _shutdown_socket(fd)
            self.join(0.5)


def _shutdown_socket(fd: int) -> None:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def open_fds() -> set[int]:
    """This process's open descriptors (empty where /proc is missing)."""
    try:
        return {int(x) for x in os.listdir("/proc/self/fd")}
    except OSError:
        return set()


