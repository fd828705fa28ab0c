"""Callback logic that needs no Trainer: bad arguments, the missing-launcher error, the floor
on calculated timeouts, and the SIGTERM handler that only sets a flag."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import types
from typing import Any

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


def _batches(logic: FaultToleranceLogic, n: int, step_s: float = 0.005) -> None:
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace())
    for batch in range(n):
        logic.on_train_batch_start(trainer, None, None, batch)
        time.sleep(step_s)
        logic.on_train_batch_end(trainer, None, None, None, batch)


def _active_logic(**kwargs: object) -> FaultToleranceLogic:
    logic = FaultToleranceLogic(**kwargs)  # type: ignore[arg-type]
    logic.state_key = "FaultToleranceCallback"  # what Lightning's Callback provides
    logic.active = True  # as after setup under the launcher (no monitor needed here)
    return logic


def test_the_first_checkpoint_carries_calculated_timeouts():
    """A restart right after the run's first save must keep the calculated timeouts: they are
    calculated at the second batch end (every rank reaches it), so the state Lightning collects
    into any later checkpoint already holds them; a save itself calculates nothing."""
    logic = _active_logic(calculate_after_steps=1000, min_timeout=0.5)
    _batches(logic, 1)
    assert logic.calculations == 0 and logic.state_dict() == {"current_timeouts": {}}
    _batches(logic, 1)
    assert logic.calculations == 1
    saved = logic.state_dict()["current_timeouts"]["heartbeat"]  # what a checkpoint gets
    assert saved["were_calculated"] and saved["subsequent"] >= 0.5, saved
    _batches(logic, 3)  # the periodic recalculation is 1000 steps away
    assert logic.calculations == 1
    assert not hasattr(logic, "on_save_checkpoint")  # nothing runs in a save but state_dict


def test_timeouts_are_recalculated_on_a_fixed_step_schedule():
    logic = _active_logic(calculate_after_steps=3, min_timeout=0.5)
    counts = []
    for _ in range(9):
        _batches(logic, 1, 0.0)
        counts.append(logic.calculations)
    # first at step 2, then at every multiple of 3: steps 3, 6, 9
    assert counts == [0, 1, 2, 2, 2, 3, 3, 3, 4], counts
    # a resumed run starts with the restored calculated timeouts: no step-2 sample mixed in
    resumed = _active_logic(calculate_after_steps=3, min_timeout=0.5)
    resumed.load_state_dict(logic.state_dict())
    _batches(resumed, 2, 0.0)
    assert resumed.calculations == 0
    assert resumed.state_dict() == logic.state_dict()
    _batches(resumed, 1, 0.0)
    assert resumed.calculations == 1  # step 3: the periodic schedule


def two_rank_main() -> dict[str, object]:
    """Rank program (``run_ranks``, 2 gloo ranks, 5 s process-group timeout) for two checks that
    need real collectives; one launch for both (each rank imports torch once):

    * ``save``: 8 training steps of :class:`FaultToleranceLogic`; after step 3 rank 0 alone builds
      a checkpoint the way Lightning's ``dump_checkpoint`` does (``state_dict``, then
      ``on_save_checkpoint`` if the callback has one). A collective there would wait for rank 1
      until the process-group timeout;
    * ``hook``: DDP timed by :class:`BackwardWaitTimer`, rank 1 sleeping 0.25 s before each
      step: the exposed all-reduce wait (what the straggler callback counts as collective
      wait), with DDP's own all-reduce and with a user's communication hook.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=5))
    try:
        return {"save": _save_on_rank0_only(rank), "hook": _backward_wait(rank, torch, dist)}
    finally:
        dist.destroy_process_group()


def _save_on_rank0_only(rank: int) -> dict[str, object]:
    out: dict[str, object] = {}
    logic = _active_logic(calculate_after_steps=4, min_timeout=0.5)
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace())
    for step in range(1, 9):
        _batches(logic, 1)
        if step == 3 and rank == 0:
            t0 = time.monotonic()
            ckpt = {"callbacks": {logic.state_key: logic.state_dict()}}
            hook = getattr(logic, "on_save_checkpoint", None)
            if hook is not None:
                hook(trainer, None, ckpt)
            out["save_s"] = time.monotonic() - t0
            out["saved"] = ckpt["callbacks"][logic.state_key]
    out["calculations"] = logic.calculations
    return out


