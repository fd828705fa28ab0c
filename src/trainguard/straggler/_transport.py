"""How window summaries travel from ranks to the aggregator: a small interface, two transports.

:class:`SummaryTransport` is what the detector needs: ``publish`` one rank's summary of one
window, ``collect`` whatever summaries of a window have arrived (never waits for missing ranks),
``discard`` a window once scored. :class:`StoreTransport` uses the ``torch.distributed`` store
(one ``append`` per rank and window, one ``check`` + ``get`` per window for the aggregator; no
collective). :class:`MemoryTransport` keeps summaries in a dict, for one-process use and tests.
:class:`SlotTransport` is the launcher's per-rank shared-memory channel (``trainguard launch``):
each rank writes its newest summary into the extension area of its slot, where the launcher,
which maps every local rank's slot, reads and scores them (no collective, no store, no socket);
an inner transport still carries summaries for in-job reports.
"""

from __future__ import annotations

import abc
import json
import math
import os
import threading
from typing import Any

import torch.distributed as dist

from trainguard._core.shm import RecordArea, ShmSegment

__all__ = [
    "ENV_SLOT",
    "RECORD_KIND",
    "RECORD_SLOTS",
    "MemoryTransport",
    "SlotTransport",
    "StoreTransport",
    "SummaryTransport",
    "decode_summary",
    "encode_summary",
]

ENV_SLOT = "TRAINGUARD_FT_SLOT"  # set by ``trainguard launch`` for each worker
RECORD_KIND = 1  # extension-record kind of a window summary in a launcher slot
RECORD_SLOTS = 2  # summaries kept per slot: window w at (w % 2) * (extension bytes // 2)
_EXT_AT, _EXT_LEN = 12, 13  # slot header words locating the extension area (see launcher slot)

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


def encode_summary(summary: WindowSummary, limit: int) -> bytes:
    """Compact JSON of ``summary`` in at most ``limit`` bytes.

    Floats are rounded to 4 significant digits; when still too long, named sections are
    dropped, largest name first (the step metrics that scoring needs always stay).

    Raises:
        ValueError: even without sections the summary exceeds ``limit`` bytes.
    """
    def _round(v: Any) -> Any:
        if isinstance(v, float):
            return v if not math.isfinite(v) or v == 0 else float(f"{v:.4g}")
        if isinstance(v, list):
            return [_round(x) for x in v]
        if isinstance(v, dict):
            return {k: _round(x) for k, x in v.items()}
        return v

    small = _round(summary)
    sections = dict(small.get("sections") or {})
    while True:
        small["sections"] = sections
        body = json.dumps(small, separators=(",", ":"), allow_nan=True).encode()
        if len(body) <= limit:
            return body
        if not sections:
            raise ValueError(f"a window summary needs {len(body)} bytes, more than the "
                             f"{limit}-byte slot record")
        sections.pop(max(sections, key=len))


def decode_summary(body: bytes) -> WindowSummary:
    """Inverse of :func:`encode_summary`. Raises ValueError on a malformed record."""
    out = json.loads(body)
    if not isinstance(out, dict) or "rank" not in out or "window" not in out:
        raise ValueError("not a window summary record")
    return out


class SlotTransport(SummaryTransport):
    """Publishes into this rank's launcher slot, and through ``inner`` for in-job reports.

    The slot holds the two newest summaries (window ``w`` in half ``w % 2`` of the extension
    area, :data:`RECORD_SLOTS`), so the launcher, polling every 50 ms, misses none unless two
    windows close between two polls. ``collect``/``discard`` go to ``inner``.

    Args:
        inner: the transport in-job aggregation uses (the store under ``torch.distributed``).
        slot_name: the slot's shared-memory name (default: ``$TRAINGUARD_FT_SLOT``).

    Raises:
        FileNotFoundError: no slot of that name (not under ``trainguard launch``).
        ValueError: the segment does not carry an extension area.
    """

    def __init__(self, inner: SummaryTransport, slot_name: str | None = None) -> None:
        name = slot_name or os.environ.get(ENV_SLOT, "")
        if not name:
            raise FileNotFoundError(f"{ENV_SLOT} is not set: not started by trainguard launch")
        self.inner = inner
        self._seg = ShmSegment(name)
        words = self._seg.buf[: 8 * 16].cast("q")
        at, size = int(words[_EXT_AT]), int(words[_EXT_LEN])
        words.release()
        if size <= 0:
            self._seg.close()
            raise ValueError(f"shared-memory segment {name!r} has no extension area")
        self.area = RecordArea(self._seg.buf, at, size)
        self.published = 0

    @staticmethod
    def available() -> bool:
        """True when this process runs under ``trainguard launch`` (a slot name is set)."""
        return bool(os.environ.get(ENV_SLOT))

    def publish(self, summary: WindowSummary) -> None:
        half = self.area.size // RECORD_SLOTS
        at = (int(summary["window"]) % RECORD_SLOTS) * half
        self.area.write(RECORD_KIND, encode_summary(summary, half - 8), at)
        self.published += 1
        self.inner.publish(summary)

    def collect(self, window: int) -> dict[int, WindowSummary]:
        return self.inner.collect(window)

    def discard(self, window: int) -> None:
        self.inner.discard(window)

    def close(self) -> None:
        self.inner.close()
        area = getattr(self, "area", None)
        if area is not None:
            area.buf = memoryview(b"")
            self._seg.close()
