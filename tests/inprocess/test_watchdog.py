"""Progress watchdog: automatic stamps follow the main thread's bytecode, not wall time."""

from __future__ import annotations

import time

import torch  # noqa: F401 - classification looks at torch.distributed frames

from trainguard.inprocess._watchdog import ProgressBlock, ProgressWatchdog


def test_block_fields_and_age():
    block = ProgressBlock()
    block.set("iteration", 3)
    assert block.get("iteration") == 3.0
    block.touch()
    assert block.age_s() < 0.05
    block.set("manual", time.monotonic() - 2.0)  # armed manual stamp going stale
    assert block.age_s() >= 2.0
    block.set("manual", 0.0)  # disarmed
    assert block.age_s() < 0.1


def test_stamps_advance_while_running_bytecode_and_stop_in_c_calls():
    block = ProgressBlock()
    wd = ProgressWatchdog(block, interval_s=0.02)
    wd.start()
    try:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:  # Python bytecode: pending calls run
            pass
        assert block.age_s() < 0.2
        ticks = block.get("done_ticks")
        assert ticks >= 3
        seen = []
        import threading

        probe = threading.Timer(0.45, lambda: seen.append(block.age_s()))
        probe.start()
        time.sleep(0.6)  # in C with the GIL released: no stamp can be taken
        probe.join()
        print(f"age seen 0.45 s into a sleep: {seen[0]:.3f} s")
        assert seen[0] >= 0.35
        # the queued callback runs at the next bytecode boundary
        for _ in range(1000):
            pass
        time.sleep(0.05)
        assert block.age_s() < 0.2
    finally:
        wd.close()
    assert not wd._thread.is_alive()


def test_waiting_on_peer_needs_a_fresh_sample():
    block = ProgressBlock()
    block.set("in_collective", 1.0)
    block.set("sampled_at", time.monotonic())
    assert block.waiting_on_peer(0.5)
    block.set("sampled_at", time.monotonic() - 1.0)  # watchdog thread could not run
    assert not block.waiting_on_peer(0.5)


def test_close_is_idempotent():
    wd = ProgressWatchdog(ProgressBlock(), interval_s=0.01)
    wd.start()
    wd.close()
    wd.close()


def _monitor(block: ProgressBlock, grace_s: float):
    """The monitor process's state machine, built in this process (no fork, no store)."""
    import logging
    import os

    from trainguard.inprocess._monitor_process import MonitorConfig, _Monitor

    cfg = MonitorConfig(initial_rank=0, initial_world_size=1, interval_s=0.01, soft_s=1.0,
                        hard_s=10.0, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0,
                        barrier_timeout_s=20.0, grace_s=0.1, collective_grace_s=1.0,
                        watchdog_interval_s=0.01, undelivered_grace_s=grace_s)
    r, w = os.pipe()
    mon = _Monitor(cfg, block, None, r, w, os.getpid(), logging.getLogger("test"))
    return mon, (r, w)


def test_a_soft_timeout_escalates_only_while_the_watchdog_thread_is_silent():
    import os

    block = ProgressBlock()
    mon, fds = _monitor(block, grace_s=0.05)
    wd = ProgressWatchdog(block, interval_s=0.01)
    try:
        wd.start()
        mon.soft_at = (3, time.monotonic())  # the soft timeout of iteration 3 fired now
        time.sleep(0.15)  # this thread sleeps with the GIL released: the watchdog thread runs
        assert not mon._undeliverable(3)  # the interrupt can be taken (a C-call hang)
        wd.close()  # from now on the watchdog thread is silent, as under a GIL-holding hang
        assert not mon._undeliverable(3)  # silent for less than the grace
        time.sleep(0.1)
        assert mon._undeliverable(3)
        mon.soft_at = (3, time.monotonic())
        assert not mon._undeliverable(3)  # the soft timeout fired less than the grace ago
        assert not mon._undeliverable(4)  # another iteration's soft timeout has not fired
    finally:
        wd.close()
        for fd in (*fds, mon.pidfd):
            if fd is not None:
                os.close(fd)
