"""User reports (spec checkpointing.md §6) not fully covered by the other files of this directory.

Coverage of every §6 row (the test that covers it, here or elsewhere):

| # | report | test |
|---|---|---|
| 1 | Megatron-LM#6970 | test_ckpt_async::test_writer_killed_at_each_phase_errors_then_recovers, test_ckpt_dist::test_errors_reach_every_rank_and_corrupt_shard_fallback |
| 2 | NVRx PR#376 | test_ckpt_async::test_round_trip_snapshot_and_torch_load (CPU tensors; GPU: n/a on CPU) |
| 3 | pytorch#144657 | same as 2, and test_ckpt_dist (mutation after save on 2 ranks, DCP format too) |
| 4 | NeMo-RL#3312 | test_nemo_rl_3312_every_save_holds_its_own_values (here) |
| 5 | pytorch#170163 | test_ckpt_async::test_host_memory_bounded_over_50_saves |
| 6 | KempnerForge#102 | test_ckpt_dist::test_rank_killed_mid_write_resumes_from_previous |
| 7 | KempnerForge#104 | test_ckpt_dist::test_errors_reach_every_rank_and_corrupt_shard_fallback (b2b + barrier) |
| 8 | pytorch#120241 | test_ckpt_async::test_bad_input_errors (use_dist without a process group) |
| 9 | Megatron-LM#2422 | test_megatron_2422_stuck_write_times_out_with_diagnostics (here) |
| 10 | NVRx PR#373 | test_ckpt_async::test_writer_killed_at_each_phase_errors_then_recovers (hang phase) |
| 11 | Automodel#3390 | test_automodel_3390_edquot_on_latest_update_then_resave (here), test_ckpt_async::test_enospc_edquot_eacces_on_write_fsync_rename |
| 12 | tnt#559 | test_ckpt_storage::test_cleanup_stale_removes_uncommitted_and_temporaries, test_tnt_559_failed_save_is_never_restored_from (here) |
| 13 | Megatron-LM#61 | test_ckpt_async::test_staging_budget_bounds_memory |
| 14 | xtuner#1859 | test_ckpt_async::test_ten_thousand_tensors |
| 15 | torchtitan#930 | test_ckpt_async::test_round_trip_snapshot_and_torch_load |
| 16 | Megatron-LM#1435 | test_ckpt_async::test_on_error_log_policy_continues |
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from trainguard.checkpointing import AsyncCheckpointer, CheckpointManager, CheckpointWorkerError
from trainguard.checkpointing.errors import CheckpointWriteError


@pytest.mark.timeout(60)
def test_nemo_rl_3312_every_save_holds_its_own_values(tmp_path):
    """https://github.com/NVIDIA-NeMo/RL/issues/3312 (+#4183): cached IPC handles made every
    later checkpoint bit-identical to the first.

    Six saves through reused staging arenas, alternating in-place updates (same storage, same
    data_ptr), fresh allocations, and a free-then-allocate of the same size (the allocator
    usually hands back the same address). Every committed step holds its own values.
    """
    state = {"w": torch.zeros(64, 1024), "b": torch.zeros(16)}
    with AsyncCheckpointer(tmp_path, keep_last=6, max_in_flight=2) as ck:
        ptrs = []
        for step in range(1, 7):
            if step % 3 == 1:
                state["w"].fill_(float(step))  # in place: same storage as the previous save
            elif step % 3 == 2:
                state["w"] = torch.full((64, 1024), float(step))  # new tensor
            else:
                del state["w"]  # free, then allocate the same size
                state["w"] = torch.full((64, 1024), float(step))
            state["b"].fill_(-float(step))
            ptrs.append(state["w"].data_ptr())
            ck.save(state, step)
        assert ck.wait() == [1, 2, 3, 4, 5, 6]
        print("data_ptrs:", ptrs, "arenas:", ck.pool.count())
        for step in range(1, 7):
            obj, got = ck.load(step=step)
            assert got == step
            assert torch.equal(obj["w"], torch.full((64, 1024), float(step))), step
            assert torch.equal(obj["b"], torch.full((16,), -float(step))), step


@pytest.mark.timeout(60)
def test_megatron_2422_stuck_write_times_out_with_diagnostics(tmp_path):
    """https://github.com/NVIDIA/Megatron-LM/issues/2422: an async save hung in join with its
    shards stuck at 6 KB. A write stuck in the writer process raises within ``write_timeout``
    (plus slack) naming the rank, the writer pid, the step and the timeout; the stuck writer is
    killed, the previous checkpoint stays loadable and the next save works.
    """
    ck = AsyncCheckpointer(
        tmp_path, keep_last=3, write_timeout=1.5, faults={2: {"phase": "write", "action": "hang"}}
    )
    try:
        ck.save({"w": torch.ones(1 << 16)}, 1)
        assert ck.wait() == [1]
        ck.save({"w": torch.full((1 << 16,), 2.0)}, 2)
        pid = ck.writer.pid
        t0 = time.monotonic()
        with pytest.raises(CheckpointWorkerError) as info:
            ck.wait()
        took = time.monotonic() - t0
        msg = str(info.value)
        print(f"stuck write reported after {took:.2f} s: {msg}")
        assert took < 1.5 + 10.0
        for needle in ("rank(s) [0]", f"pid {pid}", "step 2", "1.5 s", "write_timeout"):
            assert needle in msg, (needle, msg)
        assert ck.manager.committed_steps() == [1] and ck.load()[1] == 1
        ck.save({"w": torch.full((1 << 16,), 3.0)}, 3)
        assert ck.wait() == [3] and ck.writer.pid != pid
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(60)
def test_automodel_3390_edquot_on_latest_update_then_resave(tmp_path, monkeypatch):
    """https://github.com/NVIDIA-NeMo/Automodel/issues/3390: EDQUOT while updating ``LATEST``
    led to a stale resume and then ``FileExistsError`` when the step was saved again.

    The rename of the ``latest`` pointer fails with EDQUOT (``os.replace`` of that path only,
    in the writer process that commits). The failure is reported; a resume follows the commit markers (manifests), not
    the stale pointer, and loads a complete checkpoint; saving the same step again succeeds (no
    ``FileExistsError``) and leaves ``latest`` pointing at it.
    """
    quota_on_latest = {"phase": "commit:replace", "target": "latest", "action": "errno",
                       "errno": errno.EDQUOT}  # in the writer, which commits
    ck = AsyncCheckpointer(tmp_path, keep_last=3, faults={2: quota_on_latest})
    try:
        ck.save({"w": torch.full((1024,), 1.0)}, 1)
        assert ck.wait() == [1]
        ck.save({"w": torch.full((1024,), 2.0)}, 2)
        with pytest.raises(CheckpointWriteError, match="quota"):
            ck.wait()
        ck.faults.clear()
        assert (tmp_path / "latest").read_text().strip() == "1"  # stale pointer
        resume = CheckpointManager(tmp_path)  # a fresh process resuming
        obj, step = resume.load()
        print("committed after the failed pointer update:", resume.committed_steps())
        # the resume follows the commit markers, never the stale pointer, and is complete
        assert step == resume.committed_steps()[-1] and obj["w"][0].item() == float(step)
        ck.save({"w": torch.full((1024,), 2.5)}, 2)  # retry the same step: no FileExistsError
        assert ck.wait() == [2]
        assert (tmp_path / "latest").read_text().strip() == "2"
        obj, step = CheckpointManager(tmp_path).load()
        assert (step, obj["w"][0].item()) == (2, 2.5)
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(60)
def test_tnt_559_failed_save_is_never_restored_from(tmp_path):
    """https://github.com/meta-pytorch/tnt/issues/559: a failed async save left a directory
    without metadata and the job was restored from it.

    The writer is SIGKILLed in the middle of step 2's write; a fresh checkpointer (the restarted
    job) resumes from step 1, and the partial step-2 directory is removed at start.
    """
    ck = AsyncCheckpointer(
        tmp_path, keep_last=3, faults={2: {"phase": "write", "action": "sigkill"}}
    )
    try:
        ck.save({"w": torch.full((1 << 16,), 1.0)}, 1)
        assert ck.wait() == [1]
        ck.save({"w": torch.full((1 << 16,), 2.0)}, 2)
        with pytest.raises(CheckpointWorkerError, match="SIGKILL"):
            ck.wait()
    finally:
        ck.close(finalize=False)
    os.makedirs(tmp_path / CheckpointManager.step_dir(3))  # crashed trainer: data, no manifest
    (tmp_path / CheckpointManager.step_dir(3) / "rank_00000.pt").write_bytes(b"partial")
    with AsyncCheckpointer(tmp_path, keep_last=3) as resumed:
        obj, step = resumed.load()
        assert (step, obj["w"][0].item()) == (1, 1.0)
        assert CheckpointManager(tmp_path).all_steps() == [1]  # uncommitted steps removed
