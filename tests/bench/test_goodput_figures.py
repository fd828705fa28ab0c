"""The goodput run's plan and figures (``trainguard._demo._goodput``) on synthetic event logs."""

from __future__ import annotations

import pytest

from trainguard._demo._goodput import KINDS, GoodputConfig, fault_plan, figures, median_lost

STEP = 0.05


def _steps(first: int, last: int, t: float) -> tuple[list[dict], float]:
    out = []
    for step in range(first, last + 1):
        out.append({"ev": "step", "step": step, "t0": t, "t": t + STEP, "world": 4})
        t += STEP
    return out, t


def test_plan_is_seeded_cycles_every_kind_and_leaves_time_to_recover():
    cfg = GoodputConfig(duration_s=180.0, fault_every_s=30.0, seed=3)
    plan = fault_plan(cfg, disk_ok=True)
    assert [f["t"] for f in plan] == [30.0, 60.0, 90.0, 120.0, 150.0]
    assert sorted(f["kind"] for f in plan) == sorted(KINDS)  # five faults: each kind once
    assert all(0 <= f["rank"] < cfg.ranks for f in plan)
    assert fault_plan(cfg, disk_ok=True) == plan  # same seed, same plan
    assert fault_plan(GoodputConfig(seed=4), disk_ok=True) != plan
    assert all(f["kind"] != "disk_full" for f in fault_plan(cfg, disk_ok=False))


def test_goodput_counts_kept_steps_once_and_lost_time_per_fault():
    # 100 steps, an exception at step 101 rolls back to the step-80 checkpoint 1 s later,
    # then 120 more steps to the end: kept = 200 steps of 50 ms.
    events, t = _steps(1, 100, 1000.0)
    events.append({"ev": "fault", "i": 0, "kind": "exception", "step": 101, "t": t})
    events.append({"ev": "commit", "step": 80, "t": t - 1.0})
    more, end = _steps(81, 200, t + 1.0)
    events += more
    plan = [{"t": 5.0, "kind": "exception", "rank": 1}]
    fig = figures(events, plan, [], t_train=1000.0)
    assert fig["kept_steps"] == 200 and fig["median_step_ms"] == pytest.approx(50.0)
    assert fig["window_s"] == pytest.approx(end - 1000.0)
    assert fig["goodput"] == pytest.approx(200 * STEP / (end - 1000.0))
    row = fig["faults"][0]
    # back at step 101 after: 1 s restart + 21 redone steps (81..101), minus one step
    assert row["recovered"] and row["lost_s"] == pytest.approx(1.0 + 21 * STEP - STEP)
    assert median_lost(fig) == pytest.approx(1.0 + 20 * STEP, abs=1e-3)


def test_full_disk_recovers_only_when_a_checkpoint_commits_after_it():
    events, _ = _steps(1, 100, 0.0)
    plan = [{"t": 2.0, "kind": "disk_full", "rank": 0}]
    disk = [(0, 2.0, 5.0)]  # full from 2 s to 5 s
    no_commit = figures(events, plan, disk, t_train=0.0)
    assert no_commit["faults"][0]["fired"] and not no_commit["faults"][0]["recovered"]
    events.append({"ev": "commit", "step": 100, "t": 5.0 + 0.1})
    row = figures(events, plan, disk, t_train=0.0)["faults"][0]
    assert row["recovered"] and row["lost_s"] == pytest.approx(0.0, abs=1e-6)


def test_a_fault_that_never_fired_or_never_recovered_is_reported():
    events, t = _steps(1, 10, 0.0)
    events.append({"ev": "fault", "i": 1, "kind": "hang_gil", "step": 11, "t": t})
    plan = [{"t": 1.0, "kind": "exception", "rank": 0}, {"t": 2.0, "kind": "hang_gil", "rank": 1}]
    rows = figures(events, plan, [], t_train=0.0)["faults"]
    assert rows[0]["fired"] is False and rows[0]["recovered"] is False
    assert rows[1]["fired"] is True and rows[1]["recovered"] is False and rows[1]["lost_s"] is None
