"""The per-rank shared-memory slot: heartbeats, section marks and progress, written by the rank.

One slot per local rank, created by the launcher (``_core.shm.ShmSegment``, owner = launcher),
attached by the rank's :class:`~trainguard.fault_tolerance.RankMonitorClient` (writer) and by the
rank monitor and the launcher (readers). Writes are single aligned 8-byte stores of
``time.monotonic_ns()`` values and counters (atomic on x86-64 and arm64), so a heartbeat or a
section mark costs well under a microsecond, needs no lock and no system call, and a rank that is
SIGSTOPped mid-write cannot wedge a reader (NVRx's stream IPC can; fault_tolerance.md §8 #10).

Layout (little-endian int64 words; word index in brackets)::

    [0] magic+version   [1] writer pid      [2] init time (ns)     [3] heartbeat count
    [4] last heartbeat  [5] open sections   [6] last section close [7] progress counter
    [8] auto stamp      [9] stacks signal   [10] cycle             [11] last progress (ns)
    [12..15] reserved
    [16 + 2*i] section i open time (0 = closed)   [17 + 2*i] section i last progress time
    EXT_OFFSET: extension area of EXT_BYTES bytes (see below)

Sections are addressed by index: the launcher assigns indices to the configured section names
(``FaultToleranceConfig.section_names``) and the client gets the same mapping.

**Extension area** (for later records, e.g. a straggler summary): ``EXT_BYTES`` bytes at
``EXT_OFFSET``, holding records of ``u16 kind, u16 length, u32 seq`` + body. A writer bumps
``seq`` to an odd value before and an even value after writing the body (seqlock), so readers can
detect a torn record without locks. Unknown kinds are skipped by length.
"""

from __future__ import annotations

import struct
import time

from trainguard._core.shm import ShmSegment

__all__ = [
    "EXT_BYTES",
    "EXT_OFFSET",
    "MAX_SECTIONS",
    "SLOT_BYTES",
    "SLOT_MAGIC",
    "Slot",
    "W",
]

SLOT_MAGIC = 0x54475331_00000001  # "TGS1", layout version 1
MAX_SECTIONS = 32
_HEADER_WORDS = 16
EXT_OFFSET = 8 * (_HEADER_WORDS + 2 * MAX_SECTIONS)
EXT_BYTES = 1024
SLOT_BYTES = EXT_OFFSET + EXT_BYTES
_EXT_HEAD = struct.Struct("<HHI")


class W:
    """Word indices of the slot header."""

    MAGIC, PID, INIT, HB_COUNT, HB_NS, RESERVED5, LAST_CLOSE, PROGRESS = range(8)
    AUTO, STACKS_SIG, CYCLE, PROGRESS_NS = 8, 9, 10, 11
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
        if create:
            self.words[W.MAGIC] = SLOT_MAGIC
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

    def get(self, index: int) -> int:
        return int(self.words[index])

    def section_state(self, index: int) -> tuple[int, int]:
        """``(open_ns, last_progress_ns)`` of section ``index`` (0 when closed)."""
        base = W.SECTIONS + 2 * index
        return int(self.words[base]), int(self.words[base + 1])

    def write_ext(self, kind: int, body: bytes, offset: int = 0) -> None:
        """Write one extension record at ``offset`` inside the extension area (seqlock)."""
        end = offset + _EXT_HEAD.size + len(body)
        if end > EXT_BYTES:
            raise ValueError(f"extension record of {len(body)} bytes does not fit the slot")
        buf = self.seg.buf
        assert buf is not None
        at = EXT_OFFSET + offset
        _, _, seq = _EXT_HEAD.unpack_from(buf, at)
        _EXT_HEAD.pack_into(buf, at, kind, len(body), seq + 1)
        buf[at + _EXT_HEAD.size : at + _EXT_HEAD.size + len(body)] = body
        _EXT_HEAD.pack_into(buf, at, kind, len(body), seq + 2)

    def read_ext(self, offset: int = 0) -> tuple[int, bytes] | None:
        """``(kind, body)`` of the record at ``offset``; None when empty or being written."""
        buf = self.seg.buf
        assert buf is not None
        at = EXT_OFFSET + offset
        kind, length, seq = _EXT_HEAD.unpack_from(buf, at)
        if length == 0 or seq % 2:
            return None
        body = bytes(buf[at + _EXT_HEAD.size : at + _EXT_HEAD.size + length])
        if _EXT_HEAD.unpack_from(buf, at)[2] != seq:
            return None
        return kind, body

    def close(self) -> None:
        """Release the mapping (the owner also unlinks the name). Idempotent."""
        words, self.words = getattr(self, "words", None), None  # type: ignore[assignment]
        if words is not None:
            words.release()
            self._head.release()
        self.seg.close()


def now_ns() -> int:
    """The slot's clock: ``CLOCK_MONOTONIC`` in nanoseconds (shared by every process)."""
    return time.monotonic_ns()
