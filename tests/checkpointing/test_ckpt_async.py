"""AsyncCheckpointer in one process: snapshots, real writer faults, I/O errors, memory, reset."""

from __future__ import annotations

import errno
import os
import time
from collections import OrderedDict

import psutil
import pytest
import torch

from trainguard._core.hooks import run_reset_callbacks
from trainguard.checkpointing import (
    AsyncCheckpointer,
    CheckpointManager,
    CheckpointWorkerError,
    CheckpointWriteError,
    StateDictError,
)
from trainguard.checkpointing.async_ckpt import _pool
from trainguard.checkpointing.manager import rank_file
from trainguard.errors import ConfigError


class Point:  # importable by the writer (module of this test file is on its sys.path)
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def _state(v: float = 1.0):
    return {
        "model": OrderedDict(w=torch.full((256, 64), v), b=torch.arange(8, dtype=torch.int64)),
        "optim": {"state": {0: {"step": torch.tensor(v), "exp_avg": torch.full((256, 64), v / 2)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99)}]},
        "extra": [torch.ones(3, dtype=torch.bfloat16), "text", 42, None],
        "view": torch.arange(100.0)[10:20],
    }


@pytest.mark.timeout(90)
def test_round_trip_snapshot_and_torch_load(tmp_path):
    with AsyncCheckpointer(tmp_path / "ck", keep_last=2) as ck, \
            torch.serialization.safe_globals([Point]):  # a user type, allowed for loading
        state = _state(1.0)
        state["user"] = Point(3)
        ck.save(state, 1)
        # mutate immediately: CPU tensors in place, a rebind, the "step" scalar
        # (reports #2, #3, #15)
        state["model"]["w"].add_(100.0)
        state["optim"]["state"][0]["step"].fill_(2.0)
        state["view"].zero_()
        assert ck.wait() == [1]
        obj, step = ck.load()
        assert step == 1 and obj["optim"]["state"][0]["step"].item() == 1.0
        assert torch.equal(obj["model"]["w"], torch.full((256, 64), 1.0))
        assert torch.equal(obj["view"], torch.arange(10.0, 20.0))
        assert obj["extra"][1:] == ["text", 42, None] and obj["extra"][0].dtype == torch.bfloat16
        assert obj["user"] == Point(3) and obj["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
        # reallocated tensors between saves are saved with their new values (report #4)
        state["model"]["w"] = torch.full((256, 64), 7.0)
        ck.save(state, 2)
        ck.wait()
        direct = torch.load(
            tmp_path / "ck" / CheckpointManager.step_dir(2) / rank_file(0), weights_only=False
        )  # a plain torch.save file
        assert direct["model"]["w"][0, 0].item() == 7.0
        # torch.save-style per-rank file
        ck.async_save({"a": torch.ones(2)}, str(tmp_path / "plain.pt"))
        assert ck.wait() == [None]
        assert torch.equal(torch.load(tmp_path / "plain.pt")["a"], torch.ones(2))
        assert ck.writer.starts == 1  # one persistent writer for all saves


@pytest.mark.timeout(120)
def test_writer_killed_at_each_phase_errors_then_recovers(tmp_path):
    """Report #1 (Megatron-LM#6970): a dead or stuck writer is an error, never a hang."""
    phases = {
        2: {"phase": "recv", "action": "exit"},
        3: {"phase": "write", "action": "sigkill"},
        4: {"phase": "reply", "action": "sigkill"},
        5: {"phase": "write", "action": "hang"},
    }
    ck = AsyncCheckpointer(tmp_path, keep_last=5, write_timeout=4.0, faults=phases)
    try:
        ck.save(_state(1.0), 1)
        ck.wait()
        for step, fault in phases.items():
            ck.save(_state(float(step)), step)
            if fault["action"] == "hang":  # report #10: a stalled writer never blocks training
                t0 = time.monotonic()
                ck.save(_state(6.0), 6)  # the second arena is free: no wait
                print(f"save while the writer hangs blocked {time.monotonic() - t0:.3f}s")
                assert time.monotonic() - t0 < 2.0 and ck.num_unfinalized == 2
            t0 = time.monotonic()
            with pytest.raises(CheckpointWorkerError, match=r"rank\(s\) \[0\]") as info:
                ck.wait()
            print(step, fault, f"{time.monotonic() - t0:.2f}s", info.value)
            if fault["action"] == "hang":
                assert ck.durability_lag_s > 3.0
                with pytest.raises(CheckpointWorkerError, match="step 6|stuck"):
                    ck.wait()  # the save queued behind the stuck one fails too
            assert ck.manager.committed_steps() == [1]
            assert ck.manager.load()[1] == 1  # previous checkpoint intact and loadable
        ck.save(_state(9.0), 9)
        assert ck.wait() == [9] and ck.writer.starts == len(phases) + 1
        assert ck.load()[0]["model"]["w"][0, 0].item() == 9.0
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(90)
def test_enospc_edquot_eacces_on_write_fsync_rename(tmp_path):
    """Reports #11/#12: errors on every I/O call; previous checkpoint intact; re-save works."""
    cases = [
        ("write", errno.ENOSPC),
        ("fsync", errno.EDQUOT),
        ("replace", errno.ENOSPC),
        ("write", errno.EDQUOT),
        ("fsync", errno.ENOSPC),
        ("replace", errno.EACCES),
    ]
    faults = {
        10 + i: {"phase": op, "action": "errno", "errno": e} for i, (op, e) in enumerate(cases)
    }
    ck = AsyncCheckpointer(tmp_path, keep_last=3, faults=faults)
    try:
        ck.save(_state(1.0), 1)
        ck.wait()
        for step, fault in faults.items():
            ck.save(_state(2.0), step)
            with pytest.raises(CheckpointWriteError, match=os.strerror(fault["errno"])):
                ck.wait()
            assert ck.manager.all_steps() == [1], os.listdir(tmp_path)  # no partial step left
        assert ck.writer.starts == 1  # I/O errors do not cost the writer
        ck.faults.clear()
        ck.save(_state(3.0), 10)  # re-saving a failed step works (no FileExistsError)
        assert ck.wait() == [10] and ck.load()[0]["model"]["w"][0, 0].item() == 3.0
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(60)
def test_commit_runs_in_the_writer_and_its_enospc_is_a_write_error(tmp_path, monkeypatch):
    """Issue 14: manifest fsyncs and pruning run in the writer, not on the trainer's thread; a
    full disk at the manifest is still a CheckpointWriteError on the trainer."""
    ck = AsyncCheckpointer(tmp_path, keep_last=1,
                           faults={2: {"phase": "commit", "action": "errno",
                                       "errno": errno.ENOSPC}})
    try:
        ck.save(_state(1.0), 1)
        ck.wait()
        ck.save(_state(2.0), 2)
        with pytest.raises(CheckpointWriteError, match="commit of manifest failed.*No space"):
            ck.wait()
        assert ck.manager.committed_steps() == [1] and ck.load()[1] == 1

        def trainer_io(*a, **k):
            raise AssertionError("the trainer wrote a checkpoint file itself")

        for name in ("replace", "fsync", "write"):  # the trainer process may not do the commit
            monkeypatch.setattr(os, name, trainer_io)
        ck.save(_state(3.0), 3)
        assert ck.wait() == [3]
        monkeypatch.undo()
        assert ck.manager.committed_steps() == [3]  # committed and pruned by the writer
        assert ck.load()[0]["model"]["w"][0, 0].item() == 3.0
    finally:
        ck.close(finalize=False)


@pytest.mark.timeout(90)
def test_host_memory_bounded_over_50_saves(tmp_path):
    """Report #5: RSS stays bounded; at most max_in_flight staging arenas exist."""
    state = {f"t{i}": torch.randn(64, 1024) for i in range(16)}  # 4 MiB
    proc = psutil.Process()
    with AsyncCheckpointer(tmp_path, keep_last=1, max_in_flight=2) as ck:
        ck.save(state, 0)
        ck.wait()
        rss0, fds0 = proc.memory_info().rss, len(os.listdir("/proc/self/fd"))
        for step in range(1, 51):
            ck.save(state, step)
            ck.maybe_finalize()
            assert ck.pool.count() <= 2  # staging arenas (memfd) reused, never accumulated
            fds = len(os.listdir("/proc/self/fd"))
            assert fds - fds0 < 8, f"{fds - fds0} more open descriptors"
        ck.wait()
        growth = proc.memory_info().rss - rss0
        print(f"RSS growth over 50 saves: {growth / 2**20:.1f} MiB (state 4 MiB)")
        assert growth < 64 * 2**20
        assert ck.manager.committed_steps() == [50]


@pytest.mark.timeout(60)
def test_ten_thousand_tensors(tmp_path):
    """Report #14: per-tensor shm handles exhausted fds; one arena moves 10k tensors."""
    state = {f"p{i}": torch.full((3,), float(i)) for i in range(10_000)}
    with AsyncCheckpointer(tmp_path) as ck:
        t0 = time.perf_counter()
        ck.save(state, 1)
        print(f"staging 10k tensors: {time.perf_counter() - t0:.3f}s")
        ck.wait()
        obj, _ = ck.load()
        assert len(obj) == 10_000 and obj["p9999"][0].item() == 9999.0


@pytest.mark.timeout(60)
def test_reset_callback_kills_writer_and_next_save_respawns(tmp_path):
    ck = AsyncCheckpointer(tmp_path)
    try:
        ck.save(_state(1.0), 1)
        ck.wait()
        pid = ck.writer.pid
        ck.save(_state(2.0), 2)  # in flight when the restart aborts
        assert "trainguard.checkpointing.async" not in run_reset_callbacks()
        # the busy writer is killed; its replacement starts in the writer pool at once
        assert ck.writer.pid is None and ck.num_unfinalized == 0
        fresh = _pool.idle_pids()
        assert len(fresh) == 1 and pid not in fresh
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        ck.save(_state(3.0), 3)
        assert ck.wait() == [3] and ck.writer.pid == fresh[0] and _pool.idle_pids() == []
        assert ck.writer.starts == 1 and ck.writer.taken == 1
    finally:
        ck.close(finalize=False)


def test_bad_input_errors(tmp_path):
    import threading

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.geteuid() != 0:  # root ignores directory permissions
            with pytest.raises(ConfigError, match="not writable"):
                AsyncCheckpointer(ro / "ck")
    finally:
        os.chmod(ro, 0o700)
    with pytest.raises(ConfigError, match="format"):
        AsyncCheckpointer(tmp_path, format="zip")
    ck = AsyncCheckpointer(tmp_path)
    try:
        with pytest.raises(StateDictError, match=r"opt\.lock"):
            ck.save({"opt": {"lock": threading.Lock()}}, 1)
        with pytest.raises(ConfigError, match="step"):
            ck.save({}, -1)
        assert ck.num_unfinalized == 0  # nothing queued
    finally:
        ck.close()
    with pytest.raises(ConfigError, match="not initialized"):
        AsyncCheckpointer(tmp_path, use_dist=True)  # report #8: misconfiguration raises
    with (
        AsyncCheckpointer(tmp_path, format="dcp") as dck,
        pytest.raises(ConfigError, match="str keys"),
    ):
        dck.save({1: torch.ones(1)}, 1)


@pytest.mark.timeout(60)
def test_on_error_log_policy_continues(tmp_path):
    """Report #16: non-fatal checkpoint failures with retry on the next save."""
    ck = AsyncCheckpointer(
        tmp_path,
        on_error="log",
        faults={2: {"phase": "write", "action": "errno", "errno": errno.ENOSPC}},
    )
    try:
        ck.save(_state(1.0), 1)
        ck.save(_state(2.0), 2)
        assert ck.durability_lag_s > 0.0
        ck.save(_state(3.0), 3)
        assert ck.wait() == [1, 3] and ck.failed_saves == 1 and ck.durability_lag_s == 0.0
        assert ck.manager.committed_steps() == [1, 3]
    finally:
        ck.close()


@pytest.mark.timeout(60)
def test_fsspec_url_through_the_writer(tmp_path):
    url = f"file://{tmp_path}/bucket/run1"
    with AsyncCheckpointer(url) as ck:
        ck.save(_state(4.0), 3)
        assert ck.wait() == [3]
        obj, step = ck.load()
        assert step == 3 and obj["model"]["w"][0, 0].item() == 4.0
    assert (tmp_path / "bucket" / "run1" / CheckpointManager.step_dir(3) / "manifest.json").exists()


@pytest.mark.timeout(60)
def test_staging_budget_bounds_memory(tmp_path):
    """Report #13: staging is capped; too-large states fail up front instead of OOM-killing."""
    state = {f"t{i}": torch.ones(256, 1024) for i in range(4)}  # 4 MiB
    with AsyncCheckpointer(tmp_path, staging_budget_bytes=6 << 20, max_in_flight=4) as ck:
        for step in range(1, 4):
            ck.save(state, step)  # each waits for the previous write: one arena fits the budget
            assert ck.pool.count() == 1
        assert ck.wait() == [1, 2, 3]
        with pytest.raises(ConfigError, match="staging_budget_bytes"):
            ck.save({"big": torch.ones(2 << 20)}, 4)  # 8 MiB > budget
