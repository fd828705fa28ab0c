"""Versioned, length-prefixed frames over pipe and socket file descriptors: the one wire format.

A frame is ``version`` (1 byte, :data:`FRAME_VERSION`) + ``kind`` (1 byte) + body length (u32,
little endian) + body. Frames are written with one ``os.writev`` so a small frame costs one system
call, and read with ``os.readv`` into a buffer that is reused between frames. The body is opaque
bytes; :func:`send_msg` / :func:`decode_msg` give the common body layout "JSON header + raw
payload" (u32 header length, UTF-8 JSON object, payload bytes). Nothing is ever pickled: a peer
can only make the reader allocate and parse JSON. A frame of another version raises
:class:`FrameError` instead of being misread.

Waiting is left to the caller (``select.poll`` or ``multiprocessing.connection.wait`` on the same
file descriptors together with process sentinels), so no read here ever blocks without a bound:
:func:`recv_frame` is only called once the descriptor is readable, and a writer that dies
mid-frame closes the pipe, which ends the read with :class:`EOFError`.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

__all__ = [
    "FRAME_HEADER",
    "FRAME_VERSION",
    "MAX_FRAME_BYTES",
    "FrameError",
    "FrameReader",
    "decode_msg",
    "encode_msg",
    "send_frame",
    "send_msg",
]

FRAME_VERSION = 1
FRAME_HEADER = struct.Struct("<BBI")
MAX_FRAME_BYTES = (1 << 32) - 1
_JSON_LEN = struct.Struct("<I")


class FrameError(ValueError):
    """A frame of an unknown version or a malformed message body was received."""


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
    parts = [memoryview(FRAME_HEADER.pack(FRAME_VERSION, kind, size)), memoryview(body).cast("B")]
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
            FrameError: the frame has another :data:`FRAME_VERSION` (a mismatched peer).
        """
        self._read_exact(memoryview(self._head))
        version, kind, size = FRAME_HEADER.unpack(self._head)
        if version != FRAME_VERSION:
            raise FrameError(
                f"frame version {version} on fd {self.fd}, expected {FRAME_VERSION}: both ends "
                "must run the same trainguard version"
            )
        if size > len(self._buf):
            self._buf = bytearray(max(size, 2 * len(self._buf)))
        body = memoryview(self._buf)[:size]
        self._read_exact(body)
        return kind, body


def encode_msg(header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> bytes:
    """The body of a message frame: u32 JSON length + JSON ``header`` + ``payload``.

    Raises:
        TypeError: ``header`` is not JSON-serialisable.
    """
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_JSON_LEN.pack(len(head)), head, bytes(payload)))


def send_msg(fd: int, kind: int, header: dict[str, Any],
             payload: bytes | bytearray | memoryview = b"") -> None:
    """Send one message frame (see :func:`encode_msg`); blocks and raises as :func:`send_frame`."""
    send_frame(fd, kind, encode_msg(header, payload))


def decode_msg(body: bytes | memoryview) -> tuple[dict[str, Any], bytes]:
    """Split a message body into ``(header, payload)``; copies, so ``body`` may be reused.

    Raises:
        FrameError: the body is not a message (too short, bad length or not a JSON object).
    """
    view = memoryview(body)
    if len(view) < _JSON_LEN.size:
        raise FrameError(f"message body of {len(view)} bytes is shorter than its header")
    (n,) = _JSON_LEN.unpack(view[: _JSON_LEN.size])
    end = _JSON_LEN.size + n
    if end > len(view):
        raise FrameError(f"message header of {n} bytes exceeds the {len(view)}-byte body")
    try:
        header = json.loads(bytes(view[_JSON_LEN.size : end]))
    except ValueError as exc:
        raise FrameError(f"message header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise FrameError(f"message header must be a JSON object, got {type(header).__name__}")
    return header, bytes(view[end:])
