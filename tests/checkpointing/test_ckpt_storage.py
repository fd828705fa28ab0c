"""CheckpointManager, storage backends and staging without writer processes."""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading

import pytest
import torch

from trainguard.checkpointing import (
    BasicTensorAwareStateDict,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CliqueReplicationStrategy,
    CorruptCheckpointError,
    StateDictError,
    _staging,
    storage_for,
)
from trainguard.checkpointing.manager import MANIFEST, rank_file
from trainguard.errors import ConfigError


def _commit_torch(mgr: CheckpointManager, step: int, obj, world_size: int = 1) -> None:
    rel = mgr.step_dir(step)
    mgr.storage.makedirs(rel)
    f = mgr.storage.open_atomic(f"{rel}/{rank_file(0)}")
    torch.save(obj, f)
    size, digest = f.commit()
    mgr.commit(step, "torch", world_size, {rank_file(0): {"size": size, "xxh3": digest, "rank": 0}})


def test_commit_load_prune_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _commit_torch(mgr, step, {"x": torch.full((4,), float(step))})
    assert mgr.committed_steps() == [2, 3]  # keep_last=2 pruned step 1
    assert (tmp_path / "latest").read_text().strip() == "3"
    obj, step = mgr.load()
    assert step == 3 and torch.equal(obj["x"], torch.full((4,), 3.0))
    assert not [n for n in os.listdir(tmp_path / mgr.step_dir(3)) if ".tmp." in n]


def test_corrupt_shard_and_manifest_are_skipped(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        _commit_torch(mgr, step, {"x": torch.full((1000,), float(step))})
    shard = tmp_path / mgr.step_dir(3) / rank_file(0)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit flip
    shard.write_bytes(bytes(raw))
    (tmp_path / mgr.step_dir(2) / MANIFEST).write_text("{not json")
    obj, step = mgr.load()
    print("loaded step", step, "warnings:", caplog.text)
    assert step == 1 and obj["x"][0].item() == 1.0
    assert "corrupt" in caplog.text and rank_file(0) in caplog.text
    with pytest.raises(CorruptCheckpointError, match=rank_file(0)):
        mgr.load(step=3)
    shard.write_bytes(bytes(raw[:100]))  # truncated
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        mgr.verify(3)


def test_world_size_mismatch_and_not_found(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        mgr.load()
    _commit_torch(mgr, 5, {"x": 1}, world_size=4)
    with pytest.raises(CheckpointMismatchError, match="written by 4 ranks"):
        mgr.load(world_size=2)
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, keep_last=0)


def test_cleanup_stale_removes_uncommitted_and_temporaries(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _commit_torch(mgr, 1, {"x": 1})
    os.makedirs(tmp_path / mgr.step_dir(2))  # a crashed save: data but no manifest (report #12)
    (tmp_path / mgr.step_dir(2) / rank_file(0)).write_bytes(b"partial")
    (tmp_path / mgr.step_dir(1) / "rank_00001.pt.tmp.123.abc").write_bytes(b"x")
    assert mgr.committed_steps() == [1] and mgr.all_steps() == [1, 2]
    removed = mgr.cleanup_stale()
    assert mgr.all_steps() == [1] and len(removed) == 2
    assert mgr.load()[1] == 1


@pytest.mark.parametrize("op", ["write", "fsync", "replace"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_atomic_file_io_errors_leave_nothing(tmp_path, monkeypatch, op, err):
    store = storage_for(tmp_path)
    store.write_bytes("f.bin", b"old")

    def fail(*a, **k):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, op, fail)
    with pytest.raises(OSError) as info:
        store.write_bytes("f.bin", b"new contents")
    monkeypatch.undo()
    assert info.value.errno == err
    assert store.read_bytes("f.bin") == b"old"
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_fsspec_storage_round_trip(tmp_path):
    store = storage_for(f"file://{tmp_path}/remote")
    mgr = CheckpointManager(store)
    _commit_torch(mgr, 7, {"w": torch.arange(5)})
    assert mgr.committed_steps() == [7]
    assert torch.equal(mgr.load()[0]["w"], torch.arange(5))
    assert json.loads((tmp_path / "remote" / mgr.step_dir(7) / MANIFEST).read_text())["step"] == 7
    with pytest.raises(ConfigError, match="fsspec"):
        storage_for("nosuchscheme-xyz://bucket/x")


def test_flatten_stage_rebuild_round_trip():
    state = {
        "a": torch.randn(3, 4),
        "b": [torch.arange(5, dtype=torch.int16), (torch.ones(2, dtype=torch.bool), 7)],
        "c": {"t": torch.randn(4, 4).t(), "s": torch.tensor(3.5), "e": torch.empty(0, 3)},
        "obj": {"lr": 0.1, "name": "adam"},
    }
    skeleton, tensors = _staging.flatten(state)
    slots, total = _staging.plan_slots(tensors)
    arena = _staging.Arena(total)
    try:
        _staging.stage(tensors, slots, arena)
        out = _staging.rebuild(_staging.pickle_skeleton(skeleton), arena._mm, slots)
        assert torch.equal(out["a"], state["a"]) and torch.equal(out["c"]["t"], state["c"]["t"])
        assert out["b"][1][1] == 7 and out["b"][1][0].dtype == torch.bool
        assert out["c"]["e"].shape == (0, 3) and out["obj"] == state["obj"]
        state["a"].add_(1)  # the staged copy is a snapshot
        assert not torch.equal(out["a"], state["a"])
        del out
    finally:
        arena.close()
    assert arena.fd is None and arena.buf is None


def test_unpicklable_value_names_its_key():
    skeleton, _ = _staging.flatten(
        {"model": {"w": torch.ones(1)}, "opt": {"lock": threading.Lock()}}
    )
    with pytest.raises(StateDictError, match=r"opt\.lock"):
        _staging.pickle_skeleton(skeleton)
    assert isinstance(pickle.loads(pickle.dumps(_staging.TensorRef(3))), _staging.TensorRef)


def test_tensor_aware_state_dict_contract():
    tasd = BasicTensorAwareStateDict({"a": torch.ones(2, 3), "n": [torch.zeros(4), 5]})
    tensors = tasd.pop_tensors()
    assert tasd.is_hollow and len(tensors) == 2 and tasd.tensors == []
    tasd.init_tensors()
    assert not tasd.is_hollow and tasd.tensors[0].shape == (2, 3)
    tasd.pop_tensors()
    tasd.insert_tensors(tensors)
    assert torch.equal(tasd.to_state_dict()["a"], torch.ones(2, 3))
    tasd.copy_tensors_to_cpu()
    tasd.restore_tensor_device()
    assert tasd.devices == ["cpu", "cpu"]


def test_clique_groups():
    s = CliqueReplicationStrategy(replication_jump=8, replication_factor=2)
    cl = s.cliques(32)
    assert [0, 8] in cl and [16, 24] in cl and [7, 15] in cl and len(cl) == 16
    assert CliqueReplicationStrategy(1, 2).cliques(4) == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="divisible"):
        s.cliques(12)
    with pytest.raises(ConfigError):
        CliqueReplicationStrategy(0, 2)
