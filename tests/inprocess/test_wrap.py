"""Single-process tests of ``Wrapper``/``CallWrapper`` (run in the pytest process, WORLD_SIZE=1).

The wrapper forks its monitor process from here and hosts the default TCPStore there; every
test leaves no child behind (checked by the suite's leak fixture).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.inprocess import (
    BarrierTimeout,
    CallWrapper,
    FrozenState,
    RestartAbort,
    Wrapper,
)
from trainguard.inprocess._inject import bind_call_wrapper, call_wrapper_params
from trainguard.inprocess.initialize import RetryController
from trainguard.testing import free_port

FAST = {
    "soft_timeout": 3.0, "hard_timeout": 6.0, "barrier_timeout": 10.0, "heartbeat_timeout": 5.0,
    "heartbeat_interval": 0.2, "monitor_process_interval": 0.05, "monitor_thread_interval": 0.1,
    "progress_watchdog_interval": 0.05, "termination_grace_time": 0.5,
}


@pytest.fixture(autouse=True)
def _single_rank_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        monkeypatch.delenv(var, raising=False)


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, text", [
    ({"soft_timeout": 5, "hard_timeout": 4}, ConfigError, "soft_timeout < hard_timeout"),
    ({"hard_timeout": 200}, ConfigError, "hard_timeout < barrier_timeout"),
    ({"heartbeat_interval": 40}, ConfigError, "heartbeat_interval < heartbeat_timeout"),
    ({"heartbeat_timeout": 130}, ConfigError, "heartbeat_timeout < barrier_timeout"),
    ({"monitor_process_interval": 31}, ConfigError, "monitor_process_interval < min("),
    ({"monitor_thread_interval": 61}, ConfigError, "monitor_thread_interval < soft_timeout"),
    ({"progress_watchdog_interval": 61}, ConfigError, "progress_watchdog_interval < soft"),
    ({"soft_timeout": -1}, ConfigError, "soft_timeout > 0"),
    ({"completion_timeout": 0}, ConfigError, "completion_timeout > 0"),
    ({"last_call_wait": -0.1}, ConfigError, "last_call_wait >= 0"),
    ({"termination_grace_time": -1}, ConfigError, "termination_grace_time >= 0"),
    ({"barrier_timeout": "10"}, TypeError, "barrier_timeout"),
    ({"soft_timeout": True}, TypeError, "soft_timeout"),
    ({"initialize": 3}, TypeError, "initialize must be callable"),
    ({"abort": "x"}, TypeError, "abort must be callable"),
    ({"finalize": 1}, TypeError, "finalize"),
    ({"health_check": 1}, TypeError, "health_check"),
    ({"completion": 1}, TypeError, "completion"),
    ({"terminate": 1}, TypeError, "terminate"),
    ({"rank_assignment": None}, TypeError, "rank_assignment"),
    ({"store_factory": 5}, TypeError, "store_factory"),
    ({"store_kwargs": [1]}, TypeError, "store_kwargs"),
    ({"monitor_process_logfile": "rel.log"}, ConfigError, "absolute"),
    ({"monitor_process_pidfile": "rel.pid"}, ConfigError, "absolute"),
    ({"monitor_process_logfile": 3}, TypeError, "monitor_process_logfile"),
    ({"enabled": "yes"}, TypeError, "enabled"),
])
def test_validation(kwargs, exc, text):
    with pytest.raises(exc, match=text.replace("(", r"\(")):
        Wrapper(**kwargs)


def test_validation_accepts_timedelta_and_values_in_message():
    Wrapper(soft_timeout=timedelta(seconds=1), hard_timeout=timedelta(seconds=2))
    with pytest.raises(ValueError, match="soft_timeout=5.0 s, hard_timeout=4.0 s"):
        Wrapper(soft_timeout=5, hard_timeout=4)


def test_default_hooks_are_per_wrapper():
    a, b = Wrapper(), Wrapper()
    assert a.config.abort is not b.config.abort
    assert a.config.rank_assignment is not b.config.rank_assignment


def test_disabled_returns_fn_unchanged():
    def fn():
        return 1

    assert Wrapper(enabled=False)(fn) is fn


# -- injection -----------------------------------------------------------------------------------
def _plain(x, cw: CallWrapper, y=2): ...
def _optional(cw: CallWrapper | None = None): ...
def _string(cw: "CallWrapper"): ...  # noqa: UP037
def _union(cw: "CallWrapper | None" = None): ...  # noqa: UP037
def _generic(d: dict[str, int], cw: CallWrapper = None): ...
def _unresolvable(x: "NoSuchType", cw: "CallWrapper" = None): ...  # noqa: F821, UP037
def _adapter(*args, **kwargs: CallWrapper): ...
def _none(a, *args, b: int = 1, **kwargs): ...


@pytest.mark.parametrize("fn, named, var_kw", [
    (_plain, ["cw"], None), (_optional, ["cw"], None), (_string, ["cw"], None),
    (_union, ["cw"], None), (_generic, ["cw"], None), (_unresolvable, ["cw"], None),
    (_adapter, [], "call_wrapper"), (_none, [], None),
])
def test_injection_annotations(fn, named, var_kw):
    assert call_wrapper_params(fn, CallWrapper) == (named, var_kw)


def test_injection_binds_positional_and_adapters():
    marker = object.__new__(CallWrapper)
    args, kwargs = bind_call_wrapper(_plain, CallWrapper, marker, (1, None), {})
    assert args == (1, marker)
    args, kwargs = bind_call_wrapper(_adapter, CallWrapper, marker, (1,), {"z": 3})
    assert args == (1,) and kwargs == {"z": 3, "call_wrapper": marker}


# -- single-rank runs ----------------------------------------------------------------------------
def test_returns_value_and_iteration_resets_per_call():
    seen = []

    @Wrapper(**FAST)
    def fn(x, cw: CallWrapper = None):
        seen.append(cw.iteration)
        if cw.iteration == 0 and x == "fail-once":
            raise RuntimeError("boom")
        return x, cw.state.active_rank, os.environ["RANK"]

    assert fn("ok") == ("ok", 0, "0")
    assert fn("fail-once") == ("fail-once", 0, "0")
    assert seen == [0, 0, 1]
    assert "RANK" not in os.environ  # environment restored after the call


def test_restart_records_and_hooks_see_frozen_state():
    calls: list = []

    def hook(name):
        def run(state: FrozenState) -> FrozenState:
            with pytest.raises(dataclasses.FrozenInstanceError):
                state.iteration = 99  # type: ignore[misc]
            calls.append((name, state.iteration, type(state.fn_exception).__name__))
            return state

        return run

    holder = {}

    @Wrapper(**FAST, initialize=hook("initialize"), finalize=hook("finalize"),
             health_check=hook("health"), completion=hook("completion"))
    def fn(cw: CallWrapper):
        holder["cw"] = cw
        if cw.iteration < 2:
            raise ValueError(f"fault {cw.iteration}")
        return "done"

    t0 = time.time()
    assert fn() == "done"
    recs = holder["cw"].restart_records
    assert [r.iteration for r in recs] == [0, 1] and all(r.cause == "exception" for r in recs)
    for r in recs:
        assert t0 <= r.fault_time <= r.detection_time <= r.interrupt_time <= r.reentry_time
        print(f"single rank restart: detection {r.detection_s:.4f} s, restart {r.restart_s:.3f} s")
        assert r.restart_s < 3.0
    assert holder["cw"].last_restart is recs[-1]
    assert ("finalize", 0, "ValueError") in calls and ("completion", 2, "NoneType") in calls


def test_retry_controller_limit_raises_restart_abort():
    terminated = []

    @Wrapper(**FAST, initialize=RetryController(max_iterations=3),
             terminate=lambda s: terminated.append(s.iteration) or s)
    def fn(cw: CallWrapper):
        raise RuntimeError(f"always fails ({cw.iteration})")

    with pytest.raises(RestartAbort, match="max_iterations=3"):
        fn()
    assert terminated == [3]


def test_restart_abort_names_the_last_fault():
    """A retry limit must not hide why the attempts failed (a new user saw only RestartAbort)."""

    @Wrapper(**FAST, initialize=RetryController(max_iterations=2))
    def fn(cw: CallWrapper):
        return undefined_name  # noqa: F821 - the user's bug

    with pytest.raises(RestartAbort) as info:
        fn()
    text = "".join(traceback.format_exception(info.value))
    print(text)
    assert "NameError" in text and "undefined_name" in text


def test_rank_prefix_does_not_pile_up_across_restarts(capsys):
    """torch wraps sys.excepthook at each init_process_group; restarts must not stack it."""
    original = sys.excepthook

    @Wrapper(**FAST)
    def fn(cw: CallWrapper):
        cw.init_process_group()
        if cw.iteration < 3:
            raise RuntimeError("restart")
        dist.destroy_process_group()

    try:
        fn()
        try:
            raise ValueError("boom")
        except ValueError:
            sys.excepthook(*sys.exc_info())
        err = capsys.readouterr().err
        print(err)
        assert "boom" in err
        assert all(line.count("[rank0]:") <= 1 for line in err.splitlines())
    finally:
        sys.excepthook = original


def test_system_exit_leaves_and_runs_terminate():
    terminated = []

    @Wrapper(**FAST, terminate=lambda s: terminated.append(s.iteration) or s)
    def fn():
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        fn()
    assert terminated == [0]


def test_process_group_already_initialized_is_an_error(tmp_path):
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="inside the wrapped function"):
            Wrapper(**FAST)(lambda: None)()
    finally:
        dist.destroy_process_group()


def test_init_process_group_per_iteration():
    @Wrapper(**FAST)
    def fn(cw: CallWrapper):
        cw.init_process_group()
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        if cw.iteration == 0:
            raise RuntimeError("restart with a fresh group")
        dist.destroy_process_group()
        return cw.iteration

    assert fn() == 1
    assert not dist.is_initialized()


def test_initial_barrier_timeout_names_missing_ranks_and_runs_terminate(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TRAINGUARD_STORE_PORT", str(free_port()))
    terminated = []
    fast = {**FAST, "barrier_timeout": 1.5, "hard_timeout": 1.2, "soft_timeout": 1.0,
            "heartbeat_timeout": 1.0, "heartbeat_interval": 0.1}

    @Wrapper(**fast, terminate=lambda s: terminated.append(s) or s)
    def fn():
        return 1

    with pytest.raises(BarrierTimeout, match=r"ranks \[1\] of WORLD_SIZE=2"):
        fn()
    assert len(terminated) == 1


def test_second_call_on_the_same_persistent_store():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)

    @Wrapper(**FAST, store_factory=lambda: store)
    def fn(cw: CallWrapper):
        if cw.iteration == 0:
            raise RuntimeError("restart")
        return cw.iteration

    assert fn() == 1
    assert fn() == 1
    assert int(store.add("tg/calls/0", 0)) == 2


# -- hang protection -----------------------------------------------------------------------------
HANG = {**FAST, "soft_timeout": 0.5, "hard_timeout": 8.0}


def test_soft_timeout_interrupts_a_sleep_in_c():
    holder = {}

    @Wrapper(**HANG)
    def fn(cw: CallWrapper):
        holder["cw"] = cw
        if cw.iteration == 0:
            time.sleep(60)  # stuck in a C call with the GIL released
        return cw.iteration

    t0 = time.monotonic()
    assert fn() == 1
    rec = holder["cw"].last_restart
    print(f"sleep hang: interrupted after {rec.restart_s:.3f} s (soft 0.5 s)")
    assert rec.cause == "soft_timeout" and time.monotonic() - t0 < 5.0


def test_manual_ping_catches_python_livelock():
    @Wrapper(**HANG)
    def fn(cw: CallWrapper):
        if cw.iteration == 0:
            cw.ping()
            end = time.monotonic() + 30
            while time.monotonic() < end:  # pure Python: automatic stamps keep coming
                pass
        return cw.iteration

    t0 = time.monotonic()
    assert fn() == 1
    assert time.monotonic() - t0 < 5.0


def test_disable_hang_protection():
    @Wrapper(**HANG)
    def fn(cw: CallWrapper):
        with cw.disable_hang_protection():
            time.sleep(1.2)  # longer than soft_timeout: tolerated
        if cw.iteration == 0:
            with cw.disable_hang_protection():
                raise RuntimeError("exceptions still restart")
        return cw.iteration

    assert fn() == 1


def test_atomic_defers_the_interrupt():
    events = []

    @Wrapper(**HANG)
    def fn(cw: CallWrapper):
        if cw.iteration == 0:
            with cw.atomic():
                with cw.atomic():  # re-entrant
                    time.sleep(1.2)  # soft timeout fires meanwhile
                events.append("atomic block finished")
            time.sleep(30)
        return cw.iteration

    assert fn() == 1
    assert events == ["atomic block finished"]


def test_wrapper_in_a_non_main_thread_uses_async_exception():
    out = {}

    @Wrapper(**HANG)
    def fn(cw: CallWrapper):
        if cw.iteration == 0:
            end = time.monotonic() + 30
            cw.ping()
            while time.monotonic() < end:
                time.sleep(0.01)
        return cw.iteration

    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join(20)
    assert out.get("r") == 1


def test_previous_iteration_objects_are_collected():
    import weakref

    class Model:
        pass

    refs = []

    @Wrapper(**FAST)
    def fn(cw: CallWrapper):
        model = Model()
        model.self_ref = model  # a cycle: only the cycle collector frees it
        refs.append(weakref.ref(model))
        if cw.iteration < 2:
            raise RuntimeError("fault while the model is alive")
        return [r() is None for r in refs]

    assert fn() == [True, True, False]
