"""Coordination over a ``torch.distributed`` store: namespaced keys, barriers, flags.

Two barrier kinds (both wait in chunks on the monotonic clock so callers can keep pinging a
watchdog between chunks):

* counting barrier: each arrival adds its count; the arrival reaching exactly ``count`` sets a done
  flag; a total above ``count`` is an overflow. One key prefix per use (callers namespace by
  iteration, so a persistent store can be reused across calls).
* reentrant barrier: arrivals append rank ids; distinct ids are counted, arriving twice is
  harmless, and a third party may arrive on behalf of a dead rank.

Follows: NVRx inprocess store barriers; differences: no single-use keys across calls (keys are
namespaced by the caller), timeouts raise :class:`StoreBarrierTimeout` (a ``TimeoutError``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

from trainguard._core.clock import Deadline
from trainguard.errors import TrainguardError, TrainguardTimeout

__all__ = [
    "StoreBarrierOverflow",
    "StoreBarrierTimeout",
    "counting_barrier",
    "is_store_timeout",
    "reentrant_arrivals",
    "reentrant_barrier",
    "wait_key",
]


_MAX_POLL_S = 0.05


class StoreBarrierTimeout(TrainguardTimeout):
    """A store barrier did not complete in time; ``arrived`` holds what was known (may be None)."""

    def __init__(self, message: str, arrived: object = None) -> None:
        super().__init__(message)
        self.arrived = arrived


class StoreBarrierOverflow(TrainguardError):
    """More arrivals than the barrier's count (a reused key or a wrong count)."""


def is_store_timeout(exc: BaseException) -> bool:
    """True when ``exc`` is a c10d store wait timeout (not a broken connection)."""
    return isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()


def wait_key(
    store: dist.Store,
    key: str,
    timeout_s: float,
    interval_s: float = 0.5,
    on_tick: Callable[[], None] | None = None,
) -> bool:
    """Wait until ``key`` exists; returns False on timeout. ``on_tick`` runs every ``interval_s``.

    Polls ``store.check`` with a backoff from 1 ms to 50 ms instead of timed ``store.wait``
    calls: every timed-out c10d wait logs two C++ warnings to stderr, which would flood a
    long-running job's log.

    Raises:
        RuntimeError: the store connection broke (c10d ``DistNetworkError``).
    """
    deadline = Deadline(timeout_s)
    next_tick = time.monotonic() + interval_s
    sleep_s = 0.001
    while True:
        if store.check([key]):
            return True
        if deadline.expired():
            return False
        now = time.monotonic()
        if on_tick is not None and now >= next_tick:
            on_tick()
            next_tick = now + interval_s
        time.sleep(min(sleep_s, deadline.remaining()))
        sleep_s = min(sleep_s * 2, _MAX_POLL_S)


def counting_barrier(
    store: dist.Store,
    key: str,
    count: int,
    timeout_s: float,
    arrive: int = 1,
    interval_s: float = 0.5,
    on_tick: Callable[[], None] | None = None,
) -> None:
    """Arrive with ``arrive`` participants and wait until ``count`` have arrived.

    ``timeout_s == 0`` arrives without waiting.

    Raises:
        StoreBarrierOverflow: more than ``count`` arrivals on ``key``.
        StoreBarrierTimeout: ``count`` not reached within ``timeout_s`` seconds.
    """
    total = store.add(f"{key}/count", arrive)
    if total > count:
        raise StoreBarrierOverflow(f"barrier {key!r}: {total} arrivals > count {count}")
    if total == count:
        store.set(f"{key}/done", "1")
    if timeout_s == 0:
        return
    if not wait_key(store, f"{key}/done", timeout_s, interval_s, on_tick):
        arrived = int(store.add(f"{key}/count", 0))
        raise StoreBarrierTimeout(
            f"barrier {key!r}: {arrived}/{count} arrived after {timeout_s:.3f} s", arrived
        )


def reentrant_arrivals(store: dist.Store, key: str) -> set[int]:
    """The distinct rank ids that arrived at reentrant barrier ``key`` so far."""
    if not store.check([f"{key}/ranks"]):
        return set()
    raw = store.get(f"{key}/ranks").decode()
    return {int(x) for x in raw.split(",") if x}


def reentrant_barrier(
    store: dist.Store,
    key: str,
    ranks: Iterable[int],
    count: int,
    timeout_s: float,
    interval_s: float = 0.5,
    on_tick: Callable[[], None] | None = None,
) -> set[int]:
    """Arrive for ``ranks`` (own rank, or dead ranks by a third party) and wait for ``count``.

    Returns the set of arrived ranks. ``timeout_s == 0`` arrives without waiting.

    Raises:
        StoreBarrierTimeout: fewer than ``count`` distinct ranks within ``timeout_s`` seconds;
            ``.arrived`` is the set that did arrive.
    """
    payload = "".join(f"{r}," for r in ranks)
    if payload:
        store.append(f"{key}/ranks", payload)  # type: ignore[attr-defined]  # not in the stub
    arrived = reentrant_arrivals(store, key)
    if len(arrived) >= count:
        store.set(f"{key}/done", "1")
        return arrived
    if timeout_s == 0:
        return arrived
    deadline = Deadline(timeout_s)
    while not deadline.expired():
        if wait_key(store, f"{key}/done", deadline.chunk(interval_s), interval_s):
            return reentrant_arrivals(store, key)
        arrived = reentrant_arrivals(store, key)
        if len(arrived) >= count:  # a third party completed it without setting done
            store.set(f"{key}/done", "1")
            return arrived
        if on_tick is not None:
            on_tick()
    arrived = reentrant_arrivals(store, key)
    raise StoreBarrierTimeout(
        f"barrier {key!r}: {len(arrived)}/{count} ranks arrived after {timeout_s:.3f} s "
        f"(arrived: {sorted(arrived)})",
        arrived,
    )
