"""LocalCheckpointManager on 2 gloo ranks: sync/async saves, restart, replica recovery."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _ckpt_dist import run_ranks

from trainguard.checkpointing import (
    BasicTensorAwareStateDict,
    CheckpointNotFoundError,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from trainguard.errors import ConfigError

BIG_ITER = 12_345_678  # 8 digits: NVRx's 7-digit width assert would trip


def _local_flow(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    repl = CliqueReplicationStrategy(replication_jump=1, replication_factor=2)
    mgr = LocalCheckpointManager(root, "job", repl, write_timeout=30, collective_timeout=30)
    out["empty"] = mgr.find_latest()
    state = {"w": torch.full((512,), float(rank)), "meta": [rank, "x"]}
    mgr.save(state, 1)  # sync
    req = mgr.save(BasicTensorAwareStateDict(state), 2, is_async=True)
    state["w"].fill_(-5.0)  # after save returned: not in the checkpoint
    polls = 0
    while mgr.maybe_finalize() is None:
        polls += 1
        assert polls < 20000
    out["async"] = (req is not None, mgr.find_latest())
    try:
        mgr.save(state, 2)
    except ConfigError:
        out["reject_old"] = True
    state["w"].fill_(float(rank) + 100)
    mgr.save(state, BIG_ITER)
    out["files"] = sorted(os.listdir(os.path.join(root, "job", str(rank))))
    mgr.close()
    dist.barrier()
    # restart: a fresh manager finds and loads the newest covered iteration
    mgr2 = LocalCheckpointManager(root, "job", repl)
    tasd, it = mgr2.load()
    out["reload"] = (it, tasd.to_state_dict()["w"][0].item(), tasd.to_state_dict()["meta"])
    mgr2.close()
    dist.barrier()
    if rank == 1:  # rank 1's node lost its own shard; the replica lives on rank 0
        for n in os.listdir(os.path.join(root, "job", "1")):
            if n.startswith(f"iter_{BIG_ITER:07d}_1_"):
                os.unlink(os.path.join(root, "job", "1", n))
    dist.barrier()
    mgr3 = LocalCheckpointManager(root, "job", repl)
    tasd, it = mgr3.load()
    out["recovered"] = (it, tasd.to_state_dict()["w"][0].item())
    mgr3.close()
    # without replication a lost shard means no complete checkpoint
    plain = LocalCheckpointManager(root, "plain")
    plain.save({"w": torch.ones(4)}, 3)
    plain.close()
    dist.barrier()
    if rank == 1:
        for n in os.listdir(os.path.join(root, "plain", "1")):
            os.unlink(os.path.join(root, "plain", "1", n))
    dist.barrier()
    plain2 = LocalCheckpointManager(root, "plain")
    out["plain_latest"] = plain2.find_latest()
    try:
        plain2.load()
    except CheckpointNotFoundError as exc:
        out["plain_error"] = str(exc)
    plain2.close()
    return out


@pytest.mark.timeout(150)
def test_local_save_load_replicate_and_recover(tmp_path):
    results = run_ranks(_local_flow, 2, str(tmp_path), timeout_s=140)
    for rank, (_, out) in enumerate(results):
        print(rank, out)
        assert out["empty"] == -1 and out["async"] == (True, 2) and out["reject_old"]
        peer = 1 - rank
        assert out["files"] == sorted(
            f"iter_{BIG_ITER:07d}_{o}_local.{ext}" for o in (rank, peer) for ext in ("json", "pt"))
        assert out["reload"] == (BIG_ITER, rank + 100.0, [rank, "x"])
        assert out["recovered"] == (BIG_ITER, rank + 100.0)  # rank 1 via rank 0's replica
        assert out["plain_latest"] == -1 and "covers all 2 ranks" in out["plain_error"]


def test_single_process_local_manager_and_corruption(tmp_path):
    mgr = LocalCheckpointManager(tmp_path, "s")
    try:
        state = {"a": torch.arange(10.0)}
        mgr.save(state, 5)
        tasd, it = mgr.load()
        assert it == 5 and torch.equal(tasd.to_state_dict()["a"], torch.arange(10.0))
        shard = tmp_path / "s" / "0" / "iter_0000005_0_local.pt"
        raw = bytearray(shard.read_bytes())
        raw[-20] ^= 0xFF
        shard.write_bytes(bytes(raw))
        from trainguard.checkpointing import CorruptCheckpointError

        with pytest.raises(CorruptCheckpointError, match="iter_0000005_0_local.pt"):
            LocalCheckpointManager(tmp_path, "s").load()
    finally:
        mgr.close()
