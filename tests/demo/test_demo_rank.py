"""Rank-side pieces of the demo without processes: fault markers, checkpoints, batches."""

from __future__ import annotations

import os

import pytest
import torch

from trainguard._demo._config import DemoConfig, clear_run_files
from trainguard._demo._data import load_split, prepare_split
from trainguard._demo._events import EventLog, read_events
from trainguard._demo._faults import DemoFault, FaultInjector
from trainguard._demo._schedule import parse_faults
from trainguard._demo._train import _Batches, build_model, load_checkpoint, save_checkpoint


@pytest.fixture
def config(tmp_path) -> DemoConfig:
    cfg = DemoConfig(output_dir=str(tmp_path), ranks=2, reserve=1, steps=20,
                     faults=tuple(parse_faults("exception@rank1:step5,hang@rank2:step7")))
    clear_run_files(cfg.root)
    return cfg


def test_a_fault_fires_once_even_when_its_step_runs_again(config):
    log = EventLog(config.events_path(1), 1)
    injector = FaultInjector(config, 1, log)
    injector.maybe_fire(4, iteration=0)  # not scheduled: nothing happens
    with pytest.raises(DemoFault, match="step 5"):
        injector.maybe_fire(5, iteration=0)
    injector.maybe_fire(5, iteration=1)  # the restart re-runs step 5: already fired
    other = FaultInjector(config, 1, log)  # even a fresh process (same output dir) skips it
    other.maybe_fire(5, iteration=2)
    log.close()
    faults = [e for e in read_events(config.root / "events")[1] if e["ev"] == "fault"]
    assert [(e["kind"], e["step"], e["iteration"]) for e in faults] == [("exception", 5, 0)]
    assert config.marker_path(0).exists() and not config.marker_path(1).exists()


def test_only_the_scheduled_rank_fires(config):
    log = EventLog(config.events_path(0), 0)
    FaultInjector(config, 0, log).maybe_fire(5, iteration=0)  # rank 0 has no faults
    log.close()
    assert not config.marker_path(0).exists()


def test_checkpoint_round_trip_is_atomic(tmp_path):
    model = build_model(16, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    path = tmp_path / "checkpoint.pt"
    assert load_checkpoint(path, model, opt) == 0  # nothing saved yet
    save_checkpoint(path, 30, model, opt)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # the temp file was renamed
    fresh = build_model(16, seed=2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert load_checkpoint(path, fresh, fresh_opt) == 30
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_a_killed_writer_leaves_the_previous_checkpoint(tmp_path):
    model, path = build_model(16, seed=1), tmp_path / "checkpoint.pt"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_checkpoint(path, 10, model, opt)
    pid = os.fork()
    if pid == 0:  # child: start the next save and die before the rename
        os.replace = lambda *a: os.kill(os.getpid(), 9)  # type: ignore[assignment]
        save_checkpoint(path, 20, model, opt)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert load_checkpoint(path, model, opt) == 10


def test_batches_depend_only_on_the_step(config):
    prepare_split(config.data_path, seed=0)
    arrays = load_split(config.data_path)
    assert arrays["x_train"].shape[1] == 64 and len(arrays["y_test"]) == 360
    data = torch.utils.data.TensorDataset(
        torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"])
    )
    first = _Batches(data, rank=1, world_size=2, batch=32, seed=0)
    resumed = _Batches(data, rank=1, world_size=2, batch=32, seed=0)  # as after a restart
    other_rank = _Batches(data, rank=0, world_size=2, batch=32, seed=0)
    for step in (1, 7, first.per_epoch + 3):
        x, y = first.get(step)
        assert x.shape == (32, 64)
        assert torch.equal(y, resumed.get(step)[1])
        assert not torch.equal(x, other_rank.get(step)[0])  # DistributedSampler splits the data
    assert not torch.equal(
        first.get(1)[1], first.get(first.per_epoch + 1)[1]
    )  # reshuffled per epoch
