"""The demo's asynchronous checkpoints on one rank (gloo group of 1, real writer process)."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainguard._core.hooks import run_reset_callbacks
from trainguard._demo._ckpt import DemoCheckpoints
from trainguard._demo._config import DemoConfig, clear_run_files
from trainguard._demo._events import EventLog, read_events
from trainguard._demo._train import build_model
from trainguard.testing import free_port


class _CallWrapper:
    """What DemoCheckpoints uses of ``inprocess.CallWrapper``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def atomic(self) -> threading.RLock:
        return self.lock

    def tracking_process_group(self):
        return contextlib.nullcontext()


@pytest.fixture
def one_rank_group():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(16, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _wait_committed(cks: DemoCheckpoints, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cks.busy.is_set():
        assert time.monotonic() < deadline, "the committer did not commit in time"
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_snapshot_skip_abort_and_reload_of_the_last_commit(tmp_path, one_rank_group):
    cfg = DemoConfig(output_dir=str(tmp_path), ranks=1, reserve=0, steps=40)
    clear_run_files(cfg.root)
    log = EventLog(cfg.events_path(0), 0)
    cks, cw = DemoCheckpoints(cfg, log), _CallWrapper()
    try:
        print(f"writer ready after {cks.warm_up(0):.2f} s")
        model, opt = _trained(seed=1)
        assert cks.begin(cw, model, opt) == 0  # nothing committed yet
        cks.save(cw, 10, model, opt, iteration=0)
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():  # training goes on at once: the checkpoint must not see this
            for p in model.parameters():
                p.add_(1.0)
        _wait_committed(cks)  # by the committer thread
        cks.ckpt.faults[20] = {"phase": "recv", "action": "hang"}  # the writer hangs on 20
        cks.save(cw, 20, model, opt, iteration=0)
        cks.save(cw, 30, model, opt, iteration=0)  # 20 is still in flight: skipped
        # a restart aborts while 20 is in flight: the busy writer is killed, 20 never commits
        assert "trainguard.checkpointing.async" not in run_reset_callbacks()
        cks.ckpt.faults.clear()
        fresh, fresh_opt = _trained(seed=2)
        assert cks.begin(cw, fresh, fresh_opt) == 10  # the next iteration resumes from 10
        for a, b in zip(saved, fresh.parameters()):
            assert torch.equal(a, b)
        assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
        cks.save(cw, 20, fresh, fresh_opt, iteration=1)  # the next save respawns the writer
        cks.finish()  # commits 20, stops the committer and the writer
        assert cks.ckpt is None
    finally:
        if cks.ckpt is not None:
            cks.ckpt.close(finalize=False)
        log.close()
    events = read_events(cfg.root / "events")[0]
    of = lambda kind: [e for e in events if e["ev"] == kind]
    assert [e["step"] for e in of("checkpoint_skip")] == [30]
    assert [e["step"] for e in of("checkpoint_save")] == [10, 20, 20]
    assert [(e["step"], e["iteration"]) for e in of("checkpoint")] == [(10, 0), (20, 1)]
    assert of("checkpoint_sync")[0]["ms"] > 0 and not (cfg.root / "sync_baseline.pt").exists()
    print("blocking ms:", [e["block_ms"] for e in of("checkpoint_save")],
          "sync ms:", of("checkpoint_sync")[0]["ms"],
          "commit ms:", [e["commit_ms"] for e in of("checkpoint")])
    steps = sorted(p.name for p in cfg.checkpoint_dir.iterdir() if p.name.startswith("step_"))
    assert (
        steps[-1] == "step_000000020"
        and (cfg.checkpoint_dir / steps[-1] / "manifest.json").exists()
    )
