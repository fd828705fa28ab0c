"""The demo's report builder, table and timeline on synthetic event logs (no processes)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from trainguard._demo._events import EventLog, EventTail, read_events
from trainguard._demo._report import build_summary, render_table, restart_groups
from trainguard._demo._schedule import parse_faults
from trainguard._demo._timeline import plot_timeline

STEP_S = 0.1


class Run:
    """Builds event logs the way ranks write them, on a synthetic clock."""

    def __init__(self) -> None:
        self.events: dict[int, list[dict]] = {}

    def emit(self, rank: int, ev: str, t: float, **fields) -> None:
        self.events.setdefault(rank, []).append({"ev": ev, "t": t, "rank": rank, **fields})

    def iteration(self, ranks, it, resume, last_step, t, world_size=3):
        for active, rank in enumerate(ranks):
            self.emit(rank, "enter", t, iteration=it, active_rank=active,
                      active_world_size=len(ranks), world_size=world_size, resume_step=resume)
        for step in range(resume + 1, last_step + 1):
            t += STEP_S
            for rank in ranks:
                self.emit(rank, "step", t, t0=t - STEP_S, step=step, loss=1.0, iteration=it)
            if step % 10 == 0:
                self.emit(ranks[0], "checkpoint", t, step=step, iteration=it)
        return t

    def restart(self, ranks, into, cause, fault_ranks, detect, reentries):
        for rank, back in zip(ranks, reentries):
            self.emit(rank, "restart", back + 0.01, into_iteration=into, iteration=into,
                      cause=cause, fault_ranks=fault_ranks, fault_time=detect - 0.01,
                      detection_time=detect + 0.01 * rank, reentry_time=back)


def two_fault_run(accuracy: float = 0.97) -> Run:
    """2 active + 1 reserve; exception on rank 1 at step 15, SIGKILL of rank 1 at step 25."""
    run = Run()
    for rank in (0, 1, 2):
        run.emit(rank, "start", 1.0, pid=100 + rank)
    t = run.iteration([0, 1], 0, 0, 14, 5.0)
    run.emit(1, "fault", 10.0, kind="exception", step=15, index=0, iteration=0)
    run.restart([0, 1], 1, "exception", [1], 10.05, [10.30, 10.35])
    t = run.iteration([0, 1], 1, 10, 24, 10.5)
    run.emit(1, "fault", 20.0, kind="sigkill", step=25, index=1, iteration=1)
    run.restart([0, 2], 2, "terminated", [1], 20.5, [20.9, 21.0])
    t = run.iteration([0, 2], 2, 20, 30, 21.2)
    for rank in (0, 2):
        run.emit(rank, "done", t + 0.05, step=30, accuracy=accuracy, iteration=2)
        run.emit(rank, "exit", t + 0.1, status="completed", accuracy=accuracy)
    return run


SCHEDULE = "exception@rank1:step15,sigkill@rank1:step25"


def test_faults_are_matched_to_their_restarts():
    run = two_fault_run()
    summary = build_summary(run.events, parse_faults(SCHEDULE), steps=30, wall_s=40.0)
    exc, kill = summary["faults"]
    assert (exc["kind"], exc["rank"], exc["step"]) == ("exception", 1, 15)
    assert exc["detected_by"] == "exception raised (rank 1)"
    assert exc["detection_s"] == pytest.approx(0.05, abs=1e-3)
    # the records' own definition: fault time (10.04) -> the last rank's re-entry (10.35)
    assert exc["restart_s"] == pytest.approx(0.31, abs=1e-3)
    assert exc["steps_lost"] == 4  # steps 11..14 redone after resuming from the step-10 checkpoint
    assert exc["world_size_after"] == 2 and exc["recovered"] is True
    assert exc["recovery_s"] == pytest.approx(0.6, abs=1e-3)  # first step of iteration 1 at 10.6
    assert kill["detected_by"] == "monitor: process died (rank 1)"
    assert kill["detection_s"] == pytest.approx(0.5, abs=1e-3)
    assert kill["restart_s"] == pytest.approx(0.51, abs=1e-3)
    assert kill["steps_lost"] == 4 and kill["world_size_after"] == 2 and kill["recovered"] is True
    assert summary["restarts"] == 2 and summary["unplanned_restarts"] == []
    assert summary["ok"] is True and summary["problems"] == []


def test_goodput_counts_each_kept_step_once():
    summary = build_summary(two_fault_run().events, parse_faults(SCHEDULE), steps=30, wall_s=40.0)
    assert summary["useful_step_s"] == pytest.approx(30 * STEP_S, abs=1e-3)
    assert summary["goodput"] == pytest.approx(30 * STEP_S / 40.0, abs=1e-3)
    assert summary["steps_completed"] == 30
    window = 22.2 - 5.0  # first step start .. last step end
    assert summary["train_goodput"] == pytest.approx(30 * STEP_S / window, rel=1e-2)
    assert summary["accuracy"] == 0.97


def test_summary_has_the_required_keys_and_is_json():
    summary = build_summary(two_fault_run().events, parse_faults(SCHEDULE), steps=30, wall_s=40.0,
                            exits={1: "killed by signal SIGKILL", 0: "exit code 0"})
    data = json.loads(json.dumps(summary))
    assert {"faults", "accuracy", "goodput", "wall_s"} <= set(data)
    for row in data["faults"]:
        assert {"kind", "rank", "detected_by", "detection_s", "restart_s", "steps_lost",
                "world_size_after", "recovered"} <= set(row)
    assert data["exits"] == {"0": "exit code 0", "1": "killed by signal SIGKILL"}


def test_low_accuracy_fails_the_run():
    summary = build_summary(
        two_fault_run(accuracy=0.9).events, parse_faults(SCHEDULE), steps=30, wall_s=40.0
    )
    assert all(r["recovered"] for r in summary["faults"])
    assert summary["ok"] is False and summary["problems"] == ["accuracy 0.9000 < 0.95"]


def test_a_fault_that_never_fired_is_not_recovered():
    faults = parse_faults(SCHEDULE + ",hang@rank2:step28")
    summary = build_summary(two_fault_run().events, faults, steps=30, wall_s=40.0)
    hang = summary["faults"][2]
    assert (
        hang["fired"] is False and hang["detected_by"] == "not fired" and hang["recovered"] is False
    )
    assert summary["problems"] == ["hang@rank2:step28 not recovered (not fired)"]


def test_a_fault_without_a_restart_is_not_recovered():
    run = Run()
    t = run.iteration([0, 1], 0, 0, 14, 5.0)
    run.emit(1, "fault", t, kind="hang", step=15, index=0, iteration=0)
    summary = build_summary(
        run.events, parse_faults("hang@rank1:step15"), steps=30, wall_s=60.0, timed_out=True
    )
    row = summary["faults"][0]
    assert row["detected_by"] == "no restart seen" and row["recovered"] is False
    assert row["detection_s"] is None and summary["accuracy"] is None and summary["ok"] is False
    assert summary["problems"] == [
        "hang@rank1:step15 not recovered (no restart seen)",
        "training did not finish (no accuracy)",
        "the global timeout expired",
    ]


def test_unplanned_restart_is_reported_and_fails_the_run():
    run = two_fault_run()
    summary = build_summary(
        run.events, parse_faults("exception@rank1:step15"), steps=30, wall_s=40.0
    )
    assert [g["into_iteration"] for g in summary["unplanned_restarts"]] == [2]
    assert restart_groups(run.events)[2]["reported_by"] == [0, 2]
    assert summary["ok"] is False
    assert summary["problems"] == [
        "unplanned restart into iteration 2: monitor: process died (rank 1)"
    ]


def test_table_restart_time_is_the_restart_records_own_figure():
    """13.8: the wrapper logged "restart=3.2 s" for a hang, the table showed 0.23 s (detection
    -> re-entry). The table now shows the record's ``restart_s``, the slowest rank's."""
    run = two_fault_run()
    for rank, figure in ((0, 3.2), (1, 3.25)):
        for e in run.events[rank]:
            if e["ev"] == "restart" and e["into_iteration"] == 1:
                e["restart_s"] = figure
    summary = build_summary(run.events, parse_faults(SCHEDULE), steps=30, wall_s=40.0)
    assert summary["faults"][0]["restart_s"] == 3.25
    console = Console(record=True, width=160)
    console.print(render_table(summary, width=160))
    assert "3.25" in console.export_text()


def _full_disk_run() -> Run:
    """What a 3 MB output filesystem produced: saves, no commit, failed writes, a restart
    caused by the synchronous baseline save's ENOSPC that no plan asked for."""
    run = two_fault_run()
    for step in (10, 20, 30):
        for rank in (0, 1):
            run.emit(
                rank,
                "checkpoint_save",
                6.0,
                step=step,
                iteration=0,
                format="torch",
                block_ms=1.0,
                stage_ms=0.5,
            )
        run.emit(
            0,
            "checkpoint_failed",
            6.5,
            step=step,
            iteration=0,
            error="rank 0: OSError: [Errno 28] No space left on device",
        )
    run.emit(
        0,
        "checkpoint_sync_failed",
        6.0,
        step=10,
        error="OSError: [Errno 28] No space left on device",
    )
    run.events = {r: [e for e in evs if e["ev"] != "checkpoint"] for r, evs in run.events.items()}
    return run


