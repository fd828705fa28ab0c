"""Process-wide registries of callbacks through which capabilities meet without imports.

Capabilities never import each other: a capability that owns global helpers (async-checkpoint
workers, straggler detectors, cached singletons bound to a dead process group) registers a
callback here, and the capability that knows when to act runs them all:

* reset callbacks (+ deferred resets): the in-process restart's abort step;
* standby callbacks: the in-process restart runs them on a reserve (inactive) rank once per
  iteration it waits, so a capability can prepare what the rank needs when it becomes active
  (warm checkpoint writers);
* release callbacks: free process-wide idle resources kept for reuse (pooled writer processes);
  run by ``trainguard.testing.LeakChecker`` before it counts leaked children;
* the restart-loop flag: the in-process restart marks the span of its call
  (:func:`restart_loop`), so a capability can prepare for an abort only where one can happen
  (a spare checkpoint writer: :func:`in_restart_loop`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from trainguard._core.logging import get_logger

__all__ = [
    "defer_to_restart",
    "in_restart_loop",
    "register_release_callback",
    "register_reset_callback",
    "register_standby_callback",
    "restart_loop",
    "run_deferred_resets",
    "run_release_callbacks",
    "run_reset_callbacks",
    "run_standby_callbacks",
    "unregister_reset_callback",
    "unregister_standby_callback",
]

_log = get_logger("trainguard.core.hooks")


class _Registry:
    """Named callbacks of one kind: registered (or replaced) by name, run outside the lock."""

    _lock = threading.Lock()  # one lock for every registry (registration is rare)

    def __init__(self, what: str) -> None:
        self.what = what
        self.fns: dict[str, Callable[[], None]] = {}

    def register(self, name: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self.fns[name] = fn

    def unregister(self, name: str) -> None:
        with self._lock:
            self.fns.pop(name, None)

    def run(self, once: bool = False) -> list[str]:
        """Call every function (``once``: and forget them); returns the names that raised."""
        with self._lock:
            items = list(self.fns.items())
            if once:
                self.fns.clear()
        return _run_each(items, self.what)


_reset = _Registry("reset callback")
_deferred = _Registry("deferred reset")
_standby = _Registry("standby callback")
_release = _Registry("release callback")


def register_reset_callback(name: str, fn: Callable[[], None]) -> None:
    """Register (or replace) callback ``name``; it must be quick and must not raise."""
    _reset.register(name, fn)


def unregister_reset_callback(name: str) -> None:
    _reset.unregister(name)


def run_reset_callbacks() -> list[str]:
    """Run every callback (any thread); returns the names whose callback raised (logged)."""
    return _reset.run()


def register_standby_callback(name: str, fn: Callable[[], None]) -> None:
    """Register (or replace) standby callback ``name``: called in the main thread of a reserve
    rank while it waits; it must return at once (start a thread for slow work) and not raise."""
    _standby.register(name, fn)


def unregister_standby_callback(name: str) -> None:
    _standby.unregister(name)


def run_standby_callbacks() -> list[str]:
    """Run every standby callback; returns the names whose callback raised (logged)."""
    return _standby.run()


def register_release_callback(name: str, fn: Callable[[], None]) -> None:
    """Register (or replace) release callback ``name``: stops idle resources kept for reuse
    (bounded: seconds at most); must not raise."""
    _release.register(name, fn)


def run_release_callbacks() -> list[str]:
    """Run every release callback (any thread); returns the names whose callback raised."""
    return _release.run()


def defer_to_restart(name: str, fn: Callable[[], None]) -> None:
    """Queue ``fn`` (keyed by ``name``) for :func:`run_deferred_resets`.

    Reset callbacks run in the restart's monitor thread while the main thread may still be
    inside the aborted iteration (in a collective, a finalize, a writer wait). A callback
    must therefore only unblock there (signal a process, shut a socket) and defer the reset of
    state the main thread uses (queues, process groups, handles) to this queue, which the
    restart loop drains in the main thread once the aborted iteration has unwound.
    """
    _deferred.register(name, fn)


def run_deferred_resets() -> list[str]:
    """Run (once) what reset callbacks deferred; main thread, between iterations. Returns the
    names whose function raised (logged)."""
    return _deferred.run(once=True)


def _run_each(items: list[tuple[str, Callable[[], None]]], what: str) -> list[str]:
    """Call every function outside the lock; a raising one is logged and the rest still run."""
    failed = []
    for name, fn in items:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a reset step must not stop the others
            _log.exception("%s %r failed", what, name)
            failed.append(name)
    return failed


_loops = {"depth": 0}


@contextlib.contextmanager
def restart_loop() -> Iterator[None]:
    """Mark the calling span as inside an in-process restart loop (``inprocess.Wrapper``'s call;
    nestable, any thread). Never blocks."""
    with _Registry._lock:
        _loops["depth"] += 1
    try:
        yield
    finally:
        with _Registry._lock:
            _loops["depth"] -= 1


def in_restart_loop() -> bool:
    """True while an in-process restart loop runs in this process (see :func:`restart_loop`):
    a fault may then abort the current iteration and kill what it was using."""
    return _loops["depth"] > 0
