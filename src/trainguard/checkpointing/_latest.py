"""Committed single-file checkpoints and :func:`latest`: the newest committed checkpoint of a dir.

Two kinds of committed checkpoint live in a checkpoint directory:

* step directories of :class:`~trainguard.checkpointing.manager.CheckpointManager`
  (``step_000000100/`` with ``manifest.json`` written last);
* single files (for example Lightning's ``epoch=0-step=10.ckpt``) written atomically by
  :meth:`AsyncCheckpointer.async_save` and committed by :func:`commit_file`, which writes the
  sidecar ``<file>.commit.json`` (step, size, xxh3) *after* the file is durable.

A file without its sidecar, or whose size disagrees with it, is not committed: a crash between
the rename and the sidecar (or a file written by something else) is never picked by ``latest``.

Follows: Lightning's ``ckpt_path="last"`` (the newest file in the checkpoint directory);
differences: only committed checkpoints count, across both layouts, and symbolic links (Lightning's
``last.ckpt`` with ``save_last="link"``) are skipped so a dangling link is never returned.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from trainguard.checkpointing.storage import TMP_MARK, LocalStorage

__all__ = ["COMMIT_SUFFIX", "commit_file", "committed_file_step", "latest"]

COMMIT_SUFFIX = ".commit.json"


def commit_file(path: str | os.PathLike, step: int, size: int, xxh3: str,
                extra: dict[str, Any] | None = None) -> None:
    """Mark the durable file ``path`` as committed checkpoint ``step`` (local filesystem).

    Call only once ``path`` is fully written, fsync'd and renamed (an ``async_save`` finalize
    function is such a point). Writes ``<path>.commit.json`` atomically (temporary name, fsync,
    rename, directory fsync); blocks for those few syscalls.

    Raises:
        OSError: the sidecar could not be written (the file then stays uncommitted).
    """
    full = os.fspath(path)
    folder, name = os.path.split(full)
    record = {"step": int(step), "size": int(size), "xxh3": str(xxh3),
              "created_unix": time.time(), "extra": extra or {}}
    LocalStorage(folder or ".").write_bytes(name + COMMIT_SUFFIX,
                                             json.dumps(record, sort_keys=True).encode())


def committed_file_step(path: str | os.PathLike) -> int | None:
    """The step of a committed single-file checkpoint, or None when ``path`` is not committed
    (no or unreadable sidecar, missing file, or a size that differs from the sidecar's).
    Local, never blocks beyond two ``stat``/``read`` calls."""
    full = os.fspath(path)
    try:
        with open(full + COMMIT_SUFFIX, "rb") as f:
            record = json.loads(f.read())
        if os.path.islink(full) or os.path.getsize(full) != int(record["size"]):
            return None
        return int(record["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest(root: str | os.PathLike) -> str | None:
    """Path of the newest committed checkpoint in ``root`` (a local directory), or None.

    Pass it to ``Trainer.fit(ckpt_path=latest(dir))`` or :meth:`CheckpointManager.load`. Looks at
    step directories with a valid manifest and at single files committed by :func:`commit_file`;
    the highest step wins (ties: the most recently committed). Uncommitted, partial and temporary
    files and symbolic links are ignored. Reads only manifests and sidecars (no checksums), so it
    returns in milliseconds.

    Raises:
        ConfigError: ``root`` exists and is not a directory.
    """
    from trainguard.checkpointing.manager import CheckpointManager
    from trainguard.errors import ConfigError

    folder = os.fspath(root)
    if not os.path.exists(folder):
        return None
    if not os.path.isdir(folder):
        raise ConfigError(f"latest({folder!r}): not a directory; pass the checkpoint directory")
    best: tuple[int, float, str] | None = None
    step = CheckpointManager(folder).latest_step()
    if step is not None:
        best = (step, 0.0, os.path.join(folder, CheckpointManager.step_dir(step)))
    for name in os.listdir(folder):
        if not name.endswith(COMMIT_SUFFIX) or TMP_MARK in name:
            continue
        path = os.path.join(folder, name[: -len(COMMIT_SUFFIX)])
        found = committed_file_step(path)
        if found is None:
            continue
        key = (found, os.path.getmtime(path + COMMIT_SUFFIX), path)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best is not None else None
