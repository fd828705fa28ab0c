"""Process titles (``_core.proctitle``): ``ps`` tells a trainer, its in-process monitor and its
checkpoint writer apart (launcher workers: tests/fault_tolerance/test_ft_proctitle.py; runner
ranks: tests/runner/test_runner_contract.py)."""

from __future__ import annotations

import datetime
import os
import time

import psutil
import pytest
import torch

from trainguard._core.hooks import run_release_callbacks
from trainguard.checkpointing import AsyncCheckpointer
from trainguard.inprocess import CallWrapper, Wrapper

FAST = {
    "soft_timeout": 3.0, "hard_timeout": 6.0, "barrier_timeout": 10.0,
    "heartbeat_timeout": 5.0, "heartbeat_interval": 0.2, "monitor_process_interval": 0.05,
    "monitor_thread_interval": 0.1, "progress_watchdog_interval": 0.05,
    "termination_grace_time": 0.5,
}


def _title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()  # setproctitle pads the area
    except psutil.Error:  # gone, or a zombie not reaped yet
        return ""


def _wait_title(pid: int, want: str, timeout_s: float = 10.0) -> str:
    """The title of ``pid`` once it is ``want`` (a child sets it soon after it starts)."""
    end = time.monotonic() + timeout_s
    while (got := _title(pid)) != want and time.monotonic() < end:
        time.sleep(0.02)
    return got


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:trainguard. WORLD_SIZE is not set")
def test_inprocess_monitor_child_is_titled_apart_from_its_trainer(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        monkeypatch.delenv(var, raising=False)
    seen: dict[str, str] = {}
    # children of this process from earlier tests (a pooled checkpoint writer, a zombie not
    # reaped yet) are not the Wrapper's
    before = {p.pid for p in psutil.Process().children()}

    @Wrapper(**FAST)
    def train(cw: CallWrapper) -> int:
        kids = [k for k in psutil.Process().children() if k.pid not in before]
        for kid in kids:
            seen[str(kid.pid)] = _wait_title(kid.pid, "trainguard: rank 0 monitor")
        seen["trainer"] = _title(os.getpid())
        return len(kids)

    assert train() >= 1
    print(seen)
    monitors = [pid for pid, t in seen.items() if t == "trainguard: rank 0 monitor"]
    assert len(monitors) == 1, seen
    assert "monitor" not in seen["trainer"], seen


@pytest.mark.timeout(90)
def test_checkpoint_writer_is_titled_with_its_rank_and_when_pooled(tmp_path):
    ck = AsyncCheckpointer(tmp_path)
    try:
        ck.save({"w": torch.zeros(8)}, 1)
        assert ck.wait() == [1]
        pid = ck.writer.pid
        assert pid is not None
        assert _wait_title(pid, "trainguard: rank 0 ckpt writer") == (
            "trainguard: rank 0 ckpt writer")
        ck.abort()  # parked in the pool: the title says so
        assert _wait_title(pid, "trainguard: rank 0 ckpt writer (pooled, idle)") == (
            "trainguard: rank 0 ckpt writer (pooled, idle)")
    finally:
        ck.close()
        run_release_callbacks()


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:trainguard. WORLD_SIZE is not set")
def test_writer_of_a_checkpointer_without_a_group_names_the_launcher_rank(tmp_path, monkeypatch):
    """New-user finding: under ``trainguard launch`` a checkpointer made with ``use_dist=False``
    (or before ``init_process_group``) named rank 1's writer 'rank 0' in ``ps`` and in its death
    warning; it follows ``RANK``, then the group's rank after ``rebind``."""
    import torch.distributed as dist

    from trainguard.testing import free_port

    monkeypatch.setenv("RANK", "3")
    ck = AsyncCheckpointer(tmp_path, use_dist=False)
    try:
        ck.save({"w": torch.zeros(8)}, 1)
        assert ck.wait() == [1]
        pid = ck.writer.pid
        assert pid is not None and ck.writer.rank == 3
        assert _wait_title(pid, "trainguard: rank 3 ckpt writer") == (
            "trainguard: rank 3 ckpt writer")
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True,
                              timeout=datetime.timedelta(seconds=10))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            ck.rebind()  # parks the idle writer; the next save takes one for rank 0
            assert ck.writer.rank == 0
            ck.save({"w": torch.ones(8)}, 2)
            assert ck.wait() == [2]
            pid = ck.writer.pid
            assert pid is not None
            assert _wait_title(pid, "trainguard: rank 0 ckpt writer") == (
                "trainguard: rank 0 ckpt writer")
        finally:
            dist.destroy_process_group()
    finally:
        ck.close()
        run_release_callbacks()
