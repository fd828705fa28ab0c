"""Per-collective lateness from the flight recorder (real gloo dumps) and the CUDA-event path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainguard.straggler import StragglerConfigError, StragglerError, _collectives
from trainguard.straggler._cuda import CudaEventTimer, on_cuda
from trainguard.straggler._recorder import Recorder
from trainguard.straggler.flight import collective_lateness, lateness_by_rank, lateness_from_path
from trainguard.testing import run_ranks

BENCH = str(Path(__file__).resolve().parents[2] / "bench")


def test_a_late_rank_is_late_at_every_gloo_collective_in_the_flight_recorder():
    cfg = {"collectives": 20, "compute_ms": 5.0, "late": {"rank": 1, "extra_ms": 20.0}}
    results = run_ranks("_straggler_fr_workload:run", 3, timeout_s=120, pythonpath=[BENCH],
                        env={"TG_FR_CFG": json.dumps(cfg), "TORCH_FR_BUFFER_SIZE": "2000"})
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    dumps = {r.rank: {"entries": r.result["entries"]} for r in results}
    arrivals = collective_lateness(dumps)
    all_reduces = [c for c in arrivals if "all_reduce" in c.op]
    assert len(all_reduces) >= 20 and all(len(c.arrivals_ns) == 3 for c in all_reduces)
    stats = lateness_by_rank(all_reduces)
    print({r: {k: round(v, 2) for k, v in s.items()} for r, s in stats.items()})
    # each all-reduce waits for rank 1, which sleeps 20 ms longer before it
    assert stats[1]["median_ms"] > 15.0 and stats[1]["last_pct"] >= 80.0
    assert stats[0]["median_ms"] < 5.0 and stats[2]["median_ms"] < 5.0


def test_lateness_from_path_says_what_is_wrong(tmp_path):
    with pytest.raises(StragglerError, match="no flight-recorder dumps"):
        lateness_from_path(str(tmp_path))


def test_cuda_event_path_is_chosen_by_device_and_never_built_without_cuda():
    assert not on_cuda((torch.ones(2),)) and not on_cuda(()) and not on_cuda(([],))
    if not torch.cuda.is_available():
        with pytest.raises(StragglerConfigError, match="needs a CUDA device"):
            CudaEventTimer()
        rec = Recorder(4)
        _collectives.install(rec)
        try:
            assert rec.cuda is None  # host timing on CPU
        finally:
            _collectives.uninstall()


class _FakeEvent:
    def __init__(self, t_ms: float) -> None:
        self.t_ms, self.complete = t_ms, False

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.t_ms - self.t_ms


class _FakeTimer(CudaEventTimer):
    """The real resolve/queue logic with host-side fake events (no GPU needed)."""

    def __init__(self) -> None:
        self.pending, self.dropped, self.clock = [], 0, 0.0

    def begin(self):
        return _FakeEvent(self.clock)

    def end(self, start):
        self.clock += 7.0  # the collective takes 7 ms on the "GPU"
        super_end = _FakeEvent(self.clock)
        self.pending.append((start, super_end))


class _CudaLike:
    is_cuda = True


def test_collectives_on_cuda_tensors_are_timed_by_events_resolved_at_step_marks():
    rec = Recorder(2)
    fake = _FakeTimer()
    rec.cuda = fake
    timed = _collectives._wrap(rec, lambda tensor: None)
    rec.step()
    timed(_CudaLike())
    assert rec.coll_ns == 0 and len(fake.pending) == 1  # not complete yet: nothing counted
    rec.step()
    fake.pending[0][1].complete = True
    timed(torch.ones(1))  # a CPU tensor: host timing, next to the event path
    host_ns = rec.coll_ns
    data = rec.step()
    assert data is not None and not fake.pending
    assert data["metrics"]["wait"][-1] == pytest.approx(7e6 + host_ns, rel=1e-6)
