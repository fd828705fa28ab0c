"""``TrainguardCheckpointIO``'s logic without Lightning (the namespace classes only add the base):
commit sidecars, removals deferred until a newer save commits, overwrite un-commits, verified
loads. One plugin (one writer process) per test keeps it quick."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from trainguard.checkpointing import CorruptCheckpointError, latest
from trainguard.checkpointing._latest import COMMIT_SUFFIX, committed_file_step
from trainguard.integrations.lightning._ckpt_io import CheckpointIOLogic


def _ckpt(step: int) -> dict:
    return {"global_step": step, "state_dict": {"w": torch.full((256,), float(step))},
            "loops": {"fit_loop": {"epoch": 0}}, "hyper_parameters": {"lr": 0.1}}


def _wait_committed(io: CheckpointIOLogic, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(io.committed) < n:
        assert time.monotonic() < deadline, f"only {io.committed} committed after {timeout_s} s"
        io.trainguard_poll()
        time.sleep(0.02)


@pytest.fixture
def io():
    plugin = CheckpointIOLogic(write_timeout=60.0)
    yield plugin
    plugin.teardown()


def test_removal_waits_for_the_newer_save_to_commit(io, tmp_path: Path):
    a, b = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "epoch=0-step=8.ckpt"
    io.save_checkpoint(_ckpt(4), a)
    _wait_committed(io, 1)
    assert committed_file_step(a) == 4 and latest(tmp_path) == str(a)
    io.save_checkpoint(_ckpt(8), b)
    io.remove_checkpoint(a)  # what ModelCheckpoint(save_top_k=1) does right after the save
    if len(io.committed) < 2:  # the newer save is not committed yet: the old one must remain
        assert a.exists() and committed_file_step(a) == 4
    _wait_committed(io, 2)
    io.trainguard_poll()
    assert not a.exists() and not Path(str(a) + COMMIT_SUFFIX).exists()
    assert latest(tmp_path) == str(b)
    loaded = io.load_checkpoint(b)
    assert loaded["global_step"] == 8 and torch.equal(loaded["state_dict"]["w"],
                                                      torch.full((256,), 8.0))
    print(f"blocking time of the last save: {io.last_block_s * 1e3:.2f} ms")


def test_overwrite_uncommits_first_and_a_changed_file_fails_to_load(io, tmp_path: Path):
    last = tmp_path / "sub" / "last.ckpt"
    io.save_checkpoint(_ckpt(1), last)
    _wait_committed(io, 1)
    io.save_checkpoint(_ckpt(2), last)
    assert not Path(str(last) + COMMIT_SUFFIX).exists()  # old content is no longer "committed"
    _wait_committed(io, 2)
    assert committed_file_step(last) == 2
    with open(last, "r+b") as f:  # same size, different bytes
        f.seek(os.path.getsize(last) // 2)
        f.write(b"\x00garbage\x00")
    with pytest.raises(CorruptCheckpointError, match="commit record"):
        io.load_checkpoint(last)


def test_storage_options_are_refused_like_lightning_does(io, tmp_path: Path):
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_ckpt(1), tmp_path / "x.ckpt", storage_options={"a": 1})


def test_an_unwritable_directory_is_one_clear_error(io, tmp_path: Path):
    """New-user finding: a checkpoint path under /proc raised a raw FileNotFoundError from
    ``os.makedirs`` at the first save."""
    from trainguard.errors import ConfigError

    for bad in ("/proc/nope/x.ckpt", str(tmp_path / "afile" / "x.ckpt")):
        (tmp_path / "afile").write_text("")
        with pytest.raises(ConfigError, match="checkpoint directory .* writable") as err:
            io.save_checkpoint(_ckpt(1), bad)
        assert "\n" not in str(err.value)
    io.save_checkpoint(_ckpt(2), tmp_path / "ok.ckpt")  # still usable afterwards
    io.teardown()
    assert latest(tmp_path) is not None


def test_teardown_commits_pending_saves_and_applies_removals(tmp_path: Path):
    io = CheckpointIOLogic()
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    io.save_checkpoint(_ckpt(1), a)
    io.save_checkpoint(_ckpt(2), b)
    io.remove_checkpoint(a)
    io.teardown()
    assert not a.exists() and committed_file_step(b) == 2
    io.teardown()  # idempotent
