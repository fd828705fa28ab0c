"""``trainguard demo`` end to end: real rank processes, real faults, the summary it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160"}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "demo", *args],
        check=False, capture_output=True, text=True, timeout=timeout, env=env,
    )


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.timeout(150)
def test_demo_recovers_from_an_exception_and_a_sigkill(tmp_path: Path):
    out = tmp_path / "demo"
    started = time.monotonic()
    proc = _demo(
        "--ranks", "2", "--reserve-ranks", "1",
        "--faults", "exception@rank1:step20,sigkill@rank1:step50",
        "--steps", "80", "--checkpoint-every", "10", "--batch-size", "64",
        "--output-dir", str(out), "--timeout", "110", timeout=140,
    )
    elapsed = time.monotonic() - started
    print(proc.stdout[-6000:], proc.stderr[-3000:], f"demo took {elapsed:.1f} s", sep="\n")
    assert proc.returncode == 0, "demo failed; rank logs in " + str(out / "logs")

    summary = json.loads((out / "summary.json").read_text())
    exc, kill = summary["faults"]
    assert (exc["kind"], exc["rank"], kill["kind"], kill["rank"]) == ("exception", 1, "sigkill", 1)
    for row in (exc, kill):
        assert row["recovered"] is True and row["fired"] is True
        assert row["detection_s"] is not None and 0 <= row["detection_s"] < 30
        assert row["restart_s"] is not None and 0 <= row["restart_s"] < 30
        assert row["world_size_after"] == 2  # the reserve rank replaced the killed one
        assert 0 <= row["steps_lost"] < 10  # at most the steps since the last checkpoint
    assert exc["steps_lost"] == 9  # steps 11..19 after the step-10 checkpoint
    assert summary["accuracy"] >= 0.95
    assert 0 < summary["goodput"] < 1 and summary["wall_s"] > 0
    assert summary["steps_completed"] == 80 and summary["ok"] is True
    assert summary["exits"]["1"] == "killed by signal SIGKILL"
    assert summary["exits"]["0"] == summary["exits"]["2"] == "exit code 0"
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "recovered" in proc.stdout and "PASS" in proc.stdout

    # every event log shows the reserve rank taking over after the SIGKILL
    events = [json.loads(line) for line in (out / "events" / "rank2.jsonl").read_text().splitlines()]
    assert any(e["ev"] == "enter" and e["active_rank"] == 1 for e in events)
    # the wrapper's monitor processes are gone too (not only the ranks)
    monitor_pids = [int(p.read_text().split()[0]) for p in (out / "pids").glob("monitor*.pid")]
    assert _pids_alive(monitor_pids) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--faults", "explode@rank1:step3"], "unknown kind 'explode'"),
        (["--faults", "exception@rank1"], "expected KIND@rankR:stepS"),
        (["--faults", "hang@rank9:step3"], "rank 9 does not exist"),
        (["--faults", "hang@rank1:step500"], "past the last step (160)"),
        (["--soft-timeout", "9"], "must be below --hard-timeout"),
        (["--steps", "0"], "must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(tmp_path: Path, args, message):
    proc = _demo(*args, "--output-dir", str(tmp_path / "out"), timeout=50)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "trainguard demo: error:" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was started
