"""The Detector surface in one process: sections, collectives, data wait, misuse, actions, CLI."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainguard.cli import main
from trainguard.straggler import (
    Actions,
    CallableId,
    Detector,
    MemoryTransport,
    Scorer,
    ScoringConfig,
    StragglerConfigError,
    StragglerError,
    _actions,
)


@pytest.fixture
def detector():
    yield Detector
    Detector.shutdown()


def _start(**kw):
    Detector.initialize(report_time_interval=0, rank=0, world_size=1, poll_s=0.01, **kw)


def test_misuse_raises_clear_errors(detector):
    with pytest.raises(StragglerError, match="not initialized"):
        Detector.detection_section("x")
    with pytest.raises(StragglerError, match="singleton"):
        Detector()
    with pytest.raises(StragglerConfigError, match="window_steps must be an integer >= 1"):
        _start(window_steps=0)
    with pytest.raises(StragglerConfigError, match="scores_to_compute"):
        _start(scores_to_compute=["gpu"])
    with pytest.raises(StragglerConfigError, match="no store: call init_process_group first"):
        Detector.initialize(rank=1, world_size=4)
    _start()
    with pytest.raises(StragglerError, match="already initialized"):
        _start()
    with pytest.raises(StragglerConfigError, match="needs a name"), \
            Detector.detection_section():
        pass


def test_section_time_excludes_collective_wait(detector, monkeypatch):
    def slow_all_reduce(tensor, op=None, group=None, async_op=False):
        time.sleep(0.03)  # stands in for waiting on a late peer

    monkeypatch.setattr(c10d, "all_reduce", slow_all_reduce)
    monkeypatch.setattr(dist, "all_reduce", slow_all_reduce)
    _start(window_steps=2)
    assert dist.all_reduce is not slow_all_reduce  # wrapped
    sec = Detector.detection_section("step")
    assert Detector.detection_section("step") is sec
    for _ in range(3):
        Detector.step()
        with sec:
            time.sleep(0.01)
            dist.all_reduce(None)
    Detector.step()
    Detector.shutdown()
    assert dist.all_reduce is slow_all_reduce  # restored
    reports = Detector.last_reports()
    assert reports, "no window scored"
    local = reports[0].local_section_summaries["step"]
    per = reports[0].per_rank[0]
    print(local, per)
    assert 9.5 <= local["median"] < 25.0  # 10 ms own work, not 40 ms
    assert per["wait"] >= 29.0 and 9.5 <= per["compute"] < 25.0


def test_added_collective_wait_counts_like_a_wrapped_collective(detector):
    """A wait no wrapper sees (the exposed tail of DDP's asynchronous all-reduce, which ``backward``
    waits for in C++) is added by the caller: the section excludes it, the step counts it."""
    with pytest.raises(StragglerError, match="not initialized"):
        Detector.add_collective_wait(0.01)
    _start(window_steps=2)
    sec = Detector.detection_section("backward")
    for _ in range(3):
        Detector.step()
        with sec:
            time.sleep(0.04)  # 10 ms own work + 30 ms waiting for a peer, unseen
            Detector.add_collective_wait(0.03)
        Detector.add_collective_wait(0.0)  # nothing to add: no change
    Detector.step()
    Detector.shutdown()
    reports = Detector.last_reports()
    assert reports, "no window scored"
    local = reports[0].local_section_summaries["backward"]
    per = reports[0].per_rank[0]
    print(local, per)
    assert 9.5 <= local["median"] < 25.0  # 10 ms own work, not 40 ms
    assert per["wait"] >= 29.0 and 9.5 <= per["compute"] < 25.0


def test_data_wait_decorator_and_wrapped_callables(detector):
    class Model:
        def forward(self, x):
            time.sleep(0.002)
            return x

    _start(window_steps=4)
    model = Model()
    Detector.wrap_callables([CallableId(model, "forward")])

    @Detector.detection_section()
    def helper():
        return 7

    def loader():
        for i in range(5):
            time.sleep(0.004)
            yield i

    for batch in Detector.wrap_dataloader(loader()):
        assert model.forward(batch) == batch and helper() == 7
        Detector.generate_report_if_interval_elapsed()  # marks the step
    sections = set(Detector._get().recorder.sections)
    assert {"Model.forward", "test_data_wait_decorator_and_wrapped_callables.<locals>.helper"} \
        <= sections
    Detector.restore_original_callables()
    assert "forward" not in model.__dict__
    Detector.shutdown()
    per = Detector.last_reports()[0].per_rank[0]
    assert per["data"] >= 3.5 and per["steps"] == 4


def test_generate_report_never_silent(detector):
    _start(window_steps=50)
    empty = Detector.generate_report()
    assert empty is not None and empty.warnings and "no window scored yet" in empty.warnings[0]
    assert Detector.generate_report_if_interval_elapsed() is None


def test_non_aggregating_rank_gets_none(detector):
    Detector.initialize(rank=1, world_size=2, transport=MemoryTransport(), poll_s=0.01)
    assert Detector.generate_report() is None


def test_actions_write_files_log_and_request_exclusion(tmp_path, caplog):
    scorer = Scorer(ScoringConfig(consecutive=1, warmup_windows=0, exclude_windows=2), 3)
    calls = []
    actions = Actions(log=True, run_dir=tmp_path,
                      on_exclude=lambda node, rank, report: calls.append((node, rank)))
    logger = logging.getLogger("trainguard.straggler.test")

    def summary(rank: int, compute: float) -> dict:
        m = {"step": [compute + 1, 0, compute + 1, 10], "compute": [compute, 0, compute, 10],
             "wait": [1.0, 0, 1.0, 10], "data": [0.0, 0, 0.0, 10]}
        return {"rank": rank, "node": f"n{rank}", "steps": 10, "metrics": m, "sections": {}}

    with caplog.at_level(logging.INFO, logger="trainguard.straggler.test"):
        for w in range(3):
            _actions.apply(actions, scorer.score(w, {0: summary(0, 10.0), 1: summary(1, 30.0),
                                                    2: summary(2, 10.0)}), logger)
    assert calls == [("n1", 1)]
    assert "rank 1 on node n1 flagged" in caplog.text
    lines = (tmp_path / "straggler.jsonl").read_text().splitlines()
    assert [json.loads(x)["window"] for x in lines] == [0, 1, 2]
    prom = (tmp_path / "straggler.prom").read_text()
    assert 'trainguard_straggler_flagged{rank="1",node="n1",kind="imbalance"} 1' in prom
    assert json.loads((tmp_path / "straggler_report.json").read_text())["window"] == 2


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["straggler", "report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("trainguard straggler report: error: no such file or directory: "
                          f"{tmp_path / 'nope'} (pass the run_dir given to Actions(run_dir=...)")
    assert main(["straggler", "report", str(tmp_path)]) == 2  # the folder, without the file
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"no such file or directory: {tmp_path / 'straggler.jsonl'} (" in err
    assert main(["straggler", "report", str(tmp_path), "--last", "0"]) == 2
    assert capsys.readouterr().err.startswith("trainguard straggler report: error: --last")
    (tmp_path / "straggler.jsonl").write_text('{"window": 0}\n{broken\n')
    assert main(["straggler", "report", str(tmp_path)]) == 2
    assert "straggler.jsonl:2: not a JSON line" in capsys.readouterr().err
