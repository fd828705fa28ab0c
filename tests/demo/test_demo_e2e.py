"""``trainguard demo`` end to end: real rank processes, real faults, the summary it writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``trainguard demo`` in its own session; on timeout stop the whole session."""
    env = {**os.environ, "COLUMNS": "160"}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "trainguard", "demo", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the demo stops its ranks on SIGTERM
            try:
                out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            pytest.fail(f"demo did not finish in {timeout} s:\n{out[-4000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
def test_demo_recovers_from_exception_hang_and_sigkill(tmp_path: Path):
    out = tmp_path / "demo"
    started = time.monotonic()
    proc = _demo(
        "--ranks", "2", "--reserve-ranks", "1",
        "--faults", "exception@rank1:step20,hang@rank0:step35,sigkill@rank1:step50",
        "--steps", "80", "--checkpoint-every", "10", "--batch-size", "64",
        "--soft-timeout", "3", "--hard-timeout", "15",
        "--output-dir", str(out), "--timeout", "110", timeout=140,
    )
    elapsed = time.monotonic() - started
    print(proc.stdout[-6000:], proc.stderr[-3000:], f"demo took {elapsed:.1f} s", sep="\n")
    assert proc.returncode == 0, "demo failed; rank logs in " + str(out / "logs")

    summary = json.loads((out / "summary.json").read_text())
    exc, hang, kill = summary["faults"]
    assert [(r["kind"], r["rank"]) for r in summary["faults"]] == [
        ("exception", 1), ("hang", 0), ("sigkill", 1)
    ]
    for row in (exc, hang, kill):
        assert row["recovered"] is True and row["fired"] is True
        assert row["detection_s"] is not None and 0 <= row["detection_s"] < 30
        assert row["restart_s"] is not None and 0 <= row["restart_s"] < 30
        assert row["world_size_after"] == 2  # the reserve rank replaced the killed one
        # checkpoints are asynchronous: the steps since the last *committed* one are lost
        assert 0 <= row["steps_lost"] < 30
    _check_resumed_from_the_last_commit(out, summary)
    assert exc["detected_by"] == "exception raised (rank 1)"
    assert hang["detected_by"] == "monitor: soft timeout (rank 0)"
    assert 2.0 <= hang["detection_s"] <= 3 + 5.0  # soft timeout (3 s) + generous slack
    assert kill["detected_by"] == "monitor: process died (rank 1)"
    assert summary["restarts"] == 3 and summary["unplanned_restarts"] == []
    assert summary["accuracy"] >= 0.95
    assert 0 < summary["goodput"] < 1 and summary["wall_s"] > 0
    assert summary["steps_completed"] == 80 and summary["ok"] is True
    assert summary["exits"]["1"] == "killed by signal SIGKILL"
    assert summary["exits"]["0"] == summary["exits"]["2"] == "exit code 0"
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "recovered" in proc.stdout and "PASS" in proc.stdout
    # asynchronous checkpoints: committed, measured, and no writer process left for the parent
    # to kill (the SIGKILLed rank's writer exits when its trainer dies)
    ck = summary["checkpoint"]
    print("checkpoint figures:", ck)
    assert ck["format"] == "torch" and ck["committed"] >= 3 and 80 in ck["committed_steps"]
    assert ck["median_block_ms"] is not None and ck["sync_save_ms"] is not None
    assert summary["helpers_killed_by_parent"] == []
    assert "checkpoints (torch, async)" in proc.stdout

    # every event log shows the reserve rank taking over after the SIGKILL
    events = [
        json.loads(line) for line in (out / "events" / "rank2.jsonl").read_text().splitlines()
    ]
    assert any(e["ev"] == "enter" and e["active_rank"] == 1 for e in events)
    # the wrapper's monitor processes are gone too (not only the ranks)
    monitor_pids = [int(p.read_text().split()[0]) for p in (out / "pids").glob("monitor*.pid")]
    assert _pids_alive(monitor_pids) == []


def _check_resumed_from_the_last_commit(out: Path, summary: dict) -> None:
    """Each restart resumed from the newest checkpoint committed (on every rank) before it, and
    the table's ``steps_lost`` counts the steps done since then."""
    from trainguard._demo._events import read_events

    events = [e for evs in read_events(out / "events").values() for e in evs]
    resume = {e["iteration"]: e["resume_step"] for e in events if e["ev"] == "enter"}
    faults = sorted((e for e in events if e["ev"] == "fault"), key=lambda e: e["index"])
    for fault, row in zip(faults, summary["faults"]):
        it = fault["iteration"]
        committed = [e["step"] for e in events if e["ev"] == "checkpoint" and e["iteration"] <= it]
        print(
            f"{fault['kind']} at step {fault['step']}: committed {committed}, resumed from "
            f"{resume[it + 1]}"
        )
        # >=: a commit can be durable on disk a moment before its event is written
        assert max(committed, default=0) <= resume[it + 1] < fault["step"]
        assert resume[it + 1] % 10 == 0  # a checkpoint step (--checkpoint-every 10)
        assert row["steps_lost"] == fault["step"] - 1 - resume[it + 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--faults", "explode@rank1:step3"], "unknown kind 'explode'"),
        (["--faults", "exception@rank1"], "expected KIND@rankR:stepS"),
        (["--faults", "hang@rank9:step3"], "rank 9 does not exist"),
        (["--faults", "hang@rank1:step500"], "past the last step (160)"),
        (["--soft-timeout", "9"], "must be below --hard-timeout"),
        (["--steps", "0"], "--steps: must be >= 1 (got '0')"),
        (["--duration", "5"], "--duration: must be >= 20 seconds (got '5')"),
        (["--duration", "20", "--fault-every", "2"],
         "--fault-every: must be >= 5 seconds (got '2')"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(tmp_path: Path, capsys, args, message):
    # in this process (an interpreter start costs seconds on a loaded CI machine); the real
    # entry point's exit status is checked once below
    from trainguard.cli import main

    try:
        code = main(["demo", *args, "--output-dir", str(tmp_path / "out")])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "trainguard demo: error:" in err
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.timeout(60)
def test_bad_arguments_exit_2_from_the_command_line(tmp_path: Path):
    proc = _demo("--faults", "explode@rank1:step3", "--output-dir", str(tmp_path / "out"),
                 timeout=50)
    assert proc.returncode == 2
    assert "trainguard demo: error:" in proc.stderr and "unknown kind 'explode'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_sigterm_to_the_demo_stops_and_reaps_every_rank(tmp_path: Path):
    out = tmp_path / "demo"
    env = {**os.environ}
    env.pop("LOCAL_RANK", None)
    cmd = [
        sys.executable,
        "-m",
        "trainguard",
        "demo",
        "--ranks",
        "2",
        "--reserve-ranks",
        "1",
        "--faults",
        "hang@rank1:step5",
        "--soft-timeout",
        "60",
        "--hard-timeout",
        "90",
        "--output-dir",
        str(out),
    ]
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    ) as proc:
        try:
            deadline = time.monotonic() + 90
            fired = out / "markers" / "fault0.json"
            while not fired.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)  # wait until rank 1 hangs (every rank is up by then)
            assert fired.exists(), "the hang never started"
            starts = [
                json.loads(line)
                for f in (out / "events").glob("rank*.jsonl")
                for line in f.read_text().splitlines()
            ]
            pids = [e["pid"] for e in starts if e["ev"] == "start"]
            assert len(pids) == 3
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    print(output[-3000:], f"stopped {time.monotonic() - sent:.1f} s after SIGTERM", sep="\n")
    assert proc.returncode == 143
    assert "every rank was stopped" in output
    assert _pids_alive(pids) == []
    monitor_pids = [int(p.read_text().split()[0]) for p in (out / "pids").glob("monitor*.pid")]
    assert _pids_alive(monitor_pids) == []
