"""The process-wide pool of warm checkpoint writers (issue 13): reuse across aborts, abandoned and
failed checkpointers, bounds, in-process restarts and reserve-rank pre-warming."""

from __future__ import annotations

import gc
import os
import sys
import time

import pytest
import torch

from trainguard._core.hooks import run_standby_callbacks
from trainguard.checkpointing import AsyncCheckpointer, prewarm_writers
from trainguard.checkpointing.async_ckpt import _pool
from trainguard.errors import ConfigError
from trainguard.inprocess import ActiveWorldSizeDivisibleBy, CallWrapper, Wrapper
from trainguard.testing import wait_gone

FAST = {
    "soft_timeout": 3.0, "hard_timeout": 6.0, "barrier_timeout": 10.0,
    "heartbeat_timeout": 5.0, "heartbeat_interval": 0.2, "monitor_process_interval": 0.05,
    "monitor_thread_interval": 0.1, "progress_watchdog_interval": 0.05,
    "termination_grace_time": 0.5,
}


@pytest.fixture
def single_rank_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        monkeypatch.delenv(var, raising=False)




def _memfd_maps(pid: int) -> list[str]:
    """The checkpoint arenas (memfd ``tg_ckpt_*``) process ``pid`` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "tg_ckpt_" in line]


def _wait_unmapped(pid: int, timeout_s: float = 5.0) -> list[str]:
    end = time.monotonic() + timeout_s
    while (maps := _memfd_maps(pid)) and time.monotonic() < end:
        time.sleep(0.02)
    return maps


@pytest.mark.timeout(90)
def test_aborted_idle_writer_is_reset_and_taken_by_a_new_checkpointer(tmp_path):
    """abort() parks the idle writer (which unmaps the arenas it was sent); a checkpointer made
    afterwards takes the same process warm instead of starting one; close() stops it."""
    state = {"w": torch.full((1 << 16,), 1.0)}
    old = AsyncCheckpointer(tmp_path / "a")
    old.save(state, 1)
    assert old.wait() == [1]
    pid = old.writer.pid
    assert pid is not None and _memfd_maps(pid)  # the arena is mapped in the writer
    old.abort()
    assert old.writer.pid is None and _pool.idle_pids() == [pid]
    assert _wait_unmapped(pid) == []  # op "reset": it holds nothing of the old checkpointer
    new = AsyncCheckpointer(tmp_path / "b")
    try:
        assert new.writer.pid == pid and new.writer.ready and _pool.idle_pids() == []
        assert (new.writer.starts, new.writer.taken) == (0, 1)
        new.save({"w": torch.full((1 << 16,), 2.0)}, 5)
        assert new.wait() == [5] and new.load()[0]["w"][0].item() == 2.0
    finally:
        new.close()
        old.close()
    assert wait_gone(pid) and _pool.idle_pids() == []  # close() stops; nothing is pooled


@pytest.mark.timeout(90)
def test_exit_with_error_and_abandoned_checkpointers_park_writers_bounded(tmp_path, monkeypatch):
    """Leaving ``with`` on an exception parks the idle writer; so does dropping the last
    reference; at most MAX_IDLE are kept and the rest stopped; drain() stops the pooled ones."""
    monkeypatch.setattr(_pool, "MAX_IDLE", 1)  # the bound, with as few processes as possible
    pids = []
    with pytest.raises(RuntimeError, match="boom"), AsyncCheckpointer(tmp_path / "w") as ck:
        pids.append(ck.writer.pid)
        raise RuntimeError("boom")
    assert _pool.idle_pids() == pids
    made = [AsyncCheckpointer(None, use_dist=False) for _ in range(_pool.MAX_IDLE + 1)]
    assert made[0].writer.pid == pids[0]  # taken back from the pool
    pids = [c.writer.pid for c in made]
    del made, ck
    gc.collect()  # the finalizers of the abandoned checkpointers run
    kept = _pool.idle_pids()
    assert len(kept) == _pool.MAX_IDLE and set(kept) <= set(pids)
    stopped = [p for p in pids if p not in kept]
    assert len(stopped) == 1 and wait_gone(stopped[0])
    assert _pool.drain() == _pool.MAX_IDLE and _pool.idle_pids() == []
    assert all(wait_gone(p) for p in kept)


@pytest.mark.timeout(60)
def test_pool_is_keyed_by_nice_and_can_be_disabled(monkeypatch):
    ck = AsyncCheckpointer(None, use_dist=False, writer_nice=5)
    try:
        pid = ck.writer.pid
        ck.abort()
        assert _pool.take(0) is None and _pool.idle_pids() == [pid]  # nice 0 wants another
        monkeypatch.setenv("TRAINGUARD_CKPT_WRITER_POOL", "0")  # the benchmark's baseline
        assert _pool.take(5) is None
        ck.writer.ensure_started()  # cold start although a matching writer is pooled
        assert ck.writer.pid != pid and (ck.writer.starts, ck.writer.taken) == (2, 0)
        cold = ck.writer.pid
        ck.abort()  # idle, but no pool: stopped
        assert ck.writer.pid is None and _pool.idle_pids() == [pid] and wait_gone(cold)
    finally:
        ck.close()
    assert _pool.drain() == 1 and wait_gone(pid)  # the pooled one outlives its old owner's close


def test_prewarm_writers_validates_its_argument():
    old = prewarm_writers(3)
    try:
        for bad in (-1, _pool.MAX_IDLE + 1, 1.5, True, "2"):
            with pytest.raises(ConfigError, match="prewarm_writers"):
                prewarm_writers(bad)  # type: ignore[arg-type]
    finally:
        assert prewarm_writers(old) == 3


@pytest.mark.timeout(90)
def test_checkpointer_made_inside_wrapped_function_reuses_the_previous_writer(
        single_rank_env, tmp_path):
    """Under ``inprocess.Wrapper`` a checkpointer made in every iteration takes the writer of the
    previous iteration's (aborted) one: one writer process throughout, warm after the restart."""
    seen: list[tuple[int | None, int, int]] = []

    @Wrapper(**FAST)
    def train(cw: CallWrapper):
        ck = AsyncCheckpointer(tmp_path / "ck", write_timeout=30.0, spare_writer=False)
        seen.append((ck.writer.pid, ck.writer.starts, ck.writer.taken))
        ck.save({"w": torch.full((1 << 14,), float(cw.iteration))}, 10 + cw.iteration)
        ck.wait()
        if cw.iteration < 2:
            raise RuntimeError(f"fault in iteration {cw.iteration}")
        ck.close()
        return ck.manager.committed_steps()

    assert train() == [11, 12]
    print("writer (pid, starts, taken) per iteration:", seen)
    assert [s[0] for s in seen] == [seen[0][0]] * 3
    assert [s[1:] for s in seen] == [(1, 0), (0, 1), (0, 1)]
    assert wait_gone(seen[0][0]) and _pool.idle_pids() == []  # the last one was closed


