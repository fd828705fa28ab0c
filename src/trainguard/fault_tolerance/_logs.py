"""Worker output: one thread pumps every rank's stdout/stderr pipe into rank-prefixed logs.

Per cycle the launcher writes ``<run_dir>/cycle_<N>.log`` with every line of every rank prefixed
``{node}:{rank}: `` (like ``srun -l``; the input of attribution), plus torchrun's per-rank layout
``<run_dir>/attempt_<N>/<local_rank>/{stdout,stderr}.log`` (unprefixed). The console gets the
prefixed lines of the ranks passing ``--local-ranks-filter`` and streams not redirected
(``--redirects``); ``--tee`` only adds the files, which are always written here.
"""

from __future__ import annotations

import collections
import os
import select
import sys
import threading
from typing import IO

__all__ = ["LogPump"]


class _Stream:
    def __init__(self, rank: int, fd: int, err: bool, rank_file: IO[bytes], console: bool) -> None:
        self.rank, self.fd, self.err, self.file, self.console = rank, fd, err, rank_file, console
        self.partial = b""


class LogPump:
    """Reads worker pipes on a thread named ``tg-launch-logs``; :meth:`close` joins it (≤ 2 s)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._cycle_log: IO[bytes] | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self.tails: dict[int, collections.deque[str]] = {}
        self._thread = threading.Thread(target=self._run, name="tg-launch-logs", daemon=True)
        self._thread.start()

    def open_cycle(self, path: str) -> None:
        with self._lock:
            self._cycle_log = open(path, "ab")  # noqa: SIM115 - closed in end_cycle

    def add(self, rank: int, fd: int, err: bool, rank_file: str, console: bool) -> None:
        """Pump ``fd`` (read end of a worker pipe; owned by the pump from now on)."""
        os.makedirs(os.path.dirname(rank_file), exist_ok=True)
        stream = _Stream(rank, fd, err, open(rank_file, "ab"), console)  # noqa: SIM115
        with self._lock:
            self._streams[fd] = stream
            if err:
                self.tails[rank] = collections.deque(maxlen=30)
        os.write(self._wake_w, b"x")

    def end_cycle(self, timeout_s: float = 2.0) -> None:
        """Wait until every pipe reached EOF (workers gone), at most ``timeout_s``; close files."""
        import time

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                if not self._streams:
                    break
            time.sleep(0.01)
        with self._lock:
            for stream in list(self._streams.values()):
                self._close_stream(stream)
            self._streams.clear()
            if self._cycle_log is not None:
                self._cycle_log.close()
                self._cycle_log = None

    def _close_stream(self, stream: _Stream) -> None:
        if stream.partial:
            self._emit(stream, stream.partial)
            stream.partial = b""
        os.close(stream.fd)
        stream.file.close()

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                fds = list(self._streams)
            ready, _, _ = select.select([self._wake_r, *fds], [], [], 0.5)
            for fd in ready:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                with self._lock:
                    stream = self._streams.get(fd)
                    if stream is None:
                        continue
                    if not data:
                        self._close_stream(stream)
                        del self._streams[fd]
                        continue
                    self._feed(stream, data)

    def _feed(self, stream: _Stream, data: bytes) -> None:
        stream.file.write(data)
        stream.file.flush()
        buf = stream.partial + data
        *lines, stream.partial = buf.split(b"\n")
        for line in lines:
            self._emit(stream, line)

    def _emit(self, stream: _Stream, line: bytes) -> None:
        out = f"{self.node}:{stream.rank}: ".encode() + line + b"\n"
        if self._cycle_log is not None:
            self._cycle_log.write(out)
            self._cycle_log.flush()
        if stream.err:
            self.tails[stream.rank].append(line.decode(errors="replace"))
        if stream.console:
            target = sys.stderr if stream.err else sys.stdout
            try:
                target.buffer.write(out)
                target.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def close(self) -> None:
        """Stop the thread (after :meth:`end_cycle`). Idempotent."""
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(2.0)
        os.close(self._wake_r)
        os.close(self._wake_w)
