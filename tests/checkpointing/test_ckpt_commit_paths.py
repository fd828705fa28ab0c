"""Failure paths of the collective commit that must still reach every rank as a typed error."""

from __future__ import annotations

import errno

import pytest
import torch

from trainguard.checkpointing import AsyncCheckpointer, CheckpointWriteError


@pytest.mark.timeout(60)
def test_failed_save_whose_leftovers_cannot_be_removed_still_raises_write_error(tmp_path,
                                                                               monkeypatch):
    """A read-only filesystem mid-run: the write failed, and removing the failed save's
    directory fails too (EROFS). The coordinator must not die with a raw OSError before it tells
    the other ranks the outcome (they would wait for the whole collective timeout)."""
    ck = AsyncCheckpointer(tmp_path, faults={2: {"phase": "write", "action": "errno",
                                                 "errno": errno.EROFS}})
    try:
        def remove(rel):
            raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / rel))

        monkeypatch.setattr(ck.manager.storage, "remove", remove)
        ck.save({"w": torch.ones(4)}, 2)
        with pytest.raises(CheckpointWriteError, match="Read-only file system"):
            ck.wait()
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(60)
def test_only_corrupt_checkpoints_is_not_reported_as_none_found(tmp_path):
    """``except CheckpointNotFoundError: start fresh`` must not silently restart from step 0
    when committed checkpoints exist but every one of them is corrupt."""
    from trainguard.checkpointing import (
        AsyncCheckpointer,
        CheckpointNotFoundError,
        CorruptCheckpointError,
    )

    with AsyncCheckpointer(tmp_path / "empty") as ck, pytest.raises(CheckpointNotFoundError):
        ck.load()
    with AsyncCheckpointer(tmp_path / "ck", keep_last=2) as ck:
        ck.save({"w": torch.ones(1024)}, 1)
        assert ck.wait() == [1]
    shards = [p for p in (tmp_path / "ck").rglob("*") if p.is_file() and p.stat().st_size > 1024]
    assert shards, list((tmp_path / "ck").rglob("*"))
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    with AsyncCheckpointer(tmp_path / "ck") as ck:
        with pytest.raises(CorruptCheckpointError, match="none valid") as info:
            ck.load()
        assert not isinstance(info.value, CheckpointNotFoundError)
