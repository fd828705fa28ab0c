"""Callback logic that needs no Trainer: bad arguments, the missing-launcher error, the floor
on calculated timeouts, and the SIGTERM handler that only sets a flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from trainguard.errors import ConfigError
from trainguard.integrations.lightning._ft import FaultToleranceLogic, _floor
from trainguard.integrations.lightning._preempt import PreemptionLogic
from trainguard.integrations.lightning._straggler import StragglerLogic


def test_fault_tolerance_without_the_launcher_is_a_loud_error(monkeypatch):
    for name in ("TRAINGUARD_FT_SLOT", "TRAINGUARD_FT_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace())
    with pytest.raises(ConfigError, match="trainguard launch"):
        FaultToleranceLogic().setup(trainer, None, "fit")
    quiet = FaultToleranceLogic(required=False)
    quiet.setup(trainer, None, "fit")  # warns, stays inactive; hooks are no-ops
    assert not quiet.active
    quiet.on_train_batch_start(trainer, None, None, 0)
    quiet.teardown(trainer, None, "fit")


@pytest.mark.parametrize("make", [
    lambda: FaultToleranceLogic(calculate_after_steps=0),
    lambda: FaultToleranceLogic(min_timeout=0),
    lambda: StragglerLogic(window_steps=0),
    lambda: StragglerLogic(time_ddp_allreduce="sometimes"),
    lambda: PreemptionLogic(check_every_n_steps=0),
    lambda: PreemptionLogic(signals=()),
])
def test_bad_arguments_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()


def test_calculated_timeouts_are_floored():
    state = {"current_timeouts": {
        "heartbeat": {"initial": 0.5, "subsequent": 0.05, "were_calculated": True},
        "section": {"section": {"step": 0.1, "setup": 100.0}, "out_of_section": 0.2,
                    "calculated_sections": ["setup", "step"],
                    "is_out_of_section_calculated": True}}}
    out = _floor(state, 30.0)["current_timeouts"]
    assert out["heartbeat"] == {"initial": 30.0, "subsequent": 30.0, "were_calculated": True}
    assert out["section"]["section"] == {"step": 30.0, "setup": 100.0}
    assert out["section"]["out_of_section"] == 30.0
    assert state["current_timeouts"]["heartbeat"]["subsequent"] == 0.05  # input untouched


def test_preemption_handler_only_sets_a_flag_and_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    logic = PreemptionLogic()
    logic.on_train_start(None, None)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: no exit, no collective
        assert logic.requested
    finally:
        logic.teardown(None, None, "fit")
    assert signal.getsignal(signal.SIGTERM) == before


def test_importing_the_integration_imports_no_framework():
    code = ("import sys, trainguard.integrations.lightning as m; "
            "assert m.__all__ == sorted(m.__all__); "
            "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'eager import'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_first_checkpoint_carries_calculated_timeouts():
    """A restart right after the run's first save must keep the calculated timeouts: they are
    calculated while that checkpoint is built and replace the entry Lightning collected."""
    logic = FaultToleranceLogic(calculate_after_steps=1000, min_timeout=0.5)
    logic.state_key = "FaultToleranceCallback"  # what Lightning's Callback provides
    logic.active = True  # as after setup under the launcher (no monitor needed here)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace())
    for batch in range(3):
        logic.on_train_batch_start(trainer, None, None, batch)
        time.sleep(0.01)
        logic.on_train_batch_end(trainer, None, None, None, batch)
    assert logic.calculations == 0  # the periodic calculation is 1000 steps away
    checkpoint = {"callbacks": {"FaultToleranceCallback": logic.state_dict()}}
    assert checkpoint["callbacks"]["FaultToleranceCallback"] == {"current_timeouts": {}}
    logic.on_save_checkpoint(trainer, None, checkpoint)
    saved = checkpoint["callbacks"]["FaultToleranceCallback"]["current_timeouts"]["heartbeat"]
    assert saved["were_calculated"] and saved["subsequent"] >= 0.5, saved
    assert logic.calculations == 1
    logic.on_save_checkpoint(trainer, None, checkpoint)  # calculated already: no new collective
    assert logic.calculations == 1
