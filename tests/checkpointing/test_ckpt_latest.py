"""``checkpointing.latest``: the newest *committed* checkpoint of a directory, both layouts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainguard.checkpointing import CheckpointManager, commit_file, latest
from trainguard.checkpointing._latest import committed_file_step
from trainguard.errors import ConfigError


def _file(folder: Path, name: str, step: int, commit: bool = True) -> Path:
    path = folder / name
    torch.save({"global_step": step}, path)
    if commit:
        commit_file(path, step, os.path.getsize(path), "0" * 16)
    return path


def test_missing_or_empty_directory_has_no_latest(tmp_path: Path):
    assert latest(tmp_path / "nope") is None
    assert latest(tmp_path) is None


def test_not_a_directory_is_a_clear_error(tmp_path: Path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        latest(f)


def test_only_committed_files_count_and_the_highest_step_wins(tmp_path: Path):
    _file(tmp_path, "epoch=0-step=4.ckpt", 4)
    newest = _file(tmp_path, "epoch=0-step=8.ckpt", 8)
    _file(tmp_path, "epoch=0-step=12.ckpt", 12, commit=False)  # written, never committed
    (tmp_path / "epoch=0-step=16.ckpt.tmp.123.abcd").write_bytes(b"partial")
    assert latest(tmp_path) == str(newest)


def test_a_file_that_changed_after_its_commit_or_a_link_is_skipped(tmp_path: Path):
    old = _file(tmp_path, "a.ckpt", 4)
    torn = _file(tmp_path, "b.ckpt", 8)
    with open(torn, "ab") as f:
        f.write(b"more bytes than committed")
    assert committed_file_step(torn) is None
    os.symlink(old, tmp_path / "last.ckpt")
    commit_file(tmp_path / "last.ckpt", 9, os.path.getsize(old), "0" * 16)
    assert latest(tmp_path) == str(old)


def test_step_directories_and_files_compete_by_step(tmp_path: Path):
    man = CheckpointManager(tmp_path)
    os.makedirs(tmp_path / man.step_dir(10))
    man.commit(10, "torch", 1, {})
    os.makedirs(tmp_path / man.step_dir(20))  # uncommitted: no manifest
    _file(tmp_path, "epoch=0-step=6.ckpt", 6)
    assert latest(tmp_path) == str(tmp_path / man.step_dir(10))
    newer = _file(tmp_path, "epoch=0-step=12.ckpt", 12)
    assert latest(tmp_path) == str(newer)
