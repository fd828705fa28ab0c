"""Process-wide registry of reset callbacks, run when an in-process restart aborts an iteration.

Capabilities never import each other: a capability that owns global helpers (async-checkpoint
workers, straggler detectors, cached singletons bound to a dead process group) registers a
callback here, and the in-process restart's abort step runs them all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from trainguard._core.logging import get_logger

__all__ = ["register_reset_callback", "run_reset_callbacks", "unregister_reset_callback"]

_log = get_logger("trainguard.core.hooks")
_lock = threading.Lock()
_callbacks: dict[str, Callable[[], None]] = {}


def register_reset_callback(name: str, fn: Callable[[], None]) -> None:
    """Register (or replace) callback ``name``; it must be quick and must not raise."""
    with _lock:
        _callbacks[name] = fn


def unregister_reset_callback(name: str) -> None:
    with _lock:
        _callbacks.pop(name, None)


def run_reset_callbacks() -> list[str]:
    """Run every callback (any thread); returns the names whose callback raised (logged)."""
    with _lock:
        items = list(_callbacks.items())
    failed = []
    for name, fn in items:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a reset step must not stop the others
            _log.exception("reset callback %r failed", name)
            failed.append(name)
    return failed
