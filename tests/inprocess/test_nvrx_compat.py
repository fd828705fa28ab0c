"""An NVRx user's imports and the behaviours they rely on: module paths, aliases, defaults,
``State(rank, world_size)``, the monitor-thread tools, the stand-alone progress watchdog, the
nested-restarter lines, chained restart health checks, Tree layout errors, mutable layers."""

from __future__ import annotations

import copy
import gc
import io
import logging
import os
import sys
import threading
import time
from datetime import timedelta

import pytest

from trainguard import inprocess
from trainguard.inprocess import rank_assignment as ra
from trainguard.inprocess.state import Mode, State


def test_module_paths_and_aliases():
    assert inprocess.exception.TimeoutError is inprocess.RestartTimeout
    assert issubclass(inprocess.exception.TimeoutError, TimeoutError)
    assert inprocess.rank_assignment.RankDiscarded is inprocess.RankDiscarded
    assert inprocess.monitor_thread.RankShouldRestart is inprocess.RankShouldRestart
    assert inprocess.store.BarrierTimeout is inprocess.BarrierTimeout
    assert issubclass(inprocess.store.TCPStore, inprocess.store.StoreMixin)
    assert issubclass(inprocess.health_check.ChainedNicHealthCheck, inprocess.HealthCheck)
    assert issubclass(inprocess.finalize.ThreadedFinalize, inprocess.Finalize)
    assert issubclass(inprocess.abort.AbortTransformerEngine, inprocess.Abort)


def test_state_sets_initial_values_and_filters_have_defaults():
    st = State(3, 8)
    assert (st.initial_rank, st.initial_world_size) == (3, 8)
    ctx = ra.RankAssignmentCtx(State(5, 8), None, set())
    assert ra.MaxActiveWorldSize()(ctx).state.active_world_size == 8
    assert ra.ActiveWorldSizeDivisibleBy()(ctx).state.active_world_size == 8
    with pytest.raises(ValueError):
        ra.MaxActiveWorldSize(0)


def test_async_raise_reaches_the_main_thread():
    class Boom(Exception):
        pass

    t = threading.Thread(target=inprocess.monitor_thread.async_raise,
                         args=(threading.main_thread().ident, Boom))
    with pytest.raises(Boom):
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(1e-3)
    t.join(5)
    with pytest.raises(ValueError):
        inprocess.monitor_thread.async_raise(-12345, Boom)


def test_reraise_if_unraisable_restores_the_hook(monkeypatch):
    class Boom(Exception):
        pass

    class Dropper:
        def __del__(self):
            raise Boom

    monkeypatch.setattr(sys, "unraisablehook", lambda *a: None)
    before = sys.unraisablehook
    with pytest.raises(Boom), inprocess.monitor_thread.reraise_if_unraisable(Boom):
        obj = Dropper()
        del obj
        gc.collect()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(1e-3)
    assert sys.unraisablehook is before


class _Collect:
    def __init__(self):
        self.stamps = []

    def send_timestamp(self, ts):
        self.stamps.append(copy.copy(ts))


def test_progress_watchdog_lifecycle():
    sink = _Collect()
    dog = inprocess.progress_watchdog.ProgressWatchdog(0, sink, timedelta(milliseconds=2))
    dog.start()
    for _ in range(50):
        time.sleep(0.002)
    dog.pause_and_synchronize()
    paused = len(sink.stamps)
    time.sleep(0.05)
    assert len(sink.stamps) == paused, "reports continued while paused"
    dog.resume()
    for _ in range(50):
        time.sleep(0.002)
    assert len(sink.stamps) > paused
    assert all(isinstance(s.auto, float) and s.manual is None for s in sink.stamps)
    dog.shutdown()
    done = len(sink.stamps)
    dog.shutdown()
    assert len(sink.stamps) == done
    with pytest.raises(RuntimeError):
        dog.resume()


def test_nested_restarter_lines():
    from trainguard.inprocess import nested_restarter as nr

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = nr.NestedRestarterLogger()
    logger.restarter_logger.addHandler(handler)
    logger.restarter_logger.setLevel(logging.INFO)
    try:
        hook = nr.NestedRestarterHandlingCompleted()
        hook.logger = logger
        st0, st1 = State(0, 2).freeze(), State(1, 2).freeze()
        hook(st0)
        hook(st1)  # not the special rank: silent
        hook(st0)
        starting = nr.NestedRestarterHandlingStarting()
        starting.logger = logger
        starting(st0)
    finally:
        logger.restarter_logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines == [
        "[NestedRestarter] name=[InProcess] state=initialize",
        "[NestedRestarter] name=[InProcess] state=handling stage=completed",
        "[NestedRestarter] name=[InProcess] state=handling stage=starting",
    ]
    assert isinstance(hook, inprocess.Initialize) and isinstance(starting, inprocess.Abort)


def test_restart_health_check_chain(monkeypatch):
    order = []

    class User(inprocess.HealthCheck):
        def __call__(self, state):
            order.append("user")
            return state

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert inprocess.Wrapper(health_check=User()).restart_health_check is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    chain = inprocess.Wrapper(health_check=User()).restart_health_check
    kinds = [type(c) for c in chain.instances]
    assert kinds == [User, inprocess.health_check.ChainedGPUHealthCheck,
                     inprocess.health_check.ChainedNVLHealthCheck]
    assert all(c.device_index == 0 for c in chain.instances[1:])
    state = State(0, 1).freeze()
    assert chain(state) is state  # no CUDA here: the device checks pass
    assert order == ["user"]


