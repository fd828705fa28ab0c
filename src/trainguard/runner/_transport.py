"""Payload transport: pickle protocol 5 with large contiguous buffers carried in shared memory.

A message body is::

    u16 name length | u32 span count | name | (u64 offset, u64 length) * count | pickle bytes

Contiguous buffers of at least :data:`INLINE_LIMIT` bytes (NumPy arrays, ``bytearray``) leave the
pickle stream out of band and are copied once into the writer's :class:`ShmSlot`; everything else
(small objects, torch tensors, non-contiguous arrays) stays inline in the pickle bytes, which ride
the pipe.

Receiving, ``transfer="copy"`` (default) copies each span into a pooled, pre-faulted buffer that
the receiver reuses for the next message only when no array from the previous one is still alive
(checked by reference count), so steady-state calls pay no page faults and received arrays are
never overwritten behind the user's back; a rank replaces a kept buffer after its reply
(:meth:`Receiver.replenish`), off the caller's critical path. ``transfer="view"`` hands out
read-only views of the shared block itself: zero copies, valid only until the next call.

Follows: reactor-runtime SharedSlot headers and vLLM's out-of-band pickling, with pooled buffers.
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import Any

from trainguard._core.logging import get_logger
from trainguard._core.shm import ShmSegment, ShmSlot

__all__ = ["INLINE_LIMIT", "TRANSFER_MODES", "Receiver", "Sender"]

INLINE_LIMIT = 64 * 1024  # bytes; smaller buffers are cheaper inline than through a span
TRANSFER_MODES = ("copy", "view")
_ALIGN = 64
_HEAD = struct.Struct("<HI")
_SPAN = struct.Struct("<QQ")
_WARN_INLINE = 1 << 20
_POOL_SIZE = 3  # receive buffers per receiver
_log = get_logger("trainguard.runner")


class Sender:
    """Encodes objects for one writer. ``prefix`` names its slot's segments; one thread only."""

    _warned = False  # the inline-payload warning is logged once per process

    def __init__(self, prefix: str, reserve_bytes: int = 0) -> None:
        self.slot = ShmSlot(prefix, reserve_bytes)

    def encode(self, obj: Any) -> bytes:
        """Pickle ``obj``; out-of-band buffers go to shared memory.

        Raises:
            ShmAllocationError: the slot could not grow to hold the buffers.
            pickle.PicklingError, TypeError, AttributeError: ``obj`` is not picklable.
        """
        raws: list[memoryview] = []

        def keep_inline(pb: pickle.PickleBuffer) -> bool:
            try:
                raw = pb.raw()
            except BufferError:  # not contiguous
                return True
            if raw.nbytes < INLINE_LIMIT:
                return True
            raws.append(raw)
            return False

        data = pickle.dumps(obj, protocol=5, buffer_callback=keep_inline)
        if len(data) > _WARN_INLINE and not Sender._warned:
            Sender._warned = True
            _log.warning("a %.1f MiB payload travels inline through the pipe (torch tensors and "
                         "non-contiguous arrays are pickled in-band); send contiguous NumPy arrays "
                         "to use shared memory", len(data) / (1 << 20))
        if not raws:
            return _HEAD.pack(0, 0) + data
        spans, offset = [], 0
        for raw in raws:
            spans.append((offset, raw.nbytes))
            offset += -(-raw.nbytes // _ALIGN) * _ALIGN
        seg = self.slot.reserve(offset)
        buf = seg.buf
        for raw, (off, size) in zip(raws, spans):
            buf[off:off + size] = raw
        name = seg.name.encode()
        parts = [_HEAD.pack(len(name), len(spans)), name]
        parts += [_SPAN.pack(off, size) for off, size in spans]
        parts.append(data)
        return b"".join(parts)

    def release_name(self) -> None:
        """Unlink the current segment's name; call once every reader has attached it."""
        self.slot.unlink_name()

    def close(self) -> None:
        self.slot.close()


class Receiver:
    """Decodes bodies from one writer; keeps its mapping of the writer's current segment."""

    def __init__(self, transfer: str = "copy") -> None:
        if transfer not in TRANSFER_MODES:
            raise ValueError(f"transfer must be one of {TRANSFER_MODES}, got {transfer!r}")
        self.transfer = transfer
        self._seg: ShmSegment | None = None
        self._pool: list[bytearray] = []
        self._last_nbytes = 0  # size of the last copied-out message (bytes)

    def decode(self, body: memoryview | bytes) -> Any:
        """Rebuild the object encoded by :meth:`Sender.encode`.

        Raises:
            FileNotFoundError: the named segment is gone (the writer exited).
        """
        body = memoryview(body)
        name_len, count = _HEAD.unpack_from(body, 0)
        if count == 0:
            return pickle.loads(body[_HEAD.size:])
        pos = _HEAD.size + name_len
        name = bytes(body[_HEAD.size:pos]).decode()
        spans = [_SPAN.unpack_from(body, pos + i * _SPAN.size) for i in range(count)]
        data = body[pos + count * _SPAN.size:]
        src = self._attach(name).buf
        if self.transfer == "view":
            buffers = [src[off:off + size].toreadonly() for off, size in spans]
        else:
            buffers = self._copy_out(src, spans)
        return pickle.loads(data, buffers=buffers)

    def attach(self, name: str) -> None:
        """Map the writer's segment ``name`` now (e.g. the up-front reservation at start-up)."""
        self._attach(name)

    def _attach(self, name: str) -> ShmSegment:
        seg = self._seg
        if seg is None or seg.name != name:
            if seg is not None:
                seg.close()
            self._seg = seg = ShmSegment(name)
        return seg

    def _free(self) -> list[int]:
        """Indices of pooled buffers that no received object references any more."""
        pool = self._pool
        # 2 references = the pool list and getrefcount's argument: nothing received uses it.
        return [i for i in range(len(pool)) if sys.getrefcount(pool[i]) <= 2]

    def _take_buffer(self, nbytes: int) -> bytearray:
        """A pooled buffer no received object references any more, or a new pre-faulted one.

        Several buffers rotate so the usual ``out = runner.generate(x)`` (the previous result is
        still referenced during the next call) keeps reusing memory instead of faulting it in.
        """
        self._last_nbytes = nbytes
        free = self._free()
        for i in free:
            if len(self._pool[i]) >= nbytes:
                return self._pool[i]
        return self._add_buffer(nbytes, free)

    def _add_buffer(self, nbytes: int, free: list[int]) -> bytearray:
        pool = self._pool
        fresh = bytearray(nbytes)  # zero-filled: every page is touched (pre-faulted) now
        if free:
            pool[free[0]] = fresh  # a free but too small buffer: replace it
        elif len(pool) < _POOL_SIZE:
            pool.append(fresh)
        else:
            pool[0] = fresh  # all busy: the user owns the old one now
        return fresh

    def replenish(self) -> None:
        """Pre-fault a free buffer of the last message's size if none is left (copy mode).

        Call it off the critical path (a rank calls it after sending its reply): a worker that
        keeps its inputs beyond the call (caches, batching) otherwise makes the next call
        allocate and zero-fill a fresh buffer (plus up to 4096 page faults per 16 MiB when the
        allocator maps new memory) while the caller waits. A failed allocation is left to the
        next :meth:`decode` to report.
        """
        nbytes = self._last_nbytes
        if self.transfer != "copy" or not nbytes:
            return
        free = self._free()
        if any(len(self._pool[i]) >= nbytes for i in free):
            return
        try:
            self._add_buffer(nbytes, free)
        except MemoryError:
            pass

    def _copy_out(self, src: memoryview, spans: list[tuple[int, int]]) -> list[memoryview]:
        dst = memoryview(self._take_buffer(spans[-1][0] + spans[-1][1]))
        out = []
        for off, size in spans:
            dst[off:off + size] = src[off:off + size]
            out.append(dst[off:off + size])
        return out

    def close(self) -> None:
        """Drop the mapping (the writer owns and unlinks the segment) and the pool."""
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        self._pool, self._last_nbytes = [], 0
