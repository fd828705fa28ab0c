"""Smoke test of ``bench/checkpoint.py``'s training-loop scenario at a tiny size (runs in CI).

It checks that every method runs and that the issue's keys are in the final JSON line with
plausible values, not that they are fast: speed is what the benchmark itself reports.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "checkpoint.py"
KEYS = ["overlap_block_s", "overlap_step_overhead_pct", "dcp_async_step_overhead_pct",
        "block_vs_dcp_async", "bgcopy_step_overhead_pct", "overlap_wait_step_overhead_pct",
        "snapshot_step_overhead_pct", "torch_save_step_overhead_pct", "overlap_fenced_frac"]


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--scenarios", "loop", "--dir", str(tmp_path),
         "--fast-dir", str(tmp_path), *args],
        check=False, capture_output=True, text=True, timeout=240, cwd=REPO)


@pytest.mark.timeout(300)
def test_loop_scenario_reports_every_key(tmp_path: Path):
    proc = _bench(tmp_path, "--size-mb", "32", "--step-ms", "20", "--loop-rounds", "1",
                  "--loop-steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in KEYS:
        assert isinstance(result[key], (int, float)) and math.isfinite(result[key]), key
    assert result["overlap_block_s"] >= 0.0 and 0.0 <= result["overlap_fenced_frac"] <= 1.0
    assert 0 <= result["saves_skipped"] <= result["overlap_saves_requested"]
    assert result["overlap_saves_requested"] > 0
    assert result["loop_state_mb"] == pytest.approx(32.0, abs=0.5)  # one 2048x2048 layer + momentum
    assert "overlap_step_overhead<=5pct" in result["targets_met"]
    assert not list(tmp_path.iterdir())  # every checkpoint it wrote was removed


@pytest.mark.timeout(60)
def test_unknown_loop_method_is_one_clear_error(tmp_path: Path):
    proc = _bench(tmp_path, "--loop-methods", "overlap,teleport")
    assert proc.returncode == 2
    assert "unknown" in proc.stderr and "teleport" in proc.stderr
    assert "Traceback" not in proc.stderr