def test_threaded_finalize_times_out_and_propagates():
    fin = inprocess.finalize.ThreadedFinalize(timedelta(seconds=0.05), time.sleep, args=(1,))
    with pytest.raises(TimeoutError):
        fin(State(0, 1).freeze())

    def fail():
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        inprocess.finalize.ThreadedFinalize(1.0, fail)(State(0, 1).freeze())


def test_abort_transformer_engine_without_te_is_a_noop(caplog):
    with caplog.at_level(logging.WARNING, logger="trainguard.inprocess"):
        hook = inprocess.abort.AbortTransformerEngine()
    state = State(0, 1).freeze()
    assert hook(state) is state
    if not hook.available:
        assert "transformer_engine is not installed" in caplog.text


FAST = {
    "soft_timeout": 3.0, "hard_timeout": 6.0, "barrier_timeout": 10.0, "heartbeat_timeout": 5.0,
    "heartbeat_interval": 0.2, "monitor_process_interval": 0.05, "monitor_thread_interval": 0.1,
    "progress_watchdog_interval": 0.05, "termination_grace_time": 0.5,
}


class _KeyStore:
    """Every rank's key path at once, so one process can build the whole tree."""

    def __init__(self, world, layers):
        self.paths = [[x.key_or_fn(State(r, world).freeze()) if callable(x.key_or_fn)
                       else x.key_or_fn for x in layers] for r in range(world)]


def _tree_table(layers, world, dead=()):
    from trainguard.inprocess.rank_assignment._tree_model import TreeModel

    model = TreeModel(layers, [(r, tuple(p)) for r, p in
                               enumerate(_KeyStore(world, layers).paths)])
    model.activate_initial(None)
    if dead:
        model.reassign(set(dead), None)
    return model


def test_tree_layout_errors_and_mutable_layers():
    with pytest.raises(RuntimeError):
        _tree_table([ra.Layer(key_or_fn=lambda s: s.rank % 2)], 8)
    with pytest.warns(UserWarning, match="depth-first"):
        _tree_table([ra.Layer(), ra.Layer(key_or_fn=lambda s: s.rank % 2)], 8)
    layer = ra.Layer(key_or_fn=lambda s: s.rank // 4)
    layer.flag = ra.LayerFlag.RESERVE
    layer.max_ranks = 3
    model = _tree_table([ra.Layer(flag=ra.LayerFlag.RESERVE), layer], 8, dead=[1])
    assert [e.active_rank for e in model.table()] == [0, None, 2, 1, 3, 4, 5, None]
    layer.max_ranks = 0
    with pytest.raises(ValueError):
        _tree_table([ra.Layer(), layer], 8)


def test_assignment_without_mode_restarts_instead_of_returning_none(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        monkeypatch.delenv(var, raising=False)
    calls = []

    class Passthrough(ra.RankAssignment):
        def __call__(self, ctx):
            return ctx  # leaves the first assignment in Mode.INITIALIZED

    @inprocess.Wrapper(rank_assignment=Passthrough(),
                       initialize=inprocess.RetryController(max_iterations=2), **FAST)
    def fn():
        calls.append(1)
        return 7

    with pytest.raises(inprocess.RestartAbort) as err:
        fn()
    assert calls == []
    assert Mode.INITIALIZED.name in str(err.value) or "INITIALIZED" in "".join(
        getattr(err.value, "__notes__", []))


_SLEEPER = """
import sys, time
import trainguard.inprocess as inprocess
mode, port = sys.argv[1], int(sys.argv[2])
@inprocess.Wrapper(soft_timeout=0.5, hard_timeout=1.5, barrier_timeout=10, heartbeat_timeout=5,
                   heartbeat_interval=0.2, monitor_process_interval=0.02,
                   monitor_thread_interval=0.05, progress_watchdog_interval=0.02,
                   termination_grace_time=0.2, store_kwargs={"port": port},
                   interrupt_blocking_calls=(mode == "signal"))
def fn(cw: inprocess.CallWrapper = None):
    if cw.iteration == 0:
        time.sleep(30)
    return cw.iteration
print("returned", fn())
"""


@pytest.mark.parametrize("mode", ["signal", "bytecode"])
def test_blocking_sleep_soft_interrupt_or_hard_kill(mode, tmp_path):
    import subprocess

    from trainguard.testing import free_port

    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "MASTER_PORT", "TRAINGUARD_STORE_PORT")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _SLEEPER, mode, str(free_port())], env=env,
                         capture_output=True, text=True, timeout=90, check=False)
    elapsed = time.monotonic() - start
    if mode == "signal":  # the soft timeout ends the sleep; the restart completes
        assert out.returncode == 0 and "returned 1" in out.stdout, out.stderr[-2000:]
    else:  # NVRx-style delivery cannot end time.sleep: the hard timeout kills the rank
        assert out.returncode == -15, (out.returncode, out.stderr[-2000:])
    assert elapsed < 45, f"took {elapsed:.1f} s"