def _backward_wait(rank: int, torch: Any, dist: Any) -> dict[str, object]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.integrations.lightning._ddp_hook import BackwardWaitTimer
    from trainguard.integrations.lightning._straggler import _time_ddp

    def net() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])

    # several buckets, DDP's own C++ all-reduce; the second model carries a user's hook
    plain, user = DDP(net(), bucket_cap_mb=0.02), DDP(net(), bucket_cap_mb=0.02)
    user.register_comm_hook(None, default_hooks.allreduce_hook)
    timers = {"plain": BackwardWaitTimer(), "user": BackwardWaitTimer()}
    assert timers["plain"].attach(plain) and timers["user"].attach(user)
    exposed: dict[str, list[float]] = {"plain": [], "user": []}
    for _ in range(3):
        x = torch.randn(8, 64) * (rank + 1)
        for name, model in (("plain", plain), ("user", user)):
            if rank == 1:
                time.sleep(0.25)
            model(x).pow(2).mean().backward()
            exposed[name].append(timers[name].take_exposed_s())
    for timer in timers.values():
        timer.detach()
    plain(torch.randn(8, 64)).pow(2).mean().backward()  # detached: nothing measured
    unarmed = timers["plain"].take_exposed_s()
    timed, timer = _time_ddp(plain, "auto")  # gloo: the timer, and no hook taken
    plain.register_comm_hook(None, default_hooks.allreduce_hook)  # still free for the user
    if timer is not None:
        timer.detach()
    return {"exposed_s": exposed, "unarmed": unarmed, "passes": timers["plain"].passes,
            "timed": timed and isinstance(timer, BackwardWaitTimer)}


@pytest.fixture(scope="module")
def two_ranks() -> list[Any]:
    from trainguard.testing.faults import run_ranks

    here = os.path.dirname(os.path.abspath(__file__))
    res = run_ranks("test_lightning_units:two_rank_main", 2, timeout_s=60, pythonpath=[here])
    for r in res:
        assert r.returncode == 0, (r.rank, r.stderr[-3000:])
    return [r.result for r in res]


@pytest.mark.timeout(90)
def test_a_save_on_rank0_only_does_not_wait_for_the_other_rank(two_ranks):
    rank0, rank1 = two_ranks[0]["save"], two_ranks[1]["save"]
    print(f"rank-0-only save took {rank0['save_s'] * 1e3:.2f} ms")
    assert rank0["save_s"] < 1.0, rank0
    hb = rank0["saved"]["current_timeouts"]["heartbeat"]
    assert hb["were_calculated"], rank0["saved"]  # calculated at step 2, before the save
    # both ranks calculated at the same steps (2, 4, 8): the schedule ignores the save
    assert rank0["calculations"] == rank1["calculations"] == 3, (rank0, rank1)


@pytest.mark.timeout(90)
def test_backward_wait_timer_counts_the_wait_for_the_slow_rank(two_ranks):
    """Issue 11: DDP's all-reduce timed without a communication hook (and with a user's)."""
    fast, slow = two_ranks[0]["hook"], two_ranks[1]["hook"]
    print(f"exposed all-reduce wait, s: fast rank {fast['exposed_s']}, slow rank "
          f"{slow['exposed_s']}")
    assert fast["timed"] and slow["timed"], fast
    assert fast["unarmed"] == 0.0 and fast["passes"] == 3, fast
    for name in ("plain", "user"):
        # the fast rank waited ~0.25 s per step for the slow one (our final callback ran before
        # DDP's wait for the buckets); the slow one waited for nobody
        fast_s = statistics.median(fast["exposed_s"][name])
        slow_s = statistics.median(slow["exposed_s"][name])
        assert fast_s > 0.1, (name, fast)
        assert slow_s < fast_s / 2, (name, fast, slow)