def test_full_disk_is_not_a_pass():
    """13.4: "0 committed, 151 saves" and ENOSPC only in rank logs printed PASS."""
    summary = build_summary(
        _full_disk_run().events, parse_faults(SCHEDULE), steps=30, wall_s=40.0, checkpoint_every=10
    )
    print(summary["problems"])
    assert summary["ok"] is False
    assert summary["problems"] == [
        (
            "3 checkpoint save(s) failed (first: step 10: rank 0: OSError: [Errno 28] No space "
            "left on device)"
        ),
        "the synchronous baseline save failed: OSError: [Errno 28] No space left on device",
        "no checkpoint committed (6 saves)",
    ]
    console = Console(record=True, width=300)
    console.print(render_table(summary, width=300))
    text = console.export_text()
    assert "PASS" not in text and "FAIL: 3 checkpoint save(s) failed" in text


def test_checkpoints_that_stop_committing_fail_the_run():
    run = two_fault_run()  # commits 10, 20, 30 (one per iteration, re-done after restarts)
    ok = build_summary(
        run.events, parse_faults(SCHEDULE), steps=30, wall_s=40.0, checkpoint_every=10
    )
    assert ok["ok"] is True, ok["problems"]
    run.events = {
        r: [e for e in evs if not (e["ev"] == "checkpoint" and e["step"] >= 20)]
        for r, evs in run.events.items()
    }
    summary = build_summary(
        run.events, parse_faults(SCHEDULE), steps=30, wall_s=40.0, checkpoint_every=10
    )
    assert summary["problems"] == [
        "checkpoints stopped committing: the newest is step 10, the last due was step 30"
    ]


