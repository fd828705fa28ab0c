"""Interrupt delivery and the monitor thread (in-process, HashStore)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from trainguard.inprocess import _coord as co
from trainguard.inprocess import _transport
from trainguard.inprocess._monitor_thread import Interrupter, MonitorThread
from trainguard.inprocess.exceptions import RankShouldRestart
from trainguard.inprocess.state import State


def _fire_later(interrupter: Interrupter, delay_s: float) -> threading.Thread:
    t = threading.Timer(delay_s, interrupter.fire, args=("test",))
    t.start()
    return t


def test_signal_interrupts_a_blocking_sleep():
    it = Interrupter()
    it.install()
    try:
        it.arm()
        timer = _fire_later(it, 0.2)
        t0 = time.monotonic()
        with pytest.raises(RankShouldRestart, match="test"):
            time.sleep(30)
        assert time.monotonic() - t0 < 2.0
        timer.join()
        it.fire("again")  # claimed: no second delivery
        time.sleep(0.1)
    finally:
        it.restore()


def test_async_exception_fallback_without_handler():
    it = Interrupter()  # not installed: PyThreadState_SetAsyncExc
    it.arm()
    timer = _fire_later(it, 0.1)
    with pytest.raises(RankShouldRestart):
        end = time.monotonic() + 10
        while time.monotonic() < end:
            time.sleep(0.005)
    it.acknowledge()
    timer.join()


def test_monitor_thread_runs_abort_then_interrupts():
    store = dist.HashStore()
    keys = co.Keys(1)
    it = Interrupter()
    it.install()
    aborted = []
    lock = threading.RLock()
    state = State(rank=0, world_size=1)
    mt = MonitorThread(store, keys, 0, lambda s: aborted.append(s.iteration) or s,
                       state.freeze, it, lock, 0.05, 0.01, 1.0)
    try:
        it.arm()
        mt.start()
        rec = co.Interruption("exception", 1, time.time(), time.time(), "peer failed")
        threading.Timer(0.1, co.record_interruption, args=(store, keys, 0, rec)).start()
        with pytest.raises(RankShouldRestart, match=r"exception on ranks \[1\]"):
            time.sleep(30)
        it.acknowledge()
        assert aborted == [0]
        assert mt.info is not None and mt.info.records[0].initial_rank == 1
    finally:
        mt.close(2.0)
        it.restore()
    assert not mt.is_alive()


def test_stopped_monitor_thread_does_not_fire():
    store = dist.HashStore()
    keys = co.Keys(2)
    it = Interrupter()
    mt = MonitorThread(store, keys, 0, None, State(rank=0, world_size=1).freeze, it,
                       threading.RLock(), 0.05, 0.0, 1.0)
    it.arm()
    mt.start()
    assert mt.stop() is False
    co.record_interruption(store, keys, 0, co.Interruption("exception", 0, 0.0, 0.0))
    mt.close(2.0)
    assert not mt.firing


def test_transport_tracking_ignores_listeners_and_store_port():
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    _transport.clear()
    before = _transport.snapshot()
    cli = socket.create_connection(("127.0.0.1", port))
    peer, _ = srv.accept()
    try:
        _transport.exclude_port(port)
        assert _transport.track_new(before) == []  # both ends use the excluded port
        _transport._excluded_ports.discard(port)
        fds = _transport.track_new(before)
        assert cli.fileno() in fds and srv.fileno() not in fds
        assert _transport.shutdown_tracked() >= 1
        assert cli.recv(1) == b""  # shut down: reads see EOF at once
    finally:
        _transport.clear()
        for s in (cli, peer, srv):
            s.close()


def test_restart_record_ignores_secondary_faults():
    recs = [co.Interruption("exception", 0, 10.0, 10.1, "conn closed", secondary=True),
            co.Interruption("terminated", 2, 10.05, 10.06, "died")]
    rec = co.RestartRecord.from_interruptions(4, recs, 10.2)
    assert rec.cause == "terminated" and rec.fault_ranks == (2,)
    rec.reentry_time = 10.5
    assert rec.detection_s == pytest.approx(0.01) and rec.restart_s == pytest.approx(0.45)


def test_terminated_ranks_mapping():
    assert co.terminated_ranks({0: 0, 2: 1, 3: 2}, {2}, 3) == {1}
    assert co.terminated_ranks({0: 0, 3: 2}, {2}, 3) == {1}  # died before publishing


def test_interrupt_swallowed_in_del_is_delivered_again():
    it = Interrupter()
    it.install()
    it.install_unraisable_hook()

    class Swallower:
        def __del__(self):
            time.sleep(0.3)  # the interrupt lands here and CPython reports it as unraisable

    try:
        it.arm()
        timer = _fire_later(it, 0.1)
        with pytest.raises(RankShouldRestart):
            obj = Swallower()
            del obj
            time.sleep(5)
        timer.join()
    finally:
        it.restore()
