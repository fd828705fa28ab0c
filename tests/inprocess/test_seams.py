"""Single-process seams of in-process restart found by trying it as a new user (issue 13.6, 13.8,
13.9): a busy store port, a bare ``@Wrapper``, a job without ``RANK``/``WORLD_SIZE``, one latency
definition for the log and ``restart_records``, and ``RestartTimeout``."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest

from trainguard.errors import ConfigError
from trainguard.inprocess import CallWrapper, RestartTimeout, Wrapper

FAST = {
    "soft_timeout": 3.0, "hard_timeout": 6.0, "barrier_timeout": 10.0, "heartbeat_timeout": 5.0,
    "heartbeat_interval": 0.2, "monitor_process_interval": 0.05, "monitor_thread_interval": 0.1,
    "progress_watchdog_interval": 0.05, "termination_grace_time": 0.5,
}


@pytest.fixture(autouse=True)
def _single_rank_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINGUARD_STORE_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


def test_busy_store_port_is_reported_at_once_with_the_fix(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        monkeypatch.setenv("TRAINGUARD_STORE_PORT", str(port))

        @Wrapper(**FAST)
        def train():
            return 1

        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            train()
        elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert f"port {port}" in msg and "TRAINGUARD_STORE_PORT" in msg and "in use" in msg, msg
    assert "\n" not in msg
    assert elapsed < 8.0  # not the barrier timeout (10 s here, 120 s by default)


def test_bare_wrapper_decorator_works():
    @Wrapper
    def train(x, cw: CallWrapper | None = None):
        return (cw.iteration, x)

    assert train(5) == (0, 5)


def test_wrapper_rejects_a_positional_non_callable():
    with pytest.raises(TypeError, match="keyword arguments only"):
        Wrapper(3.0)


def test_missing_world_size_warns_that_one_rank_runs(monkeypatch):
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")

    @Wrapper(**FAST)
    def train():
        return "ok"

    with pytest.warns(RuntimeWarning, match="1-rank job"):
        assert train() == "ok"


def test_no_warning_when_world_size_is_set(recwarn):
    @Wrapper(**FAST)
    def train():
        return "ok"

    assert train() == "ok"
    assert not [w for w in recwarn if "1-rank job" in str(w.message)]


def test_logged_restart_latency_is_the_recorded_one(caplog):
    holder = {}

    @Wrapper(**FAST)
    def train(cw: CallWrapper):
        holder["cw"] = cw
        if cw.iteration < 2:
            time.sleep(0.05)
            raise RuntimeError(f"fault {cw.iteration}")
        return cw.iteration

    with caplog.at_level(logging.INFO, logger="trainguard.inprocess"):
        assert train() == 2
    logged = [float(m.group(1)) for m in
              (re.search(r"restart \d+ -> \d+: .* restart=([0-9.]+) s", r.getMessage())
               for r in caplog.records) if m]
    recorded = [round(r.restart_s, 3) for r in holder["cw"].restart_records]
    assert len(recorded) == 2
    assert logged == recorded


def test_restart_timeout_when_the_interrupt_never_arrives():
    release = threading.Event()

    def blocking_abort(state):
        release.wait(30)  # a custom abort that blocks the monitor thread
        return state

    cfg = dict(FAST, soft_timeout=1.0, hard_timeout=6.0)

    @Wrapper(abort=blocking_abort, **cfg)
    def train():
        raise RuntimeError("fault whose restart never comes")

    t0 = time.monotonic()
    try:
        with pytest.raises(RestartTimeout, match="did not arrive"):
            train()
    finally:
        release.set()
    assert time.monotonic() - t0 < 5.0
