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

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch.distributed as dist

from trainguard._core.clock import Deadline
from trainguard.errors import TrainguardError, TrainguardTimeout

__all__ = [
    "DeadlineStore",
    "StoreBarrierOverflow",
    "StoreBarrierTimeout",
    "StoreCallTimeout",
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


class StoreCallTimeout(TrainguardTimeout):
    """A store call did not return within its deadline (the link may be dead: the call's thread
    is abandoned and the next call opens a fresh connection)."""


_T = TypeVar("_T")


class DeadlineStore:
    """Runs every call on a ``torch.distributed`` store under its own deadline.

    A c10d client blocked on a dead link can stay blocked far beyond its own timeout (measured:
    > 85 s with a 6 s store timeout after the host's link went down), so each call runs on a
    worker thread and the caller waits at most ``deadline_s`` seconds. A call that overruns
    abandons its worker thread and connection (a daemon thread, left to finish or fail on its
    own); the next call builds a new connection from ``factory`` on a new thread (so does the
    call after one that raised a ``RuntimeError``/``OSError``: a store that comes back, or a
    link that flapped, is reached again). Calls from
    several threads are serialised on one connection: give a thread that must never wait behind
    another (a lease renewer) its own ``DeadlineStore``.

    Args:
        factory: builds a connected store; runs on the worker thread, under the call's deadline.
        deadline_s: default seconds a call (including a reconnect) may take.
        name: thread-name suffix, for debugging.
    """

    def __init__(self, factory: Callable[[], dist.Store], deadline_s: float,
                 name: str = "store") -> None:
        self._factory = factory
        self.deadline_s = float(deadline_s)
        self._name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] | None = None
        self._closed = False

    def _worker(self, jobs: queue.SimpleQueue[Any]) -> None:
        store: dist.Store | None = None
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                if store is None:
                    store = self._factory()
                box.append((True, fn(store)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if isinstance(exc, (RuntimeError, OSError)):
                    store = None  # c10d errors (a broken pipe...): reconnect on the next call
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[dist.Store], _T], deadline_s: float | None = None) -> _T:
        """Run ``fn(store)`` and return its result; blocks at most ``deadline_s`` seconds
        (default: the constructor's) plus the wait for calls of other threads queued ahead.

        Raises:
            StoreCallTimeout: no result within the deadline (the connection is dropped).
            Exception: whatever ``fn`` or the store factory raised (e.g. c10d
                ``DistNetworkError`` for a refused connection).
        """
        limit = self.deadline_s if deadline_s is None else deadline_s
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        with self._lock:
            if self._closed:
                raise RuntimeError("DeadlineStore is closed")
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._worker, args=(self._queue,), daemon=True,
                                 name=f"tg-store-{self._name}").start()
            jobs = self._queue
            jobs.put((fn, box, done))
            if not done.wait(limit):
                jobs.put(None)  # the worker exits once (if ever) its call returns
                self._queue = None
                raise StoreCallTimeout(f"store call did not return within {limit:.3g} s "
                                       f"({self._name}); the connection was dropped")
        ok, value = box[0]
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def close(self) -> None:
        """Stop the worker thread (never blocks; a call in flight is abandoned)."""
        with self._lock:
            self._closed = True
            if self._queue is not None:
                self._queue.put(None)
                self._queue = None
