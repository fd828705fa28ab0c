"""NVRx module path ``inprocess.progress_watchdog``: a stand-alone progress watchdog.

:class:`ProgressWatchdog` reports, every ``interval``, a :class:`Timestamp` of the last time the
main thread ran Python bytecode to ``connection.send_timestamp``. The stamp is taken by a
``Py_AddPendingCall`` callback that the main thread runs at its next bytecode boundary (at most
one outstanding), so a main thread stuck in C code stops advancing ``Timestamp.auto``.

trainguard's ``Wrapper`` does not use this class (its watchdog writes into memory shared with
the monitor process, see ``_watchdog``); it exists for code written against NVRx's API.

Follows: NVRx ``inprocess.progress_watchdog`` (constructor, ``start``,
``pause_and_synchronize``, ``resume``, ``shutdown``, ``Timestamp``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from typing import Any

from trainguard._core.clock import as_seconds
from trainguard._core.pending import PendingCallback, add_pending_call
from trainguard.errors import ConfigError

__all__ = ["ProgressWatchdog", "Timestamp"]


@dataclasses.dataclass
class Timestamp:
    """``auto``: ``time.monotonic()`` of the last automatic stamp (None before the first);
    ``manual``: of the last manual ping (None: no manual pings)."""

    auto: float | None = None
    manual: float | None = None


_active: set[ProgressWatchdog] = set()
_lock = threading.Lock()


def _stamp(_arg: int | None) -> int:
    now = time.monotonic()
    with _lock:
        for dog in _active:
            dog._auto = now
            dog._outstanding = False
    return 0


# Never freed: a queued pending call may run after every watchdog stopped.
_CALLBACK = PendingCallback(_stamp)


class ProgressWatchdog:
    """Periodic reporter of main-thread progress (one daemon thread).

    Args:
        rank: for log context only.
        connection: any object with ``send_timestamp(Timestamp)``; called from the watchdog
            thread (and from the caller of :meth:`pause_and_synchronize`/:meth:`shutdown`).
        interval: reporting period (timedelta or seconds, > 0).

    Lifecycle: ``start`` -> (``pause_and_synchronize`` <-> ``resume``)* -> ``shutdown``.
    ``shutdown`` is idempotent and sends one final timestamp; ``resume`` after ``shutdown``
    raises ``RuntimeError``. ``shutdown`` and ``pause_and_synchronize`` block at most a few
    intervals (bounded joins and waits).

    Raises:
        ConfigError: a non-positive interval.
    """

    def __init__(self, rank: int, connection: Any, interval: timedelta | float) -> None:
        self.rank = rank
        self.connection = connection
        self.interval_s = as_seconds(interval, "interval")
        if self.interval_s <= 0:
            raise ConfigError(f"ProgressWatchdog interval must be > 0 s, got {interval!r}")
        self._auto: float | None = None
        self._manual: float | None = None
        self._outstanding = False
        self._running = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"trainguard-progress-watchdog-{rank}", daemon=True
        )

    def start(self) -> None:
        """Start reporting (from the main thread)."""
        self._auto = time.monotonic()  # the caller is running bytecode now
        with _lock:
            _active.add(self)
        self._running.set()
        self._thread.start()

    def ping(self) -> None:
        """Manual progress stamp."""
        self._manual = time.monotonic()

    def _send(self) -> None:
        self.connection.send_timestamp(Timestamp(auto=self._auto, manual=self._manual))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._running.is_set():
                continue
            self._send()
            if not self._outstanding:
                self._outstanding = True
                add_pending_call(_CALLBACK)

    def pause_and_synchronize(self) -> None:
        """Stop reporting until :meth:`resume`; returns once no report is in flight.

        Blocks ``min(2 * interval, 1 s)`` so that a report already in flight completes.
        """
        self._running.clear()
        # the thread checks the flag at most one interval after we cleared it: wait that long
        self._stop.wait(min(2 * self.interval_s, 1.0))

    def resume(self) -> None:
        """Resume reporting. Raises ``RuntimeError`` after :meth:`shutdown`."""
        if self._closed:
            raise RuntimeError("ProgressWatchdog.resume() after shutdown()")
        self._running.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the thread (joined at most ``timeout`` s) and send one final timestamp.

        Idempotent: later calls do nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with _lock:
            _active.discard(self)
        self._auto = time.monotonic()
        self._send()
