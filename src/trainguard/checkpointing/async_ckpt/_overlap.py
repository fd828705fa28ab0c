"""Overlapped snapshots: stage in a background thread, fence optimizer steps until it is done.

``AsyncCheckpointer.save(..., overlap=True)`` returns before the large tensors are copied; the
copy runs in a named thread (``tg-ckpt-stage``) while the next forward and backward run: CPU
tensors as single-threaded ``memmove`` chunks of 4 MiB without the GIL (no OpenMP team next to
the trainer's), CUDA tensors on a side stream into pinned memory. A new staging arena is first
touched by this copy, so not even the first save blocks on page faults. A global optimizer step
pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) makes every
``optimizer.step()`` of the process wait for that copy, so the checkpoint is an exact snapshot of
the state at ``save``.

The hot path never waits for an earlier save: a save requested while the previous copy is still
running, or while no staging arena is free (earlier saves unwritten), is skipped on every rank
(``if_busy="skip"``, the default with ``overlap=True``; ``AsyncCheckpointer.saves_skipped``).
Measured on the 256 MiB training loop of ``bench/checkpoint.py``, that wait for the previous
save's write was what blocked (not the copy, nor the fence).

What it protects:
    * parameters and optimizer state changed by any ``torch.optim.Optimizer.step`` (of any
      optimizer in the process: the hook is global);
    * every non-tensor value (pickled before ``save`` returns) and every small tensor (at most
      ``SYNC_BYTES`` bytes each, copied before ``save`` returns): step counters, BatchNorm running
      statistics, a GradScaler's scale, learning rates.

What it cannot protect: a large tensor of the saved state changed in place outside an
optimizer step before the next step (e.g. an EMA copy updated by hand after ``save``, or
``param.data.mul_()`` in user code). Such code must call ``AsyncCheckpointer.wait_staged()``
first, or save without ``overlap``.

Follows: CheckFreq's snapshot()/persist() split and TorchTitan's "zero-overhead" checkpointing
(staging overlapped with forward/backward, fenced before the optimizer step).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from trainguard.checkpointing.errors import CheckpointTimeout

__all__ = ["SYNC_BYTES", "OverlapGuard"]

SYNC_BYTES = 64 * 1024
"""Tensors up to this size are staged before ``save(overlap=True)`` returns."""


class _Job:
    def __init__(self, copy: Callable[[], None], done: Callable[[BaseException | None], None],
                 step: int | None) -> None:
        self.copy, self.done, self.step = copy, done, step
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            self.copy()
        except BaseException as exc:  # noqa: BLE001 - reported as a failed save by the trainer
            self.error = exc
        finally:
            self.finished.set()


def _serve(jobs: queue.SimpleQueue) -> None:
    """The staging thread: run jobs until the ``None`` sentinel (holds no checkpointer ref)."""
    while (job := jobs.get()) is not None:
        job.run()


class OverlapGuard:
    """At most one background staging job, and the optimizer hook that waits for it.

    ``start`` runs in the trainer thread and hands the copy to one persistent, named staging
    thread (no thread start per save: on a loaded host that alone costs milliseconds); ``wait``
    runs in whichever thread calls it (the trainer's ``optimizer.step()`` through the hook, or
    the checkpointer's own calls) and then runs the job's ``done`` callback there, so only that
    thread talks to the writer.

    Args:
        timeout_s: longest ``wait`` blocks for a copy (a memcpy; exceeded only by a stuck device).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._job: _Job | None = None
        self._lock = threading.RLock()
        self._hook: Any = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.fenced_steps = 0  # optimizer steps that found the copy still running

    @property
    def pending(self) -> bool:
        return self._job is not None

    def start(self, copy: Callable[[], None], done: Callable[[BaseException | None], None],
              step: int | None) -> None:
        """Run ``copy`` in the staging thread; ``done(error)`` runs later in ``wait``'s thread.

        Call only when no job is pending (``wait`` first).
        """
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(_make_hook(weakref.ref(self)))
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=_serve, args=(self._jobs,),
                                            name="tg-ckpt-stage", daemon=True)
            self._thread.start()
        job = _Job(copy, done, step)
        self._job = job
        self._jobs.put(job)

    def wait(self, blocking: bool = True) -> None:
        """Finish the pending job (if any) and run its ``done`` callback in this thread.

        Non-blocking: returns at once when the copy is still running. Blocks up to
        ``timeout_s`` seconds.

        Raises:
            CheckpointTimeout: the copy did not finish within ``timeout_s``.
        """
        with self._lock:
            job = self._job
            if job is None or (not blocking and not job.finished.is_set()):
                return
            if not job.finished.wait(self.timeout_s):
                raise CheckpointTimeout(f"staging of checkpoint step {job.step} did not finish "
                                        f"within {self.timeout_s:.1f} s (write_timeout)")
            self._job = None
            job.done(job.error)

    def drop(self) -> None:
        """Abort path: let a running copy finish (bounded), never send it."""
        with self._lock:
            job, self._job = self._job, None
        if job is not None:
            job.finished.wait(self.timeout_s)

    def close(self) -> None:
        """Remove the optimizer hook and stop the staging thread (idempotent; joins it for at
        most 5 s); call after ``wait`` or ``drop``."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(5.0)
            self._thread = None


def _make_hook(ref: weakref.ref) -> Callable[..., None]:
    def tg_checkpoint_fence(optimizer: Any, args: Any, kwargs: Any) -> None:
        guard = ref()
        job = None if guard is None else guard._job
        if job is not None:
            if not job.finished.is_set():
                guard.fenced_steps += 1  # type: ignore[union-attr]
            guard.wait()  # type: ignore[union-attr]

    return tg_checkpoint_fence
