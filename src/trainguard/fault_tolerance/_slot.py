"""The per-rank shared-memory slot: heartbeats, section marks and progress, written by the rank.

One slot per local rank, created by the launcher (``_core.shm.ShmSegment``, owner = launcher),
attached by the rank's :class:`~trainguard.fault_tolerance.RankMonitorClient` (writer) and by the
rank monitor and the launcher (readers). Writes are single aligned 8-byte stores of
``time.monotonic_ns()`` values and counters (atomic on x86-64 and arm64), so a heartbeat or a
section mark is one clock read plus ONE store, needs no lock and no system call, and a rank that
is SIGSTOPped mid-write cannot wedge a reader (NVRx's stream IPC can; fault_tolerance.md §8 #10).

Layout version 2 (little-endian int64 words; word index in brackets)::

    [0] magic+version   [1] writer pid      [2] init time (ns)     [3] reserved
    [4] last heartbeat (ns, 0 = none yet)   [5..6] reserved        [7] progress counter
    [8] auto stamp      [9] stacks signal   [10] cycle             [11] last progress (ns)
    [12..15] reserved
    [16 + 2*i] section i: > 0 open since (ns); < 0 closed at -value (ns); 0 never opened
    [17 + 2*i] section i last progress time (ns)
    EXT_OFFSET: extension area of EXT_BYTES bytes (see below)

Version 1 kept a heartbeat count and a "last close" word beside these: two more stores per mark.
The last close of any section is now the largest ``-word`` over the section words
(:meth:`Slot.last_close_ns`).

Sections are addressed by index: the launcher assigns indices to the configured section names
(``FaultToleranceConfig.section_names``) and the client gets the same mapping.

**Extension area** (records from other capabilities, e.g. the straggler detector's window
summaries): ``EXT_BYTES`` bytes at ``EXT_OFFSET``, a ``_core.shm.RecordArea`` (seqlocked
records, no lock). Its place is also written into header words 12 and 13 (offset, size), so a
capability that only knows the slot's name (``TRAINGUARD_FT_SLOT``) finds it without importing
this module. Record kinds: 1 = straggler window summary (JSON, ``trainguard.straggler``).
"""

from __future__ import annotations

import time

from trainguard._core.shm import RecordArea, ShmSegment

__all__ = [
    "EXT_BYTES",
    "EXT_OFFSET",
    "MAX_SECTIONS",
    "SLOT_BYTES",
    "SLOT_MAGIC",
    "Slot",
    "W",
]

SLOT_MAGIC = 0x54475331_00000002  # "TGS1", layout version 2
MAX_SECTIONS = 32
_HEADER_WORDS = 16
EXT_OFFSET = 8 * (_HEADER_WORDS + 2 * MAX_SECTIONS)
EXT_BYTES = 1024
SLOT_BYTES = EXT_OFFSET + EXT_BYTES


class W:
    """Word indices of the slot header."""

    MAGIC, PID, INIT, HB_NS, PROGRESS = 0, 1, 2, 4, 7
    AUTO, STACKS_SIG, CYCLE, PROGRESS_NS = 8, 9, 10, 11
    EXT_AT, EXT_LEN = 12, 13
    SECTIONS = _HEADER_WORDS


class Slot:
    """A mapped slot. ``create=True`` (launcher) makes and owns the segment; otherwise attach.

    Raises:
        FileNotFoundError: attaching to a slot that does not exist (launcher gone).
        ValueError: the segment is not a slot of this layout version.
    """

    def __init__(self, name: str, *, create: bool = False) -> None:
        self.seg = ShmSegment(name, SLOT_BYTES, create=create)
        assert self.seg.buf is not None
        self._head = self.seg.buf[:EXT_OFFSET]
        self.words = self._head.cast("q")
        self.ext = RecordArea(self.seg.buf, EXT_OFFSET, EXT_BYTES)
        if create:
            self.words[W.MAGIC] = SLOT_MAGIC
            self.words[W.EXT_AT], self.words[W.EXT_LEN] = EXT_OFFSET, EXT_BYTES
        elif self.words[W.MAGIC] != SLOT_MAGIC:
            self.close()
            raise ValueError(f"shared-memory slot {name!r} has another layout version")

    @property
    def name(self) -> str:
        return self.seg.name

    def reset(self, cycle: int) -> None:
        """Launcher, between cycles: clear every stamp (no writer attached at that point)."""
        w = self.words
        for i in range(1, len(w)):
            w[i] = 0
        w[W.CYCLE] = cycle
        w[W.EXT_AT], w[W.EXT_LEN] = EXT_OFFSET, EXT_BYTES
        self.ext.clear()

    def get(self, index: int) -> int:
        return int(self.words[index])

    def section_state(self, index: int) -> tuple[int, int]:
        """``(open_ns, last_progress_ns)`` of section ``index`` (open_ns 0 when closed)."""
        base = W.SECTIONS + 2 * index
        return max(0, int(self.words[base])), int(self.words[base + 1])

    def last_close_ns(self, n_sections: int) -> int:
        """When the rank last closed any of its first ``n_sections`` sections (0 = never)."""
        w = self.words
        return max((-int(w[W.SECTIONS + 2 * i]) for i in range(n_sections)), default=0)

    def write_ext(self, kind: int, body: bytes, offset: int = 0) -> None:
        """Write one extension record at ``offset`` inside the extension area (seqlock).

        Raises:
            ValueError: the record does not fit the extension area.
        """
        self.ext.write(kind, body, offset)

    def read_ext(self, offset: int = 0) -> tuple[int, bytes] | None:
        """``(kind, body)`` of the record at ``offset``; None when empty or being written."""
        return self.ext.read(offset)

    def close(self) -> None:
        """Release the mapping (the owner also unlinks the name). Idempotent."""
        words, self.words = getattr(self, "words", None), None  # type: ignore[assignment]
        if words is not None:
            words.release()
            self._head.release()
            self.ext.buf = memoryview(b"")
        self.seg.close()


def now_ns() -> int:
    """The slot's clock: ``CLOCK_MONOTONIC`` in nanoseconds (shared by every process)."""
    return time.monotonic_ns()
