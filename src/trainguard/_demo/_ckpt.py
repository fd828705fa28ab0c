"""The demo's asynchronous checkpoints, through :class:`trainguard.checkpointing.AsyncCheckpointer`.

One checkpointer per rank process, made when the process starts (reserve ranks too) and kept
across in-process restarts, so its writer process is warm when needed: a fresh writer imports
torch, seconds on a busy machine, longer than the demo runs between faults. The restart's reset
callback (run by the wrapper's abort) drops the aborted iteration's saves and kills a writer that
was busy; each iteration re-binds the checkpointer to its new process group (rank and world size
change when a reserve rank takes over) and reloads the newest checkpoint committed on every rank.
A save is skipped while the previous one is not committed yet, so a slow writer never blocks
training (the skip is agreed: commits are collective). A save costs the training loop the state-dict build
plus a memcpy into a reused staging buffer; the write, fsync and collective commit happen later,
so a fault can never leave a torn or half-committed "latest" (the manifest is written last).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from trainguard._demo._config import DemoConfig
from trainguard._demo._events import EventLog
from trainguard.checkpointing import AsyncCheckpointer, CheckpointNotFoundError, SaveRequest

__all__ = [
    "CHECKPOINT_FORMAT", "DemoCheckpoints", "apply_state", "checkpoint_state", "load_checkpoint",
    "save_checkpoint", "sync_save_ms",
]

CHECKPOINT_FORMAT = "torch"  # one file per rank; the DDP replicas are identical
SYNC_SAMPLES = 3  # synchronous saves timed once per run (rank 0, first checkpoint) for comparison


def checkpoint_state(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What a checkpoint holds: step, model and optimizer state (live tensors, not copies)."""
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def apply_state(state: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a :func:`checkpoint_state` dict into ``model``/``optimizer``; returns its step."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_checkpoint(path: os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The demo's former synchronous save: temp file in the same directory, fsync, rename.

    A reader sees the previous file or the new one, never a torn one, but training waits for
    the whole write; kept as the baseline the asynchronous save is measured against.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(checkpoint_state(step, model, optimizer), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a :func:`save_checkpoint` file into ``model``/``optimizer``; its step (0 if none)."""
    if not os.path.exists(path):
        return 0
    return apply_state(torch.load(path, map_location="cpu", weights_only=True), model, optimizer)


def sync_save_ms(path: os.PathLike, step: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, samples: int = SYNC_SAMPLES) -> float:
    """Median milliseconds of the old synchronous save (``torch.save`` + fsync + rename) of the
    same state to ``path`` (removed afterwards): what each checkpoint used to block training."""
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        save_checkpoint(path, step, model, optimizer)
        times.append((time.perf_counter() - t0) * 1e3)
    os.unlink(path)
    return statistics.median(times)


class DemoCheckpoints:
    """Per-process checkpoint state of one demo rank (lives in ``Trainer``, survives restarts).

    Args:
        config: run configuration (checkpoint directory, timeouts).
        log: the rank's event log (``checkpoint_save`` per save, ``checkpoint`` per commit on
            active rank 0, ``checkpoint_sync`` once).
    """

    def __init__(self, config: DemoConfig, log: EventLog) -> None:
        self.config, self.log = config, log
        self.ckpt: AsyncCheckpointer | None = None
        self.pending: dict[int, tuple[SaveRequest, float]] = {}
        self.rank = 0
        self.measured_sync = False

    def _make(self, use_dist: bool) -> AsyncCheckpointer:
        timeout = max(60.0, self.config.hard_timeout_s + 10.0)
        return AsyncCheckpointer(
            self.config.checkpoint_dir, format=CHECKPOINT_FORMAT, keep_last=2,
            write_timeout=timeout, collective_timeout=timeout, on_error="log",
            keep_idle_writer=True, use_dist=use_dist,
        )

    def warm_up(self, rank: int) -> float:
        """At process start, before any process group: start the writer and round-trip one tiny
        file through it, so later saves (and restarts) never wait for a writer to start.

        Returns the seconds it took.
        """
        t0 = time.perf_counter()
        self.ckpt = self._make(use_dist=False)
        path = self.config.checkpoint_dir / f"warmup_rank{rank}.pt"
        self.ckpt.async_save({"rank": rank, "probe": torch.zeros(4)}, str(path))
        self.ckpt.wait()
        os.unlink(path)
        seconds = time.perf_counter() - t0
        self.log.emit("checkpoint_writer_ready", seconds=round(seconds, 3))
        return seconds

    def begin(self, call_wrapper: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Bind to this iteration's process group and load the newest committed checkpoint.

        Collective (every active rank). Returns the step loaded (0 when none).
        """
        import torch.distributed as dist

        self.rank, self.pending = dist.get_rank(), {}
        # Groups made inside are tracked, so the wrapper's abort can break a blocked collective.
        with call_wrapper.tracking_process_group():
            if self.ckpt is None:  # finish() closed it and this rank is needed again
                self.ckpt = self._make(use_dist=True)
            else:
                self.ckpt.rebind()  # this iteration's group, rank and world size
            return self._load(model, optimizer)

    def _checkpointer(self) -> AsyncCheckpointer:
        if self.ckpt is None:
            raise RuntimeError("DemoCheckpoints.begin() must run first in each iteration")
        return self.ckpt

    def _load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        ckpt = self._checkpointer()
        try:
            state, _ = ckpt.load(weights_only=True)
        except CheckpointNotFoundError:
            # None, or only shards of another world size (a rank left and no reserve was
            # left to replace it): the state is replicated, so rank 0's shard serves everyone.
            try:
                state, _ = ckpt.manager.load(rank=0)  # type: ignore[union-attr]
            except CheckpointNotFoundError:
                return 0
        return apply_state(state, model, optimizer)

    def save(self, call_wrapper: Any, step: int, model: nn.Module,
             optimizer: torch.optim.Optimizer, iteration: int) -> None:
        """Stage checkpoint ``step`` (all active ranks); blocks only for the memcpy.

        Skipped (``checkpoint_skip`` event) while the previous save is not committed.
        """
        ckpt = self._checkpointer()
        if ckpt.num_unfinalized:
            self.log.emit("checkpoint_skip", step=step, iteration=iteration,
                          pending=sorted(self.pending))
            return
        if self.rank == 0 and not self.measured_sync:
            self.measured_sync = True
            ms = sync_save_ms(self.config.root / "sync_baseline.pt", step, model, optimizer)
            self.log.emit("checkpoint_sync", step=step, ms=round(ms, 3), samples=SYNC_SAMPLES)
        t0 = time.perf_counter()
        with call_wrapper.atomic():  # the abort never sees a half-submitted save
            req = ckpt.save(checkpoint_state(step, model, optimizer), step)
        block_s = time.perf_counter() - t0
        self.pending[step] = (req, block_s)
        self.log.emit("checkpoint_save", step=step, iteration=iteration, format=CHECKPOINT_FORMAT,
                      block_ms=round(block_s * 1e3, 3), stage_ms=round(req.stage_s * 1e3, 3))

    def poll(self, step: int, iteration: int, blocking: bool = False) -> None:
        """Commit the saves every rank has written (one small all-reduce while any is pending)."""
        if self.ckpt is None or not self.ckpt.num_unfinalized:
            return
        t0 = time.perf_counter()
        done = self.ckpt.maybe_finalize(blocking=blocking)
        poll_ms = (time.perf_counter() - t0) * 1e3
        for saved in done:
            req, block_s = self.pending.pop(saved, (None, 0.0))  # type: ignore[arg-type]
            if self.rank == 0 and req is not None:
                self.log.emit("checkpoint", step=saved, iteration=iteration, committed_at=step,
                              block_ms=round(block_s * 1e3, 3), poll_ms=round(poll_ms, 3),
                              durable_ms=round((req.durable_s or 0.0) * 1e3, 3))

    def finish(self, step: int, iteration: int) -> None:
        """End of training: commit what is pending, stop the writer (it is not needed again)."""
        if self.ckpt is None:
            return
        try:
            self.poll(step, iteration, blocking=True)
        finally:
            self.ckpt.close(finalize=False)
            self.ckpt = None
