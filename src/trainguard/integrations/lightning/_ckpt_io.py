"""``TrainguardCheckpointIO`` logic: asynchronous, never-torn, committed Lightning checkpoints.

Lightning calls a ``CheckpointIO`` only from ``Strategy.save_checkpoint`` / ``remove_checkpoint``
on **global rank 0** (single device and DDP); FSDP and ModelParallel never call it (see
:class:`ShardedCheckpointLogic` for those). Each save:

0. at the first save into a directory, removes temporaries (``*.tmp.*``) a killed writer left;
1. un-commits an existing file of the same name (its ``.commit.json`` sidecar goes first);
2. stages the checkpoint dict into shared memory (the only blocking part) and hands the write to
   a persistent writer process (:class:`~trainguard.checkpointing.AsyncCheckpointer`), which
   writes ``<file>.tmp.*``, fsyncs and renames it: the file appears complete or not at all;
3. once written, :func:`~trainguard.checkpointing.commit_file` writes the sidecar: the file is
   committed and :func:`~trainguard.checkpointing.latest` may return it.

``remove_checkpoint`` (``ModelCheckpoint`` deletes the previous top-k file right after asking for
the new save) is deferred until a save requested after it has committed, so a crash right after
a save never leaves the directory without a committed checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from datetime import timedelta
from typing import Any

import torch
import xxhash

from trainguard._core.logging import get_logger
from trainguard.checkpointing import AsyncCheckpointer, CorruptCheckpointError, commit_file
from trainguard.checkpointing._latest import COMMIT_SUFFIX
from trainguard.checkpointing.storage import TMP_MARK
from trainguard.errors import ConfigError
from trainguard.integrations.lightning._common import checkpoint_section

__all__ = ["CheckpointIOLogic"]

_log = get_logger("trainguard.integrations.lightning")


class CheckpointIOLogic:
    """Asynchronous committed checkpoints for ``Trainer(plugins=[TrainguardCheckpointIO()])``.

    Args:
        write_timeout: longest one write may take (seconds or timedelta) before the writer
            counts as stuck; also bounds :meth:`teardown`'s wait per pending save.
        max_in_flight: saves staged but not yet written (>= 1); a save waits for the oldest
            when all are busy. Host memory used: about this x the checkpoint size.
        on_error: ``"raise"`` (a failed background write raises ``CheckpointWriteError`` at the
            next save, batch end or teardown) or ``"log"`` (logged; the older checkpoint stays).
        verify_on_load: check size and xxh3 against the sidecar before loading a committed file.

    Raises:
        ConfigError: a bad argument (on the first save, where the checkpointer is made).
        TypeError: ``storage_options`` passed to :meth:`save_checkpoint` (as Lightning's own
            ``TorchCheckpointIO`` does).
        CorruptCheckpointError: :meth:`load_checkpoint` of a committed file whose bytes differ
            from its sidecar.

    On global rank 0 (``RANK`` unset or 0) the writer process is started by the constructor, so
    it imports torch while the Trainer sets up; other ranks start none.

    Blocking: :meth:`save_checkpoint` blocks for the memcpy of the checkpoint's tensors (plus a
    free staging arena); :meth:`teardown` waits for every pending write (<= ``write_timeout``
    each). No collective anywhere (rank 0 only).

    Follows: Lightning's ``AsyncCheckpointIO``; differences: a snapshot staged in reused shared
    memory written by a separate process (no GIL contention), atomic files with a commit sidecar,
    and removals of older checkpoints deferred until the newer one is committed.
    """

    def __init__(self, *, write_timeout: float | timedelta = 600.0, max_in_flight: int = 2,
                 on_error: str = "raise", verify_on_load: bool = True) -> None:
        self.write_timeout = write_timeout
        self.max_in_flight = max_in_flight
        self.on_error = on_error
        self.verify_on_load = bool(verify_on_load)
        self.checkpointer: AsyncCheckpointer | None = None
        self.last_block_s = 0.0
        self.committed: list[str] = []
        self._seq = 0  # saves submitted
        self._newest_done = 0  # highest seq committed
        self._removals: list[tuple[str, int]] = []  # (path, seq of the save it waits for)
        self._latest_submit: dict[str, int] = {}  # path -> seq of its newest save
        self._cleaned: set[str] = set()
        if os.environ.get("RANK", "0") == "0":
            self._checkpointer()  # Lightning saves on global rank 0: start its writer now

    # -- the CheckpointIO interface ---------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Stage ``checkpoint`` and write it to ``path`` in the background (see module doc)."""
        if storage_options is not None:
            raise TypeError("TrainguardCheckpointIO.save_checkpoint(..., storage_options=...) is "
                            "not supported; pass storage_options=None")
        target = os.fspath(path)
        t0 = time.perf_counter()
        with checkpoint_section():
            ckpt = self._checkpointer()
            self.trainguard_poll()
            folder = os.path.dirname(target) or "."
            if folder not in self._cleaned:
                self._clean_leftovers(folder)
            if os.path.lexists(target + COMMIT_SUFFIX):
                os.unlink(target + COMMIT_SUFFIX)  # the old content is no longer "committed"
            self._seq += 1
            seq, step = self._seq, int(checkpoint.get("global_step", 0))
            box: list[Any] = []
            req = ckpt.async_save(checkpoint, target,
                                  finalize_fns=[lambda: self._commit(box[0], target, step, seq)])
            box.append(req)
            self._latest_submit[target] = seq
        self.last_block_s = time.perf_counter() - t0

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load a Lightning checkpoint (verified against its sidecar when committed).

        ``weights_only`` None means False, as Lightning's ``TorchCheckpointIO`` treats a file it
        wrote itself. Blocks for reading the file.
        """
        import json

        target = os.fspath(path)
        self.trainguard_poll()
        with open(target, "rb") as f:
            data = f.read()
        sidecar = target + COMMIT_SUFFIX
        if self.verify_on_load and os.path.exists(sidecar):
            with open(sidecar, "rb") as f:
                want = json.loads(f.read())
            digest = xxhash.xxh3_64(data).hexdigest()
            if len(data) != int(want["size"]) or digest != want["xxh3"]:
                raise CorruptCheckpointError(
                    f"{target}: {len(data)} bytes xxh3 {digest}, its commit record says "
                    f"{want['size']} bytes xxh3 {want['xxh3']} (truncated or overwritten); load "
                    "an older checkpoint (trainguard.checkpointing.latest skips it)")
        return torch.load(io.BytesIO(data), map_location=map_location,
                          weights_only=bool(weights_only))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` once a save requested before this call has committed (deferred)."""
        target = os.fspath(path)
        self.trainguard_poll()
        if self._seq > self._newest_done:
            self._removals.append((target, self._seq))
            return
        self._remove_now(target)

    def teardown(self) -> None:
        """Commit every pending save (blocking), apply deferred removals, stop the writer."""
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is None:
            return
        try:
            ckpt.close(finalize=True)
        finally:
            self._apply_removals()

    # -- trainguard ---------------------------------------------------------------------------
    def trainguard_poll(self) -> None:
        """Commit finished saves and apply the removals they unblock (non-blocking).

        The trainguard callbacks call it at every training batch end; without them it runs at
        each save, removal, load and at teardown.
        """
        if self.checkpointer is not None and self.checkpointer.num_unfinalized:
            self.checkpointer.maybe_finalize()
        self._apply_removals()

    def _checkpointer(self) -> AsyncCheckpointer:
        if self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(
                None, use_dist=False, write_timeout=self.write_timeout,
                max_in_flight=self.max_in_flight, on_error=self.on_error)
        return self.checkpointer

    def _clean_leftovers(self, folder: str) -> None:
        """First save into ``folder``: make it, and delete temporaries of a killed writer.

        Raises:
            ConfigError: ``folder`` cannot be created or written (one line with the fix).
        """
        try:
            os.makedirs(folder, exist_ok=True)
            writable = os.access(folder, os.W_OK | os.X_OK)
        except OSError as exc:
            raise ConfigError(f"checkpoint directory {folder!r} cannot be created "
                              f"({exc.strerror}); pass a writable dirpath / default_root_dir"
                              ) from None
        if not writable:
            raise ConfigError(f"checkpoint directory {folder!r} is not writable; pass a writable "
                              "dirpath / default_root_dir")
        busy = self.checkpointer is not None and self.checkpointer.num_unfinalized
        if not busy:
            for name in os.listdir(folder):
                if TMP_MARK in name:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(folder, name))
        self._cleaned.add(folder)

    def _commit(self, req: Any, target: str, step: int, seq: int) -> None:
        files = req.record.get("files", {})
        info = files.get(os.path.basename(target)) or next(iter(files.values()), None)
        if info is None:
            _log.warning("checkpoint %s written but its size/checksum is unknown; left "
                         "uncommitted", target)
            return
        if self._latest_submit.get(target) == seq:  # a newer save of the same name is queued
            commit_file(target, step, int(info["size"]), str(info["xxh3"]))
            self.committed.append(target)
        self._newest_done = max(self._newest_done, seq)

    def _apply_removals(self) -> None:
        keep = []
        for target, seq in self._removals:
            if self._newest_done >= seq:
                if self._latest_submit.get(target, 0) <= seq:  # not saved again since
                    self._remove_now(target)
            else:
                keep.append((target, seq))
        self._removals = keep

    def _remove_now(self, target: str) -> None:
        for name in (target + COMMIT_SUFFIX, target):
            try:
                if os.path.isdir(name) and not os.path.islink(name):
                    import shutil

                    shutil.rmtree(name)
                else:
                    os.unlink(name)
            except FileNotFoundError:
                continue
        self._latest_submit.pop(target, None)