@pytest.mark.timeout(90)
def test_reserve_rank_standby_prewarms_writers(single_rank_env):
    """A rank the Wrapper leaves inactive (a reserve) runs the standby callbacks: the pool fills
    to prewarm_writers(n) writers and the trainer imports DCP's planner modules (from its second
    wait on: at job start the active ranks' own writers are starting)."""
    old = prewarm_writers(1)
    _pool._state["standby_calls"] = 0
    _pool._prewarm_thread.clear()
    try:
        run_standby_callbacks()  # the first wait of a process (job start): nothing starts
        assert _pool.idle_pids() == [] and not _pool._prewarm_thread

        @Wrapper(**FAST, rank_assignment=ActiveWorldSizeDivisibleBy(2))  # 1 rank: none active
        def train(cw: CallWrapper):
            raise AssertionError("a reserve rank must not run the function")

        assert train() is None
        for t in list(_pool._prewarm_thread):
            t.join(60.0)
        pids = _pool.idle_pids()
        assert len(pids) == 1 and "torch.distributed.checkpoint.default_planner" in sys.modules
        run_standby_callbacks()  # again: the pool is full already, nothing more starts
        for t in list(_pool._prewarm_thread):
            t.join(60.0)
        assert sorted(_pool.idle_pids()) == sorted(pids)
        ck = AsyncCheckpointer(None, use_dist=False)
        try:
            assert ck.writer.pid in pids and ck.writer.starts == 0 and ck.writer.taken == 1
        finally:
            ck.close()
    finally:
        prewarm_writers(old)


