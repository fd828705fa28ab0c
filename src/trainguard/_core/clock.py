"""Monotonic deadlines, chunked waits and backoff. Wall-clock time is never used for timeouts."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

__all__ = ["Deadline", "as_seconds", "backoff_delays", "wait_until"]


def as_seconds(value: float | timedelta, name: str = "timeout") -> float:
    """Convert a public duration (``timedelta`` or seconds) to float seconds.

    Raises:
        TypeError: ``value`` is neither a number nor a ``timedelta``.
    """
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a datetime.timedelta or seconds (float), got {value!r}")
    return float(value)


class Deadline:
    """A point on the monotonic clock ``timeout_s`` seconds from creation."""

    __slots__ = ("end", "start", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.start = time.monotonic()
        self.timeout_s = float(timeout_s)
        self.end = self.start + self.timeout_s

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.end - time.monotonic())

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def chunk(self, interval_s: float) -> float:
        """The next wait slice: ``min(interval_s, remaining())``."""
        return min(interval_s, self.remaining())


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    interval_s: float = 0.01,
    on_tick: Callable[[], None] | None = None,
) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes; returns the last value.

    Prefer waiting on events, sentinels or store keys; this is for conditions with no such handle.
    """
    deadline = Deadline(timeout_s)
    while True:
        if predicate():
            return True
        if deadline.expired():
            return False
        if on_tick is not None:
            on_tick()
        time.sleep(deadline.chunk(interval_s))


def backoff_delays(base_s: float = 0.1, factor: float = 2.0, cap_s: float = 5.0, attempts: int = 5):
    """Yield ``attempts`` exponential backoff delays in seconds, capped at ``cap_s``."""
    delay = base_s
    for _ in range(attempts):
        yield min(delay, cap_s)
        delay *= factor
