"""How window summaries travel from ranks to the aggregator: a small interface, two transports.

:class:`SummaryTransport` is what the detector needs: ``publish`` one rank's summary of one
window, ``collect`` whatever summaries of a window have arrived (never waits for missing ranks),
``discard`` a window once scored. :class:`StoreTransport` uses the ``torch.distributed`` store
(one ``append`` per rank and window, one ``check`` + ``get`` per window for the aggregator; no
collective). :class:`MemoryTransport` keeps summaries in a dict, for one-process use and tests.
The launcher's per-rank shared-memory channel (``trainguard launch``) plugs in as a third
implementation of the same interface.
"""

from __future__ import annotations

import abc
import json
import threading
from typing import Any

import torch.distributed as dist

__all__ = ["MemoryTransport", "StoreTransport", "SummaryTransport"]

WindowSummary = dict[str, Any]


class SummaryTransport(abc.ABC):
    """Carries per-rank window summaries (JSON-serialisable dicts with ``rank`` and ``window``).

    Called only from the detector's background thread. Every method returns in bounded time
    (one store round trip for the store transport) and never waits for another rank.
    """

    @abc.abstractmethod
    def publish(self, summary: WindowSummary) -> None:
        """Send this rank's summary of window ``summary["window"]``."""

    @abc.abstractmethod
    def collect(self, window: int) -> dict[int, WindowSummary]:
        """Summaries of ``window`` received so far, keyed by rank (possibly empty)."""

    @abc.abstractmethod
    def discard(self, window: int) -> None:
        """Forget ``window`` (delete its keys); idempotent."""

    def close(self) -> None:
        """Release resources; idempotent."""


class StoreTransport(SummaryTransport):
    """Summaries as JSON lines appended to ``{prefix}/w{window}`` in a c10d store.

    Args:
        store: any ``torch.distributed.Store`` (the default process group's store by default in
            ``Detector.initialize``).
        prefix: key namespace; use one per run (and per restart iteration) so keys never mix.

    Raises:
        RuntimeError: from the store when its connection broke (the detector logs and drops it).
    """

    def __init__(self, store: dist.Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def _key(self, window: int) -> str:
        return f"{self.prefix}/w{window}"

    def publish(self, summary: WindowSummary) -> None:
        line = json.dumps(summary, separators=(",", ":"), allow_nan=True) + "\n"
        self.store.append(self._key(int(summary["window"])), line)  # type: ignore[attr-defined]

    def collect(self, window: int) -> dict[int, WindowSummary]:
        key = self._key(window)
        if not self.store.check([key]):
            return {}
        out: dict[int, WindowSummary] = {}
        for line in self.store.get(key).decode().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[int(rec["rank"])] = rec
        return out

    def discard(self, window: int) -> None:
        try:
            self.store.delete_key(self._key(window))
        except RuntimeError:  # already gone, or a store without delete (FileStore keeps it)
            pass


class MemoryTransport(SummaryTransport):
    """In-process transport (thread-safe); share one instance between simulated ranks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[int, dict[int, WindowSummary]] = {}

    def publish(self, summary: WindowSummary) -> None:
        with self._lock:
            self._windows.setdefault(int(summary["window"]), {})[int(summary["rank"])] = summary

    def collect(self, window: int) -> dict[int, WindowSummary]:
        with self._lock:
            return dict(self._windows.get(window, {}))

    def discard(self, window: int) -> None:
        with self._lock:
            self._windows.pop(window, None)