def test_progress_prints_the_fault_before_the_restart_it_caused():
    """13.8: one poll brought rank 0's restart and rank 1's earlier fault; the view printed
    them in file order (the restart first)."""
    from trainguard._demo._progress import RunView

    run = two_fault_run()
    batch = [
        e for r in sorted(run.events) for e in run.events[r] if e["ev"] in ("fault", "restart")
    ]
    console = Console(record=True, width=200)
    view = RunView(console, steps=30, faults=2, world_size=3)
    view.feed(batch, live=False)
    lines = [ln for ln in console.export_text().splitlines() if ln.strip()]
    print("\n".join(lines))
    assert lines[0].startswith("rank 1: injected exception at step 15")
    assert lines[1].startswith("restart into iteration 1")
    assert lines[2].startswith("rank 1: injected sigkill at step 25")
    assert lines[3].startswith("restart into iteration 2")


def test_table_and_timeline_render(tmp_path):
    run = two_fault_run()
    summary = build_summary(run.events, parse_faults(SCHEDULE), steps=30, wall_s=40.0)
    console = Console(record=True, width=160)
    console.print(render_table(summary, width=160))
    console.print(render_table(summary, width=80))  # narrow terminals get the table turned
    text = console.export_text()
    assert "exception raised (rank 1)" in text and "monitor: process died (rank 1)" in text
    assert "PASS" in text
    png = tmp_path / "timeline.png"
    plot_timeline(run.events, png, t0=0.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_event_log_round_trip_and_tail_skips_torn_lines(tmp_path):
    log = EventLog(tmp_path / "rank3.jsonl", 3)
    tail = EventTail(tmp_path)
    log.emit("start", pid=1)
    assert [e["ev"] for e in tail.poll()] == ["start"]
    with open(tmp_path / "rank3.jsonl", "a") as fh:
        fh.write('{"ev": "step", "t": 1')  # a writer killed mid-line
    assert tail.poll() == []
    with open(tmp_path / "rank3.jsonl", "a") as fh:
        fh.write(', "rank": 3}\n')
    assert [e["ev"] for e in tail.poll()] == ["step"]
    log.close()
    assert [e["ev"] for e in read_events(tmp_path)[3]] == ["start", "step"]


def test_checkpoint_figures_in_the_summary_and_table():
    run = Run()
    run.iteration([0, 1], 0, 0, 2, 5.0)
    run.emit(0, "checkpoint_sync", 6.0, step=10, ms=30.0, min_ms=25.0, samples=3)
    for rank, block in ((0, 1.0), (1, 3.0), (0, 2.0), (1, 50.0)):
        run.emit(
            rank,
            "checkpoint_save",
            6.0,
            step=10,
            iteration=0,
            format="torch",
            block_ms=block,
            stage_ms=block / 2,
        )
    for rank in (0, 1):  # every rank skips alike: one skip
        run.emit(rank, "checkpoint_skip", 6.1, step=20, iteration=0)
    for step, at, durable in ((10, 12, 40.0), (20, 21, 20.0), (20, 23, 60.0)):
        run.emit(
            0,
            "checkpoint",
            6.2,
            step=step,
            iteration=0,
            committed_at=at,
            block_ms=1.0,
            commit_ms=5.0,
            durable_ms=durable,
        )
    summary = build_summary(run.events, [], steps=2, wall_s=10.0)
    ck = summary["checkpoint"]
    assert ck["format"] == "torch" and ck["saves"] == 4 and ck["committed"] == 3
    assert ck["skipped"] == 1 and ck["median_commit_ms"] == 5.0
    assert ck["committed_steps"] == [10, 20]  # step 20 committed twice (re-done after a restart)
    assert ck["median_block_ms"] == 2.5 and ck["max_block_ms"] == 50.0 and ck["min_block_ms"] == 1.0
    assert ck["median_durable_ms"] == 40.0 and ck["max_commit_lag_steps"] == 3
    assert ck["sync_save_ms"] == 30.0 and ck["sync_vs_async_block"] == 12.0
    assert ck["sync_save_min_ms"] == 25.0
    console = Console(record=True, width=160)
    console.print(render_table(summary, width=160))
    text = " ".join(console.export_text().split())
    assert (
        "training blocked 2.50 ms median (min 1.00, max 50.00) per save vs 30.00 ms (min 25.00)"
        in text
    )


def test_checkpoint_figures_without_checkpoints_are_empty():
    ck = build_summary(two_fault_run().events, parse_faults(SCHEDULE), steps=30, wall_s=40.0)[
        "checkpoint"
    ]
    assert ck["saves"] == 0 and ck["median_block_ms"] is None and ck["sync_vs_async_block"] is None


def test_no_faults_print_one_line_instead_of_an_empty_table():
    run = two_fault_run()
    run.events = {
        r: [e for e in evs if e["ev"] not in ("fault", "restart")] for r, evs in run.events.items()
    }
    summary = build_summary(run.events, [], steps=30, wall_s=40.0)
    for width in (160, 80):
        console = Console(record=True, width=width)
        console.print(render_table(summary, width=width))
        text = console.export_text()
        print(text)
        assert "no faults injected" in text
        assert "detected by" not in text and "faults and recovery" not in text


def test_goodput_line_says_wall_time_includes_start_up():
    summary = build_summary(two_fault_run().events, parse_faults(SCHEDULE), steps=30, wall_s=40.0)
    assert summary["rank_processes"] == 3
    console = Console(record=True, width=400)
    console.print(render_table(summary, width=400))
    text = console.export_text()
    print(text)
    assert (
        f"goodput {summary['goodput']:.1%} of 40.0 s wall (start-up and imports of 3 rank "
        f"processes included; training-window goodput {summary['train_goodput']:.1%}"
    ) in text


def test_fault_labels_do_not_cross_the_step_lines():
    """Each fault's label box on the step panel is clear of every rank's step line."""
    from matplotlib import pyplot as plt

    from trainguard._demo._timeline import _draw

    run = two_fault_run()
    for rank in (0, 1):  # iteration 0 runs right up to the exception, as in a real run
        run.emit(rank, "step", 9.95, t0=9.9, step=14, loss=1.0, iteration=0)
    fig = _draw(run.events, t0=0.0)
    try:
        fig.canvas.draw()
        top = fig.axes[0]
        labels = [t for t in top.texts if "@rank" in t.get_text()]
        assert [t.get_text() for t in labels] == ["exception @rank1", "sigkill @rank1"]
        lines = [
            ln.get_transform().transform_path(ln.get_path())
            for ln in top.get_lines()
            if len(ln.get_xdata()) > 1
        ]
        assert len(lines) >= 3
        for label in labels:
            box = label.get_window_extent()
            crossed = [i for i, path in enumerate(lines) if path.intersects_bbox(box, filled=False)]
            assert crossed == [], f"{label.get_text()!r} at {box} crosses step lines {crossed}"
    finally:
        plt.close(fig)
