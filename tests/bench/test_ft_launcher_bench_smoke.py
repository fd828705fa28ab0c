"""Smoke test of ``bench/ft_launcher.py`` in its cheapest mode: 2 ranks, one crash, no baselines,
no hang run. Checks the figures are present and plausible, not fast (the benchmark reports
speed)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ft_launcher_bench_reports_its_keys():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "ft_launcher.py"), "--ranks", "2",
                        "--faults", "1", "--skip-torchrun", "--skip-hang", "--timeout", "150"],
                       capture_output=True, text=True, timeout=170, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("hang_detect_overhead_s", "crash_to_spawn_s", "crash_to_first_step_s",
                "torchrun_crash_to_first_step_s", "nvrx_crash_to_first_step_s",
                "ratio_vs_torchrun", "heartbeat_us_median", "section_us_median"):
        assert key in result, key
    assert 0 < result["crash_to_spawn_s"] <= result["crash_to_first_step_s"] < 120
    assert 0 < result["heartbeat_us_median"] < 100 and 0 < result["section_us_median"] < 100
    assert result["torchrun_crash_to_first_step_s"] is None  # skipped, not invented


def test_ft_launcher_bench_refuses_too_few_nodes():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "ft_launcher.py"), "--nodes", "2",
                        "--nodes-only"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--nodes must be >= 3" in r.stderr and "Traceback" not in r.stderr
