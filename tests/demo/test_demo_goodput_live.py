"""``trainguard demo --duration``: the fault schedule's rule and the live status line, on
synthetic event files (no processes)."""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from pathlib import Path

import pytest
from rich.console import Console

from trainguard._demo import cli
from trainguard._demo._goodput import GoodputConfig, fault_plan, figures
from trainguard._demo._goodput_progress import GoodputProgress


@pytest.mark.parametrize(("duration", "every", "times"), [
    (30.0, 8.0, [8.0, 16.0, 24.0]),  # floor(30/8) = 3: 6 s are left after 24 s, room enough
    (20.0, 6.0, [6.0, 12.0]),  # floor(20/6) = 3, but 18 s leaves 2 s: under the 5 s room
    (20.0, 5.0, [5.0, 10.0, 15.0]),  # exactly the room after the last one
    (180.0, 30.0, [30.0, 60.0, 90.0, 120.0, 150.0]),  # the benchmark's plan is unchanged
])
def test_faults_come_every_S_seconds_floor_D_over_S_when_the_end_leaves_room(
        duration, every, times):
    cfg = GoodputConfig(duration_s=duration, fault_every_s=every)
    assert cfg.recovery_room_s == 5.0
    assert [f["t"] for f in fault_plan(cfg, disk_ok=True)] == times


def test_the_recovery_room_follows_the_hard_timeout():
    cfg = GoodputConfig(duration_s=30.0, fault_every_s=8.0, hard_timeout_s=10.0)
    assert cfg.recovery_room_s == 12.0
    assert [f["t"] for f in fault_plan(cfg, disk_ok=True)] == [8.0, 16.0]


def test_help_states_the_rule():
    parser = argparse.ArgumentParser(prog="trainguard")
    cli.register(parser.add_subparsers())
    demo = parser._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    text = " ".join(demo.format_help().split())
    assert "floor(D/S) faults" in text and "under 5 s" in text, text
    assert "8, 16, 24 s" in text, text


class _Run:
    """A fake goodput run directory: ``t_train`` and one rank's ``ev_*.jsonl``."""

    def __init__(self, root: Path, t_train: float) -> None:
        self.root = root
        (root / "t_train").write_text(repr(t_train))
        self.t = t_train
        self.path = root / "ev_0_123.jsonl"

    def add(self, ev: str, **fields) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"ev": ev, "t": self.t, "initial_rank": 0, **fields}) + "\n")

    def steps(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            self.t += 0.05
            self.add("step", step=step, t0=self.t - 0.05, world=2)


PLAN = [{"t": 1.0, "kind": "exception", "rank": 0}, {"t": 5.0, "kind": "sigkill", "rank": 1}]


def test_plain_lines_every_interval_and_at_each_fault(tmp_path: Path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    run = _Run(tmp_path, t_train=time.time() - 2.0)
    with GoodputProgress(console, duration_s=30.0, interval_s=3600.0) as progress:
        progress("ours", str(tmp_path), PLAN, [])  # no step yet: only the start line
        run.steps(1, 40)
        run.add("commit", step=20)
        progress("ours", str(tmp_path), PLAN, [])
        run.steps(41, 45)
        progress("ours", str(tmp_path), PLAN, [])  # nothing new to say within the interval
        run.add("fault", i=0, kind="exception", step=46)
        run.t += 1.0
        progress("ours", str(tmp_path), PLAN, [])  # injected, not yet recovered
        run.steps(41, 50)
        progress("ours", str(tmp_path), PLAN, [])  # the job passed step 46 again: recovered
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("starting the rank processes"), lines
    assert lines[1].startswith("[   2/30 s] step 40"), lines  # seconds since training started
    assert len(lines) == 4, lines
    assert "step 40 · faults 0/2 injected, 0 recovered · checkpoint step 20" in lines[1], lines
    assert "faults 1/2 injected, 0 recovered" in lines[2], lines
    assert "step 50 · faults 1/2 injected, 1 recovered" in lines[3], lines
    # goodput so far: 50 kept steps of 50 ms over the window from t_train to the last step
    window = run.t - float((tmp_path / "t_train").read_text())
    assert f"goodput so far {50 * 0.05 / window:.3f}" in lines[3], (lines, window)


def test_a_terminal_gets_one_line_updated_in_place(tmp_path: Path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    run = _Run(tmp_path, t_train=time.time() - 2.0)
    with GoodputProgress(console, duration_s=30.0) as progress:
        assert progress.live is not None
        run.steps(1, 30)
        progress("ours", str(tmp_path), PLAN, [])
        run.steps(31, 60)
        run.add("commit", step=60)
        progress("ours", str(tmp_path), PLAN, [])
    assert progress.live is None
    text = out.getvalue()
    assert "step 60 · faults 0/2 injected, 0 recovered · checkpoint step 60" in text, text
    assert "\x1b[" in text  # cursor control: rewritten in place, not printed line after line


def test_an_unrecovered_fault_fails_the_run_with_the_problem_listed(tmp_path: Path):
    run = _Run(tmp_path, t_train=time.time() - 5.0)
    run.steps(1, 40)
    run.add("fault", i=0, kind="exception", step=41)  # the job never completes step 41 again
    events = [json.loads(line) for line in run.path.read_text().splitlines()]
    fig = figures(events, PLAN, [], float((tmp_path / "t_train").read_text()))
    assert cli.goodput_problems(fig, True, [0, 0]) == [
        "exception at 1 s on rank 0: not recovered",
        "sigkill at 5 s on rank 1: not recovered (it never fired)",
    ]
    assert cli.goodput_problems(fig, False, [1, -9])[-1] == (
        "no rank process finished cleanly, or the run timed out (exit codes [1, -9])")
    run.steps(41, 45)  # back past step 41: recovered
    events = [json.loads(line) for line in run.path.read_text().splitlines()]
    fig = figures(events, PLAN[:1], [], float((tmp_path / "t_train").read_text()))
    assert cli.goodput_problems(fig, True, [0, 0]) == []


def test_a_full_disk_counts_as_injected_while_it_lasts_and_recovered_at_the_next_commit(
        tmp_path: Path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    run = _Run(tmp_path, t_train=time.time() - 2.0)
    plan = [{"t": 1.0, "kind": "disk_full", "rank": 0}]
    with GoodputProgress(console, duration_s=30.0, interval_s=3600.0) as progress:
        run.steps(1, 20)
        start = run.t
        run.steps(21, 30)
        progress("ours", str(tmp_path), plan, [(0, start, math.inf)])  # DiskFaults.so_far()
        run.steps(31, 40)
        run.add("commit", step=40)
        progress("ours", str(tmp_path), plan, [(0, start, start + 0.2)])
    lines = out.getvalue().splitlines()
    assert "faults 1/1 injected, 0 recovered · checkpoint none yet" in lines[1], lines
    assert "faults 1/1 injected, 1 recovered · checkpoint step 40" in lines[2], lines