@pytest.mark.timeout(90)
def test_starting_writer_with_a_queued_save_is_parked_not_killed(tmp_path):
    """A save made while the writer still imports torch waits trainer-side; an abort then drops it
    and parks the writer (its import progress kept) instead of killing it, and the dropped save
    never reaches the disk."""
    ck = AsyncCheckpointer(tmp_path)
    try:
        ck.save({"w": torch.ones(1 << 12)}, 1)
        pid = ck.writer.pid
        assert not ck.writer.ready and ck.writer.owed == 0 and len(ck.writer.backlog) == 1
        ck.abort()
        assert _pool.idle_pids() == [pid]
        ck.save({"w": torch.full((1 << 12,), 2.0)}, 2)
        assert ck.writer.pid == pid and ck.wait() == [2]
        assert ck.manager.committed_steps() == [2] and not os.path.exists(ck.manager.path_of(1))
    finally:
        ck.close()


def _has_dcp_imported(pid: int, timeout_s: float = 60.0) -> bool:
    """Has process ``pid`` imported DCP? Importing ``torch.distributed.checkpoint`` loads the
    ``_lsprof`` extension (``import torch`` alone does not): a visible trace in its maps."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with open(f"/proc/{pid}/maps") as f:
            if any("_lsprof" in line for line in f):
                return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(120)
def test_dcp_checkpointer_writers_import_dcp_before_the_first_save(tmp_path):
    """A cold DCP import takes seconds (more than a soft timeout on a loaded 2-core machine):
    seen as a newly active rank's DCP save not committing for a whole iteration, then a soft
    timeout that killed the busy writer, whose cold replacement did the same next iteration.
    A ``format="dcp"`` checkpointer's writer imports DCP as soon as it has imported torch, and
    so does the pooled replacement of a DCP writer killed by an abort."""
    ck = AsyncCheckpointer(tmp_path, format="dcp", use_dist=False,
                           faults={1: {"phase": "write", "action": "hang"}})
    try:
        ck.warmup(timeout=60.0)
        assert _has_dcp_imported(ck.writer.pid), "the DCP writer did not import DCP before a save"
        ck.save({"w": torch.ones(8)}, 1)  # the writer hangs in this write: busy at the abort
        before = set(_pool.idle_pids())
        ck.abort()  # the busy writer is killed; its replacement starts in the pool
        new = [p for p in _pool.idle_pids() if p not in before]
        assert len(new) == 1
        assert _has_dcp_imported(new[0]), "the pooled replacement of a DCP writer is not warm"
    finally:
        ck.close()
        _pool.drain()


def _wait_title(pid: int, part: str, timeout_s: float = 10.0) -> bool:
    import psutil

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if part in " ".join(psutil.Process(pid).cmdline()):
            return True
        time.sleep(0.05)
    return False


def _wait_for_spare(timeout_s: float = 90.0, exclude: tuple[int | None, ...] = ()) -> int:
    """Pid of a ready pooled writer (the spare) not in ``exclude``, once one is there."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready = [p for p in _pool.idle_pids(ready_only=True) if p not in exclude]
        if ready:
            return ready[0]
        time.sleep(0.05)
    raise AssertionError(f"no ready spare writer in the pool within {timeout_s} s")


@pytest.mark.timeout(180)
def test_spare_writer_takes_over_after_abort_of_a_busy_writer(tmp_path):
    """Issue 13: an abort kills a writer busy with a save, and its replacement starts cold (it
    imports torch during the restart: seconds on a loaded machine, so the next save's commit
    waited for it). With a spare, the next save is written and committed by a writer that was
    warm before the fault; another spare then starts; close() and drain() leave nothing."""
    ck = AsyncCheckpointer(tmp_path, use_dist=False, spare_writer=True,
                           faults={1: {"phase": "write", "action": "hang"}})
    try:
        ck.warmup(timeout=60.0)
        busy = ck.writer.pid
        spare = _wait_for_spare(exclude=(busy,))
        assert _wait_title(spare, "(pooled, idle)")  # ps tells the spare from the writer in use
        ck.save({"w": torch.ones(1 << 12)}, 1)  # the writer hangs in this write
        ck.abort()  # busy: killed (no replacement at once: the spare replaces it)
        assert wait_gone(busy) and _pool.idle_pids() == [spare]
        ck.save({"w": torch.full((1 << 12,), 2.0)}, 2)
        assert ck.writer.pid == spare and ck.writer.taken == 1  # warm: imported before the fault
        assert ck.wait() == [2] and ck.load()[0]["w"][0].item() == 2.0
        nxt = _wait_for_spare(exclude=(busy, spare))  # the keeper starts the next spare
        assert _pool.idle_pids() == [nxt]
    finally:
        ck.close()
    assert wait_gone(spare)
    assert _pool.drain() == 1 and wait_gone(nxt) and not _pool._spare_thread


