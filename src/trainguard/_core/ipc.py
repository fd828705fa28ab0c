"""Length-prefixed frames over pipe file descriptors.

A frame is ``kind`` (1 byte) + body length (u32, little endian) + body. Frames are written with
one ``os.writev`` so a small frame costs one system call, and read with ``os.readv`` into a buffer
that is reused between frames. The body is opaque bytes: callers decide its encoding.

Waiting is left to the caller (``select.poll`` or ``multiprocessing.connection.wait`` on the same
file descriptors together with process sentinels), so no read here ever blocks without a bound:
:func:`recv_frame` is only called once the descriptor is readable, and a writer that dies
mid-frame closes the pipe, which ends the read with :class:`EOFError`.
"""

from __future__ import annotations

import os
import struct

__all__ = ["FRAME_HEADER", "MAX_FRAME_BYTES", "FrameReader", "send_frame"]

FRAME_HEADER = struct.Struct("<BI")
MAX_FRAME_BYTES = (1 << 32) - 1


def send_frame(fd: int, kind: int, body: bytes | bytearray | memoryview = b"") -> None:
    """Write one frame to ``fd``, looping over partial writes.

    Blocks while the pipe is full (64 KiB on Linux), i.e. until the reader drains it.

    Raises:
        ValueError: ``kind`` is not a byte or ``body`` exceeds :data:`MAX_FRAME_BYTES`.
        BrokenPipeError: the reading end is closed (the peer exited).
    """
    if not 0 <= kind <= 255:
        raise ValueError(f"frame kind must be 0..255, got {kind}")
    size = len(body)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame body of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    parts = [memoryview(FRAME_HEADER.pack(kind, size)), memoryview(body).cast("B")]
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= len(parts[0]):
            written -= len(parts[0])
            parts.pop(0)
        if parts and written:
            parts[0] = parts[0][written:]


class FrameReader:
    """Reads frames from one file descriptor; keeps a growing buffer between frames.

    Not thread-safe: one reader per descriptor.
    """

    def __init__(self, fd: int, initial_bytes: int = 64 * 1024) -> None:
        self.fd = fd
        self._buf = bytearray(max(initial_bytes, FRAME_HEADER.size))
        self._head = bytearray(FRAME_HEADER.size)

    def _read_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = os.readv(self.fd, [view[got:]])
            if n == 0:
                raise EOFError(f"pipe fd {self.fd} closed by the writer")
            got += n

    def recv(self) -> tuple[int, memoryview]:
        """Read one frame; blocks until it is complete.

        Returns:
            ``(kind, body)``; ``body`` is a view of an internal buffer that is only valid until
            the next :meth:`recv` (copy or decode it before then).

        Raises:
            EOFError: the writer closed the pipe (exited) before or during the frame.
        """
        self._read_exact(memoryview(self._head))
        kind, size = FRAME_HEADER.unpack(self._head)
        if size > len(self._buf):
            self._buf = bytearray(max(size, 2 * len(self._buf)))
        body = memoryview(self._buf)[:size]
        self._read_exact(body)
        return kind, body
