"""An idle checkpoint writer killed from outside (``kill -9``, the OOM killer) is noticed at once:
one WARNING naming its pid and signal, no hang, and the next save gets a new writer and commits;
the checkpoint committed before the kill stays loadable."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from trainguard._core.hooks import run_release_callbacks
from trainguard.checkpointing import AsyncCheckpointer
from trainguard.checkpointing.async_ckpt import _pool
from trainguard.testing import wait_gone


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trainguard.checkpointing" and r.levelno == logging.WARNING]


def _wait_warning(caplog, text: str, timeout_s: float) -> list[str]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = [m for m in _warnings(caplog) if text in m]
        if found:
            return found
        time.sleep(0.02)
    return []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_sigkilled_idle_writer_is_logged_at_once_and_the_next_save_commits(
        tmp_path, caplog, monkeypatch, pool):
    if not pool:
        monkeypatch.setenv("TRAINGUARD_CKPT_WRITER_POOL", "0")
    caplog.set_level(logging.WARNING, logger="trainguard.checkpointing")
    ck = AsyncCheckpointer(tmp_path, keep_last=3)
    try:
        ck.save({"w": torch.full((64,), 1.0)}, 1)
        assert ck.wait() == [1]
        pid = ck.writer.pid
        assert pid is not None and ck.writer.idle()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        lines = _wait_warning(caplog, f"pid {pid} ", 5.0)
        took = time.monotonic() - t0
        print(f"warning {took:.3f} s after the kill: {lines}")
        assert len(lines) == 1, _warnings(caplog)
        assert "idle checkpoint writer" in lines[0] and "rank 0" in lines[0], lines
        assert "SIGKILL" in lines[0] and "next save()" in lines[0], lines
        # replaced at once in the pool, else when the next save needs it
        assert ("starting in the writer pool" in lines[0]) == pool, lines
        assert took < 3.0, took
        # reaped by the watch itself: no zombie waits for the owner's next request
        assert not os.path.exists(f"/proc/{pid}"), pid
        time.sleep(0.2)
        assert len(_warnings(caplog)) == 1  # one line, not one per poll
        t0 = time.monotonic()
        ck.save({"w": torch.full((64,), 2.0)}, 2)
        assert ck.wait() == [2]
        print(f"save after the kill committed in {time.monotonic() - t0:.2f} s")
        assert ck.writer.pid not in (None, pid) and wait_gone(pid)
        # the pool's replacement (warm), else a cold start
        assert (ck.writer.starts, ck.writer.taken) == ((1, 1) if pool else (2, 0))
        assert ck.manager.committed_steps() == [1, 2]
        assert ck.load()[0]["w"][0].item() == 2.0 and ck.load()[1] == 2
    finally:
        ck.close()
    assert len(_warnings(caplog)) == 1  # stopping the new writer on purpose is not a death


@pytest.mark.timeout(90)
def test_parking_is_silent_and_a_killed_pooled_writer_is_replaced(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainguard.checkpointing")
    ck = AsyncCheckpointer(tmp_path / "a")
    ck.save({"w": torch.zeros(8)}, 1)
    assert ck.wait() == [1]
    pid = ck.writer.pid
    ck.abort()  # parks the idle writer in the pool: not a death
    ck.close()
    assert pid is not None and _pool.idle_pids() == [pid]
    time.sleep(0.1)
    assert _warnings(caplog) == []
    os.kill(pid, signal.SIGKILL)
    lines = _wait_warning(caplog, f"pid {pid} ", 5.0)
    assert len(lines) == 1 and "pooled idle checkpoint writer" in lines[0], lines
    assert "SIGKILL" in lines[0], lines
    new = AsyncCheckpointer(tmp_path / "b")
    try:  # the dead pooled writer is not taken: a fresh one writes
        new.save({"w": torch.ones(8)}, 2)
        assert new.wait() == [2] and new.load()[0]["w"][0].item() == 1.0
        assert (new.writer.starts, new.writer.taken) == (1, 0) and new.writer.pid != pid
    finally:
        new.close()
    run_release_callbacks()  # drains the pool: stopping on purpose is silent
    assert wait_gone(pid) and len(_warnings(caplog)) == 1, _warnings(caplog)