@pytest.mark.timeout(120)
def test_spare_writer_default_follows_the_restart_loop_and_busy_kills(tmp_path, monkeypatch):
    """``spare_writer=None``: inside ``inprocess.Wrapper``'s call (``_core.hooks``'s restart-loop
    flag, read at construction and at ``rebind``) once an abort there killed a busy writer (or
    from the start with ``TRAINGUARD_CKPT_SPARE_WRITER=1``), never outside; an explicit value
    wins; ``TRAINGUARD_CKPT_SPARE_WRITER=0`` keeps every spare off; a bad value is refused."""
    from trainguard._core.hooks import in_restart_loop, restart_loop

    monkeypatch.setitem(_pool._state, "busy_kills", 0)
    monkeypatch.delenv("TRAINGUARD_CKPT_SPARE_WRITER", raising=False)
    outside = AsyncCheckpointer(None, use_dist=False)
    made = []
    try:
        assert not in_restart_loop() and not outside.writer.spare
        with restart_loop():
            assert in_restart_loop()
            made += [AsyncCheckpointer(None, use_dist=False),
                     AsyncCheckpointer(None, use_dist=False, spare_writer=True)]
            assert [c.writer.spare for c in made] == [False, True]  # no busy kill yet
            _pool.note_busy_kill()
            made += [AsyncCheckpointer(None, use_dist=False),
                     AsyncCheckpointer(None, use_dist=False, spare_writer=False)]
            outside.rebind()  # made before the loop, rebound inside it (the README's pattern)
            assert [c.writer.spare for c in made[2:]] == [True, False] and outside.writer.spare
        assert not in_restart_loop()
        with pytest.raises(ConfigError, match="spare_writer"):
            AsyncCheckpointer(None, use_dist=False, spare_writer="yes")  # type: ignore[arg-type]
        monkeypatch.setitem(_pool._state, "busy_kills", 0)
        monkeypatch.setenv("TRAINGUARD_CKPT_SPARE_WRITER", "1")
        with restart_loop():
            made.append(AsyncCheckpointer(None, use_dist=False))
            assert made[-1].writer.spare  # forced: from the start
        monkeypatch.setenv("TRAINGUARD_CKPT_SPARE_WRITER", "0")
        assert not _pool.spare_enabled()
        _pool.drain()
        _pool.want_spare(outside.writer)
        assert not _pool._spare_thread
        asked = AsyncCheckpointer(None, use_dist=False, spare_writer=True)
        assert not asked.writer.spare  # the environment wins: no spare, so replace at abort
        asked.close()
    finally:
        for ck in [outside, *made]:
            ck.close()
        _pool.drain()


@pytest.mark.timeout(120)
def test_wrapper_keeps_spares_after_its_first_restart_that_killed_a_busy_writer(
        single_rank_env, tmp_path, monkeypatch):
    """Under the Wrapper (its call is the restart loop), a checkpointer made before any busy
    writer was killed keeps no spare; iteration 0 raises while its writer is busy with a save,
    the abort kills that writer, and iteration 1's checkpointer keeps a spare, which is ready
    in the pool; the flag is off again after the call."""
    from trainguard._core.hooks import in_restart_loop

    monkeypatch.setitem(_pool._state, "busy_kills", 0)
    monkeypatch.delenv("TRAINGUARD_CKPT_SPARE_WRITER", raising=False)
    seen: list[tuple[bool, bool]] = []

    @Wrapper(**FAST)
    def train(cw: CallWrapper):
        ck = AsyncCheckpointer(tmp_path / "ck", write_timeout=30.0,
                               faults={1: {"phase": "write", "action": "hang"}})
        seen.append((in_restart_loop(), ck.writer.spare))
        if cw.iteration == 0:
            ck.warmup(timeout=60.0)
            ck.save({"w": torch.ones(1 << 12)}, 1)  # the writer hangs in this write
            raise RuntimeError("fault while the writer is busy")
        ck.warmup(timeout=60.0)
        spare = _wait_for_spare(exclude=(ck.writer.pid,))
        ck.close()
        return spare

    spare = train()
    assert seen == [(True, False), (True, True)] and not in_restart_loop()
    assert _pool.busy_kills() == 1
    assert _pool.drain() >= 1 and wait_gone(spare)
