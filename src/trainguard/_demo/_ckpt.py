"""The demo's asynchronous checkpoints, through :class:`trainguard.checkpointing.AsyncCheckpointer`.

One checkpointer per rank process, made when the process starts (reserve ranks too) and kept
across in-process restarts, so its writer process is warm when needed: a fresh writer imports
torch, seconds on a busy machine, longer than the demo runs between faults. The restart's reset
callback (run by the wrapper's abort) drops the aborted iteration's saves and kills a writer that
was busy; each iteration re-binds the checkpointer to its new process group (rank and world size
change when a reserve rank takes over) and reloads the newest checkpoint committed on every rank.
A save costs the training loop the state-dict build plus a memcpy into a reused staging buffer;
the write and fsync happen in the writer process and the collective commit (manifest written
last) in a thread, so a fault never leaves a torn or half-committed "latest". A save is skipped
while the previous one is not committed yet, so a slow writer never blocks training.
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainguard._demo._config import DemoConfig
from trainguard._demo._events import EventLog
from trainguard.checkpointing import (
    AsyncCheckpointer,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)

__all__ = [
    "CHECKPOINT_FORMAT", "DemoCheckpoints", "apply_state", "checkpoint_state", "load_checkpoint",
    "save_checkpoint", "sync_save_ms",
]

CHECKPOINT_FORMAT = "torch"  # one file per rank; the DDP replicas are identical
SYNC_SAMPLES = 5  # synchronous saves timed once per run (rank 0, first checkpoint) for comparison


def checkpoint_state(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What a checkpoint holds: step, model and optimizer state (live tensors, not copies)."""
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def apply_state(state: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a :func:`checkpoint_state` dict into ``model``/``optimizer``; returns its step."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_checkpoint(
    path: os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """The demo's former synchronous save: temp file in the same directory, fsync, rename.

    A reader sees the previous file or the new one, never a torn one, but training waits for
    the whole write; kept as the baseline the asynchronous save is measured against.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(checkpoint_state(step, model, optimizer), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # e.g. ENOSPC: leave no torn temp file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_checkpoint(path: os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a :func:`save_checkpoint` file into ``model``/``optimizer``; its step (0 if none)."""
    if not os.path.exists(path):
        return 0
    return apply_state(torch.load(path, map_location="cpu", weights_only=True), model, optimizer)


def sync_save_ms(
    path: os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: int = SYNC_SAMPLES,
) -> tuple[float, float]:
    """Median and minimum milliseconds of the old synchronous save (``torch.save`` + fsync +
    rename) of the same state to ``path`` (removed afterwards): what each checkpoint used to
    block training."""
    times = []
    try:
        for _ in range(samples):
            t0 = time.perf_counter()
            save_checkpoint(path, step, model, optimizer)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return statistics.median(times), min(times)


class DemoCheckpoints:
    """Per-process checkpoint state of one demo rank (lives in ``Trainer``, survives restarts).

    The training loop only stages (``save``); a committer thread per iteration runs the
    collective finalize (all-gather of the ranks' records, manifest + fsync, pruning) on the
    checkpointer's own process group, off the loop. One save is in flight at a time: the next
    one is skipped, by all ranks alike, until it is committed; a scalar all-reduce started one
    step ahead (:meth:`prepare`) decides, so the loop does not wait for it.

    Args:
        config: run configuration (checkpoint directory, timeouts).
        log: the rank's event log (``checkpoint_save``/``checkpoint_skip`` per save,
            ``checkpoint`` per commit on active rank 0, ``checkpoint_sync`` once).
    """

    def __init__(self, config: DemoConfig, log: EventLog) -> None:
        self.config, self.log = config, log
        self.ckpt: AsyncCheckpointer | None = None
        self.rank, self.step = 0, 0  # active rank; the loop's current step (for commit lag)
        self.measured_sync = False
        self.jobs: queue.Queue = queue.Queue()
        self.committer: threading.Thread | None = None
        self.busy = threading.Event()  # a save is staged and not committed (or failed) yet
        self.timeout_s = max(60.0, config.hard_timeout_s + 10.0)
        self.vote: tuple[torch.Tensor, Any] | None = None  # the pending skip vote (flag, work)

    def _make(self, use_dist: bool) -> AsyncCheckpointer:
        return AsyncCheckpointer(
            self.config.checkpoint_dir,
            format=CHECKPOINT_FORMAT,
            keep_last=2,
            write_timeout=self.timeout_s,
            collective_timeout=self.timeout_s,
            on_error="log",
            keep_idle_writer=True,
            use_dist=use_dist,
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
        with contextlib.suppress(FileNotFoundError):  # not written: the report lists the failure
            os.unlink(path)
        seconds = time.perf_counter() - t0
        self.log.emit("checkpoint_writer_ready", seconds=round(seconds, 3))
        return seconds

    def begin(self, call_wrapper: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Bind to this iteration's process group and load the newest committed checkpoint.

        Collective (every active rank). Returns the step loaded (0 when none).

        Raises:
            RuntimeError: the previous iteration's committer did not stop (the restart's abort
                should have broken its collective); the wrapper restarts again.
        """
        self._stop_committer(5.0)  # the restart's abort ended its wait already
        self.rank, self.step, self.vote = dist.get_rank(), 0, None
        self.busy.clear()
        # Groups made inside are tracked, so the wrapper's abort can break a blocked collective.
        with call_wrapper.tracking_process_group():
            if self.ckpt is None:  # finish() closed it and this rank is needed again
                self.ckpt = self._make(use_dist=True)
            else:
                self.ckpt.rebind()  # this iteration's group, rank and world size
            step = self._load(model, optimizer)
        self.committer = threading.Thread(
            target=self._commit_loop, args=(self.ckpt,), name="demo-checkpoint-commit", daemon=True
        )
        self.committer.start()
        return step

    def _checkpointer(self) -> AsyncCheckpointer:
        if self.ckpt is None:
            raise RuntimeError("DemoCheckpoints.begin() must run first in each iteration")
        return self.ckpt

    def _load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        ckpt = self._checkpointer()
        try:
            state, _ = ckpt.load(weights_only=True)
        except (CheckpointNotFoundError, CheckpointMismatchError):
            # None, or only shards of another world size (a rank left and no reserve was
            # left to replace it): the state is replicated, so rank 0's shard serves everyone.
            try:
                state, _ = ckpt.manager.load(rank=0)  # type: ignore[union-attr]
            except CheckpointNotFoundError:
                return 0
        return apply_state(state, model, optimizer)

    def prepare(self) -> None:
        """One step before a save (all active ranks): start the all-reduce that decides whether
        it is skipped (is any rank's previous save still uncommitted?) in the background."""
        flag = torch.tensor([1 if self.busy.is_set() else 0], dtype=torch.int32)
        self.vote = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))

    def _skip(self) -> bool:
        if self.vote is None:  # no prepare() in this iteration yet: vote now
            self.prepare()
        flag, work = self.vote  # type: ignore[misc]
        self.vote = None
        work.wait()
        return bool(flag.item())

    def save(
        self,
        call_wrapper: Any,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        iteration: int,
    ) -> None:
        """Stage checkpoint ``step`` (collective: all active ranks); blocks for the state-dict
        and the memcpy. Skipped (``checkpoint_skip``) while the previous one is in flight, except
        the last step's save, which waits for it: the final state is always checkpointed."""
        ckpt = self._checkpointer()
        t0 = time.perf_counter()
        skip = self._skip()  # every rank skips or saves alike
        vote_s = time.perf_counter() - t0
        if skip and step == self.config.steps:  # the final state is never skipped: wait
            self._wait_committed(call_wrapper)
        elif skip:
            self.log.emit("checkpoint_skip", step=step, iteration=iteration)
            return
        if self.rank == 0 and not self.measured_sync:  # once, outside the timed part
            self.measured_sync = True
            try:
                ms, low = sync_save_ms(
                    self.config.root / "sync_baseline.pt", step, model, optimizer
                )
            except OSError as exc:  # a full or read-only disk: a measurement, not a fault
                self.log.emit(
                    "checkpoint_sync_failed", step=step, error=f"{type(exc).__name__}: {exc}"[:300]
                )
            else:
                self.log.emit(
                    "checkpoint_sync",
                    step=step,
                    ms=round(ms, 3),
                    min_ms=round(low, 3),
                    samples=SYNC_SAMPLES,
                )
        # the save's own blocking only: the skip vote above (an all-reduce that waits for the
        # slowest rank) is logged apart as ``vote_ms``, as the synchronous baseline has none
        t0 = time.perf_counter()
        with call_wrapper.atomic():  # the abort never sees a half-submitted save
            req = ckpt.save(checkpoint_state(step, model, optimizer), step)
        block_s = time.perf_counter() - t0
        self.busy.set()
        self.jobs.put((req, block_s, iteration))
        self.log.emit(
            "checkpoint_save",
            step=step,
            iteration=iteration,
            format=CHECKPOINT_FORMAT,
            block_ms=round(block_s * 1e3, 3),
            stage_ms=round(req.stage_s * 1e3, 3),
            vote_ms=round(vote_s * 1e3, 3),
        )

    def _wait_committed(self, call_wrapper: Any) -> None:
        """Wait (pinging the wrapper) until this rank's save in flight is committed or failed.

        Raises:
            TimeoutError: not within the checkpointer's timeout (the wrapper restarts).
        """
        deadline = time.monotonic() + self.timeout_s
        while self.busy.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint in flight not committed within {self.timeout_s} s")
            call_wrapper.ping()
            time.sleep(0.01)

    def _commit_loop(self, ckpt: AsyncCheckpointer) -> None:
        """Committer thread: finalize each staged save (collective, blocking), in order."""
        while (job := self.jobs.get()) is not None:
            req, block_s, iteration = job
            failed, t0 = ckpt.failed_saves, time.perf_counter()
            try:
                done = ckpt.maybe_finalize(blocking=True)
            except Exception as exc:  # noqa: BLE001 - an abort broke the collective, or a timeout
                self.log.emit(
                    "checkpoint_error",
                    step=req.step,
                    iteration=iteration,
                    error=f"{type(exc).__name__}: {exc}"[:300],
                )
                done = []
            commit_ms = (time.perf_counter() - t0) * 1e3
            if ckpt.failed_saves > failed:  # the write or the commit failed (e.g. ENOSPC)
                error = req.record.get("error") if isinstance(req.record, dict) else None
                self.log.emit(
                    "checkpoint_failed",
                    step=req.step,
                    iteration=iteration,
                    error=str(error or "see the rank's log")[:300],
                )
            if req.step in done and self.rank == 0:
                self.log.emit(
                    "checkpoint",
                    step=req.step,
                    iteration=iteration,
                    committed_at=self.step,
                    block_ms=round(block_s * 1e3, 3),
                    commit_ms=round(commit_ms, 3),
                    durable_ms=round((req.durable_s or 0.0) * 1e3, 3),
                )
            self.busy.clear()

    def _stop_committer(self, timeout_s: float) -> None:
        thread, self.committer = self.committer, None
        if thread is None:
            return
        self.jobs.put(None)
        thread.join(timeout_s)
        if thread.is_alive():
            raise RuntimeError(f"checkpoint committer did not stop within {timeout_s:.0f} s")
        self.jobs = queue.Queue()  # drop what an aborted iteration left

    def finish(self) -> None:
        """End of training: commit what is pending, stop the writer (it is not needed again)."""
        try:
            self._stop_committer(2 * self.timeout_s)
        finally:
            if self.ckpt is not None:
                self.ckpt.close(finalize=False)
                self.ckpt = None
