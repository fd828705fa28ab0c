"""Smoke test of ``bench/inprocess_restart.py`` in its cheapest mode (runs in CI).

Two ranks, one fault of each kind (exception, hang in ``time.sleep``, SIGKILL) under trainguard's
Wrapper; the baselines (torchrun, NVRx) are skipped to stay well under a minute. It checks the figures are there and plausible, not fast:
speed is what the benchmark itself reports.
"""

from __future__ import annotations

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
    print(res.stdout[-4000:], res.stderr[-2000:], sep="\n")
    assert res.returncode == 0, f"benchmark exited {res.returncode}"
    last = res.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["ranks"] == 2 and result["faults"] == 1
    assert result["faults_unrecovered"] == 0
    assert result["faults_injected"] == {"exc": 1, "hang": 1, "kill": 1}
    for key in MEASURED:
        value = result[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert result["first_step_s_median"] >= result["restart_s_median"]
    for key in NOT_RUN:
        assert result[key] is None, (key, result[key])
    # Every process the benchmark started, including detached daemons, is gone.
    assert _tagged_processes(tag) == []
