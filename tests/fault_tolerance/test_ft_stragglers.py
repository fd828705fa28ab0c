"""Straggler summaries through the launcher's slots: the launcher scores local ranks itself."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard._core.shm import unique_prefix
from trainguard.fault_tolerance._slot import Slot
from trainguard.fault_tolerance._stragglers import StragglerWatch
from trainguard.straggler._transport import (
    MemoryTransport,
    SlotTransport,
    decode_summary,
    encode_summary,
)

BENCH = Path(__file__).resolve().parents[2] / "bench"
RANK_SCRIPT = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
from _straggler_workload import run
run()
"""


def _summary(rank: int, window: int, step_ms: float) -> dict:
    stats = [step_ms, 0.1, step_ms * 1.05, 20.0]
    return {"rank": rank, "node": "n0", "window": window, "steps": 20, "t_end": 0.0,
            "metrics": {"step": stats, "compute": stats, "wait": [0.5, 0.0, 0.6, 20.0],
                        "data": [0.0, 0.0, 0.0, 20.0]},
            "sections": {"s" * 40 + str(i): stats for i in range(12)}}


def test_summaries_fit_the_slot_and_a_slow_rank_is_flagged_without_any_store():
    """Ranks publish through SlotTransport; StragglerWatch reads only the slots."""
    slots = [Slot(unique_prefix("t") + str(i), create=True) for i in range(4)]
    transports = [SlotTransport(MemoryTransport(), s.name) for s in slots]
    try:
        body = encode_summary(_summary(0, 0, 10.0), 504)
        assert len(body) <= 504 and decode_summary(body)["metrics"]["step"][0] == 10.0
        watch = StragglerWatch(slots, lambda lr: 100 + lr, cycle=0, stale_s=60.0)
        for window in range(10):
            for rank, t in enumerate(transports):
                t.publish(_summary(rank, window, 13.0 if rank == 1 and window >= 4 else 10.0))
            watch.poll()
        assert watch.last_scored == 9  # every window scored, in order, from the slots alone
        assert set(watch.ever_flagged) == {101}  # global rank via rank_of
        assert "compute" in watch.table_text()
    finally:
        for t in transports:
            t.close()
        for s in slots:
            s.close()


def test_watch_never_reports_a_rank_back_at_1x():
    """Issue 10/11: a held flag at 1.00x (0.1 % cost) is not in the log nor the summary text."""
    slots = [Slot(unique_prefix("t") + str(i), create=True) for i in range(3)]
    transports = [SlotTransport(MemoryTransport(), s.name) for s in slots]
    try:
        watch = StragglerWatch(slots, lambda lr: lr, cycle=0, stale_s=60.0)
        for window in range(10):
            slow = 13.0 if 3 <= window <= 6 else 10.01  # then back at ~1.00x
            for rank, t in enumerate(transports):
                t.publish(_summary(rank, window, slow if rank == 1 else 10.0))
            watch.poll()
            if window == 6:
                assert set(watch.flagged) == {1}
            if window == 7:  # the hysteresis still holds the flag; the report does not show it
                assert watch.flagged == {}
        assert watch.ever_flagged == {1: "compute, 30 % slower"}
    finally:
        for t in transports:
            t.close()
        for s in slots:
            s.close()


def test_stop_reads_records_published_after_the_last_poll(caplog):
    """A cycle shorter than the idle poll (a rank killed within a second): the records its ranks
    published before the end are still scored and logged once, by ``stop``."""
    slots = [Slot(unique_prefix("t") + str(i), create=True) for i in range(2)]
    transports = [SlotTransport(MemoryTransport(), s.name) for s in slots]
    try:
        watch = StragglerWatch(slots, lambda lr: lr, cycle=0, stale_s=60.0).start()
        for rank, t in enumerate(transports):  # before the watch's first (idle, 0.5 s) poll
            t.publish(_summary(rank, 0, 10.0))
        with caplog.at_level("INFO", logger="trainguard.fault_tolerance"):
            watch.stop()
        assert watch.scored == 1 and watch.last_scored == 0
        lines = [r.getMessage() for r in caplog.records
                 if "straggler watch scored" in r.getMessage()]
        assert lines == [("cycle 0: straggler watch scored 1 window(s) from the slots; no "
                          "straggler at the launcher's thresholds (ratio_threshold 1.2)")], lines
    finally:
        for t in transports:
            t.close()
        for s in slots:
            s.close()


def test_launcher_flags_an_injected_slow_rank_in_its_log_and_summary(launch, tmp_path):
    script = tmp_path / "strag.py"
    script.write_text(RANK_SCRIPT)
    # 3 ranks (the median is a healthy rank), 10-step windows, rank 1 1.3x slower from window 5:
    # a 3 ms gap per step, above the launcher's default 2 ms floor
    cfg = {"steps": 130, "window": 10, "compute_ms": 10.0, "collective": "all",
           "slow": [{"rank": 1, "start": 50, "end": 10_000, "factor": 1.3}]}
    run = launch("--nproc-per-node", "3", "--max-restarts", "0", str(script), timeout=150,
                 env={"TG_STRAG_CFG": json.dumps(cfg)})
    assert run.rc == 0, run
    assert "straggler rank 1 (node n1): compute" in run.err, run
    assert "straggler rank 0" not in run.err and "straggler rank 2" not in run.err, run
    assert "straggler watch scored" in run.err, run
    assert "stragglers" in run.err and "rank 1 (compute" in run.err, run
