"""Multi-rank (gloo) async checkpointing: agreement on errors, corrupt shards, DCP interop,
crashes."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch
import torch.distributed as dist
from _ckpt_dist import run_ranks

from trainguard.checkpointing import (
    AsyncCheckpointer,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointWorkerError,
    CheckpointWriteError,
)
from trainguard.checkpointing.manager import rank_file


def _flip_bit(path: str) -> None:
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[len(raw) // 2] ^= 0x10
    with open(path, "wb") as f:
        f.write(bytes(raw))


def _errors_and_recovery(rank: int, world_size: int, root: str) -> dict:
    faults = (
        {
            3: {"phase": "fsync", "action": "errno", "errno": errno.EDQUOT},
            4: {"phase": "write", "action": "sigkill"},
        }
        if rank == 1
        else {}
    )
    ck = AsyncCheckpointer(
        root, keep_last=3, write_timeout=30, collective_timeout=30, faults=faults
    )
    out: dict = {}
    try:
        state = {"w": torch.full((1000,), float(rank)), "step": torch.tensor(1)}
        ck.save(state, 1)
        state["w"].add_(10)  # after save returned: must not reach the file
        state["step"].fill_(2)
        assert ck.wait() == [1]
        ck.save(state, 2)
        polls = 0
        while not (done := ck.maybe_finalize()):  # non-blocking, one all-reduce per call
            polls += 1
            assert polls < 20000
        out["poll_done"] = done
        for step, cls in ((3, CheckpointWriteError), (4, CheckpointWorkerError)):
            ck.save(state, step)
            try:
                ck.wait()
                out[step] = "no error"
            except cls as exc:
                out[step] = (type(exc).__name__, sorted(exc.failures), str(exc))
        ck.save(state, 5)
        out["5"] = ck.wait()
        out["committed"] = ck.manager.committed_steps()
        # report #7: back-to-back saves with a main-thread collective on the default group
        ck.save(state, 6)
        ck.save(state, 7)
        dist.barrier()
        out["b2b"] = ck.wait()
        obj, step = ck.load()
        out["load5"] = (step, obj["w"][0].item(), obj["step"].item())
        if rank == 1:  # bit-flip rank 1's newest shard: every rank must fall back together
            _flip_bit(os.path.join(ck.manager.path_of(7), rank_file(1)))
        dist.barrier()
        obj, step = ck.load()
        out["fallback"] = (step, obj["w"][0].item())
        out["writer_starts"] = ck.writer.starts
    finally:
        ck.close(finalize=False)
    return out


def _dcp_both_ways(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {
        "shared": torch.arange(6.0),
        f"own{rank}": torch.full((3, 2), float(rank)),
        "nested": {"b": torch.ones(2)},
        "meta": {"epoch": 3},
    }  # same fqn on all ranks = replicated (DCP dedup)
    with AsyncCheckpointer(os.path.join(root, "ours"), format="dcp", collective_timeout=30) as ck:
        ck.save(state, 7)
        state[f"own{rank}"].fill_(-1)  # mutation after save must not be saved
        assert ck.wait() == [7]
        target = {
            "shared": torch.zeros(6),
            f"own{rank}": torch.zeros(3, 2),
            "nested": {"b": torch.zeros(2)},
            "meta": {"epoch": 0},
        }
        dcp.load(target, checkpoint_id=ck.manager.path_of(7))  # torch reads what we wrote
        ours = (
            target[f"own{rank}"][0, 0].item(),
            target["nested"]["b"][0].item(),
            target["meta"]["epoch"],
            torch.equal(target["shared"], torch.arange(6.0)),
        )
        native = os.path.join(root, "native")
        dcp.save(
            {
                "x": torch.full((4,), 5.0 + rank) if False else torch.full((4,), 5.0),
                f"y{rank}": torch.full((2,), float(rank)),
            },
            checkpoint_id=native,
        )
        got = {"x": torch.zeros(4), f"y{rank}": torch.zeros(2)}
        ck.load_dcp(got, checkpoint_id=native)  # we read what torch wrote
        again = {
            "shared": torch.zeros(6),
            f"own{rank}": torch.zeros(3, 2),
            "nested": {"b": torch.zeros(2)},
            "meta": {"epoch": 0},
        }
        step = ck.load_dcp(again)
    return {
        "ours": ours,
        "native": (got["x"][0].item(), got[f"y{rank}"][0].item()),
        "verified": (step, again[f"own{rank}"][0, 0].item()),
    }


def _dcp_then_errors(rank: int, world_size: int, root: str) -> dict:
    """Both 2-rank scenarios below in one launch (one spawn and process group for two tests):
    DCP interop in ``root/dcp``, then errors and recovery in ``root/errors``."""
    return {"dcp": _dcp_both_ways(rank, world_size, os.path.join(root, "dcp")),
            "errors": _errors_and_recovery(rank, world_size, os.path.join(root, "errors"))}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple:
    """(root, per-rank results of :func:`_dcp_then_errors`), run once for the module."""
    root = tmp_path_factory.mktemp("ckpt_dist")
    results = run_ranks(_dcp_then_errors, 2, str(root), timeout_s=250)  # the two runs had 140 + 110
    return root, [out for _, out in results]


@pytest.mark.timeout(300)  # the first test to ask for the shared launch also waits for it
def test_errors_reach_every_rank_and_corrupt_shard_fallback(two_rank_run):
    root, outs = two_rank_run
    results = [out["errors"] for out in outs]
    for rank, out in enumerate(results):
        print(rank, out)
        assert out["poll_done"] == [2]
        assert out[3][0] == "CheckpointWriteError" and out[3][1] == [1]
        assert "Disk quota exceeded" in out[3][2]
        assert out[4][0] == "CheckpointWorkerError" and out[4][1] == [1] and "SIGKILL" in out[4][2]
        assert out["5"] == [5] and out["committed"] == [1, 2, 5]  # failed 3 and 4 left nothing
        assert out["b2b"] == [6, 7]
        assert out["load5"] == (7, rank + 10.0, 2)
        assert out["fallback"] == (6, rank + 10.0)  # step 7 skipped on both ranks
    assert results[1]["writer_starts"] == 2 and results[0]["writer_starts"] == 1
    with pytest.raises(CheckpointMismatchError, match="written by 2 ranks"):
        CheckpointManager(root / "errors").load(step=5, world_size=1)


@pytest.mark.timeout(300)
def test_dcp_interop_both_ways(two_rank_run):
    root, outs = two_rank_run
    for rank, out in enumerate(out["dcp"] for out in outs):
        assert out["ours"] == (float(rank), 1.0, 3, True), out
        assert out["native"] == (5.0, float(rank)) and out["verified"] == (7, float(rank))
    # a world-size change: DCP reshards, one process reads everything the 2 ranks wrote
    import torch.distributed.checkpoint as dcp

    full = {"shared": torch.zeros(6), "own0": torch.zeros(3, 2), "own1": torch.zeros(3, 2)}
    dcp.load(full, checkpoint_id=CheckpointManager(root / "dcp" / "ours").path_of(7),
             no_dist=True)
    assert full["own1"][0, 0].item() == 1.0 and full["own0"][0, 0].item() == 0.0


def _crash_mid_write(rank: int, world_size: int, root: str) -> str:
    ck = AsyncCheckpointer(root, collective_timeout=15)
    ck.save({"w": torch.full((1 << 20,), 1.0)}, 1)
    ck.wait()
    ck.save({"w": torch.full((1 << 20,), 2.0)}, 2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies while its writer writes
    try:
        ck.wait()
        return "committed"
    except Exception as exc:  # noqa: BLE001 - gloo reports the dead peer (any error type) - never a hang
        return type(exc).__name__
    finally:
        ck.close(finalize=False)


def _resume(rank: int, world_size: int, root: str) -> tuple:
    ck = AsyncCheckpointer(root, collective_timeout=15)
    try:
        obj, step = ck.load()
        return step, obj["w"][0].item(), CheckpointManager(root).all_steps()
    finally:
        ck.close()


@pytest.mark.timeout(150)
def test_rank_killed_mid_write_resumes_from_previous(tmp_path):
    """Report #6: latest only advances after commit; a crash leaves the previous one loadable."""
    first = run_ranks(_crash_mid_write, 2, str(tmp_path), timeout_s=60, expect_ok=False)
    print(first)
    assert first[1][0] == "died" and first[0][1] != "committed", first
    assert CheckpointManager(tmp_path).committed_steps() == [1]
    second = run_ranks(_resume, 2, str(tmp_path), timeout_s=60)
    for _, (step, value, steps) in second:
        assert (step, value) == (1, 1.0) and steps == [1]  # stale step 2 removed at start
