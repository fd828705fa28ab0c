"""Smoke test of ``bench/inprocess_restart.py`` in its cheapest mode (runs in CI).

Two ranks, one fault of each kind (exception, hang in ``time.sleep``, SIGKILL) under trainguard's
Wrapper; the baselines (torchrun, NVRx) are skipped to stay well under a minute. It checks the
figures are there and plausible, not fast:
speed is what the benchmark itself reports.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "inprocess_restart.py"
MEASURED = [
    "restart_s_median",
    "first_step_s_median",
    "hang_detect_over_soft_s_median",
    "hang_all_back_over_soft_s_median",
    "kill_reenter_s_median",
]
NOT_RUN = [
    "torchrun_restart_s_median",
    "ratio_vs_torchrun",
    "nvrx_restart_s_median",
    "ratio_vs_nvrx",
]


def _tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries ``TG_BENCH_TAG=tag`` (ranks, their daemons)."""
    pids = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TG_BENCH_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def _kill_tagged(tag: str) -> None:
    procs = []
    for pid in _tagged_processes(tag):
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.Error:
            continue
    psutil.wait_procs(procs, timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inprocess_restart_bench_cheapest_mode() -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, "TG_BENCH_TAG": tag}
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--ranks",
        "2",
        "--faults",
        "1",
        "--hang-faults",
        "1",
        "--kill-faults",
        "1",
        "--soft-timeout",
        "1.0",
        "--skip-torchrun",  # ~10-25 s on 2 cores; the full benchmark runs it
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=200, check=False, env=env, cwd=REPO
    )
    print(res.stdout[-6000:], res.stderr[-2000:], sep="\n")
    try:
        # Every process the benchmark started, including detached daemons, is gone.
        assert _tagged_processes(tag) == [], "benchmark left processes behind"
        lines = res.stdout.strip().splitlines()
        assert lines, f"no output; exit code {res.returncode}"
        result = json.loads(lines[-1])
    finally:
        _kill_tagged(tag)  # a failed run must not leak into the next test
    # Rank failures (exit codes, log tails) are printed above the JSON line.
    assert result["failed_runs"] == [], f"rank processes failed: {result['failed_runs']}"
    assert result["faults_unrecovered"] == 0
    assert res.returncode == 0, f"benchmark exited {res.returncode}"
    assert result["ranks"] == 2 and result["faults"] == 1
    assert result["faults_injected"] == {"exc": 1, "hang": 1, "kill": 1}
    for key in MEASURED:
        value = result[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert result["first_step_s_median"] >= result["restart_s_median"]
    for key in NOT_RUN:
        assert result[key] is None, (key, result[key])


def _metrics_module():
    spec = importlib.util.spec_from_file_location(
        "_inprocess_metrics", REPO / "bench" / "_inprocess_metrics.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_inprocess_metrics", module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def _ev(e: str, rank: int, it: int, t: float, **extra) -> dict:
    return {"e": e, "rank": rank, "it": it, "t": t, **extra}


def test_fault_figures_from_events() -> None:
    """Figures come from the slowest rank; a missing survivor means "not recovered"."""
    m = _metrics_module()
    events = [
        _ev("enter", 0, 0, 0.0),
        _ev("enter", 1, 0, 0.0),
        _ev("enter", 2, 0, 0.0),
        _ev("fault", 1, 0, 10.0, kind="exc"),
        _ev("enter", 0, 1, 10.2),
        _ev("enter", 1, 1, 10.3),
        _ev("enter", 2, 1, 10.25),
        _ev("step", 0, 1, 10.5),
        _ev("step", 1, 1, 10.5),
        _ev("step", 2, 1, 10.6),
        _ev("fault", 2, 1, 20.0, kind="kill"),  # rank 2 dies; 0 and 1 must come back
        _ev("enter", 0, 2, 20.4),
        _ev("enter", 1, 2, 20.1),
        _ev("enter", 3, 2, 20.7),
        _ev("step", 0, 2, 21.0),
        _ev("step", 1, 2, 21.0),
        _ev("step", 3, 2, 21.0),
        _ev("fault", 1, 2, 30.0, kind="hang"),
        _ev("hang_end", 1, 2, 32.1),
        _ev("enter", 1, 3, 32.5),  # rank 0 never re-entered iteration 3
    ]
    exc, kill, hang = m.fault_figures(sorted(events, key=lambda e: e["t"]))
    assert (exc.kind, exc.world) == ("exc", 3)
    assert exc.reentered_s == pytest.approx(0.3) and exc.first_step_s == pytest.approx(0.6)
    assert kill.reentered_s == pytest.approx(0.7)  # the reserve rank 3 that took over counts
    assert hang.detect_s == pytest.approx(2.1)
    assert hang.reentered_s is None and not hang.recovered
    assert m.median([1.0, 3.0, 2.0], minus=0.5) == 1.5
    assert m.median([1.0, None]) is None
