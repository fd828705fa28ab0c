"""JSONL event logs: each rank appends one JSON object per line; the parent tails and reads them.

Every event has ``ev`` (its type), ``t`` (wall-clock ``time.time()`` seconds, the clock the
wrapper's restart records use) and ``rank`` (initial rank). Types written by a rank:

* ``start``: process started (``pid``).
* ``enter``: the training function was entered (``iteration``, ``active_rank``,
  ``active_world_size``, ``world_size``, ``resume_step``, ``t_fn`` when the function was
  called, before process-group set-up and the checkpoint reload).
* ``step``: a step finished (``step``, ``t0`` start time, ``loss``, ``iteration``).
* ``checkpoint_save``: this rank staged checkpoint ``step`` (``block_ms``: what the training
  loop waited, ``stage_ms``: the memcpy part).
* ``checkpoint``: checkpoint ``step`` was committed on every rank (active rank 0 only, from the
  committer thread; ``committed_at``: the loop's step then, ``block_ms``, ``commit_ms``: the
  thread's finalize time, ``durable_ms``: save -> committed).
* ``checkpoint_failed`` / ``checkpoint_error``: a save failed on some rank / its finalize
  raised (e.g. broken by a restart's abort); training goes on, the next save retries.
* ``checkpoint_sync``: once per run, the median ``ms`` of a synchronous save of the same state.
* ``checkpoint_skip``: a save was skipped (on every rank) as the previous one is not committed.
* ``checkpoint_writer_ready``: at start, the ``seconds`` until the writer process worked.
* ``fault``: a fault is about to fire (``kind``, ``step``, ``index``, ``iteration``).
* ``restart``: one of the wrapper's restart records (its fields, as given).
* ``done``: training finished (``accuracy``, ``step``); ``exit``: the process is leaving
  (``status``: "completed", "reserve" or "error", ``error``).

Lines are written with one ``write`` each and flushed, so a SIGKILL loses at most the line being
written, and a reader skips a torn last line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "EventTail", "read_events"]


class EventLog:
    """Append-only JSONL writer for one rank (main thread only)."""

    def __init__(self, path: str | os.PathLike, rank: int) -> None:
        self.rank = rank
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, ev: str, **fields: Any) -> dict:
        """Write one event now; returns it."""
        record = {"ev": ev, "t": time.time(), "rank": self.rank, **fields}
        os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _parse_lines(data: str) -> list[dict]:
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # torn line from a killed writer
    return out


def read_events(events_dir: str | os.PathLike) -> dict[int, list[dict]]:
    """All events of a run, keyed by initial rank, in file order."""
    out: dict[int, list[dict]] = {}
    for path in sorted(Path(events_dir).glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        out[rank] = _parse_lines(path.read_text())
    return out


class EventTail:
    """Incremental reader of every file matching ``pattern`` in a directory (the parent's
    progress view; the goodput run's files are ``ev_*.jsonl``)."""

    def __init__(self, events_dir: str | os.PathLike, pattern: str = "rank*.jsonl") -> None:
        self.dir = Path(events_dir)
        self.pattern = pattern
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}

    def poll(self) -> list[dict]:
        """Events appended since the last call (complete lines only)."""
        new: list[dict] = []
        for path in sorted(self.dir.glob(self.pattern)):
            offset = self._offsets.get(path, 0)
            try:
                with path.open("rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except OSError:
                continue
            if not chunk:
                continue
            self._offsets[path] = offset + len(chunk)
            text = self._partial.pop(path, "") + chunk.decode(errors="replace")
            head, sep, tail = text.rpartition("\n")
            if tail:
                self._partial[path] = tail
            if sep:
                new.extend(_parse_lines(head))
        return new
