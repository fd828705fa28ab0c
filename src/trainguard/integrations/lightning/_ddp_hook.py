"""Timing DDP's gradient all-reduce for the straggler detector.

DDP all-reduces gradient buckets in C++ inside ``backward``: a fast rank's wait for a slow one
would count as its own compute. Two ways make that wait visible:

* :class:`BackwardWaitTimer` (gloo, the default): registers no communication hook, so DDP keeps
  its own C++ bucketed asynchronous all-reduce (overlapped with the rest of ``backward``) and a
  user's own hook still works. A post-accumulate-grad hook on one parameter queues an autograd
  *final callback*; final callbacks run in the order they were queued once the graph is done,
  and DDP queues the one that waits for every bucket's all-reduce (``finalize_backward``) only
  when its last bucket is ready, from a hook that runs after ours even on the same parameter,
  so ours runs first: it stamps the end of this rank's gradient compute and queues a second
  callback, which runs after DDP's and stamps the end of the wait. The difference is the
  *exposed* all-reduce wait. Three Python calls per ``backward``, none in a Lightning hook.
* :func:`timed_allreduce` (other backends, when asked for): a blocking ``dist.all_reduce`` per
  bucket, looked up at call time so the detector's wrapper times it (with CUDA events for CUDA
  tensors). On NCCL a blocking call returns once the kernel is enqueued, so it costs no overlap.

Issue 11 measured the hook this timer replaces (DDP's asynchronous all-reduce re-issued from a
Python communication hook, each bucket's completion stamped by a Python ``Future.then``
callback on the process group's thread) at a median +18 % of a 10 ms Lightning step on gloo,
against ~0 % for the same callbacks without it (``bench/lightning_overhead.py``).

No ``from __future__ import annotations`` here: DDP checks the hooks' annotations at run time
(``bucket`` must be ``dist.GradBucket``, the result ``torch.futures.Future[torch.Tensor]``).
"""

from time import perf_counter_ns
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BackwardWaitTimer", "timed_allreduce"]


class BackwardWaitTimer:
    """The exposed part of DDP's gradient all-reduce in each ``backward`` (see module docstring).

    :meth:`attach` once to the DDP model; :meth:`take_exposed_s` on the training thread after
    ``backward`` (it sums every pass since the last call, e.g. several micro-batches);
    :meth:`detach` at the end. The span also holds the rest of DDP's end of ``backward``
    (copying reduced buckets into ``.grad``: microseconds). A ``backward`` in which the watched
    parameter (the model's last one that requires grad) gets no gradient is not measured.
    Never blocks; needs no process group.
    """

    __slots__ = ("_handle", "_start_ns", "exposed_ns", "passes")

    def __init__(self) -> None:
        self.exposed_ns = 0  # exposed wait summed since the last take
        self.passes = 0  # backward passes measured since construction
        self._start_ns = 0
        self._handle: Any = None

    def attach(self, model: torch.nn.Module) -> bool:
        """Watch ``model``'s last parameter that requires grad; False if it has none."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return False
        self.detach()
        self._handle = params[-1].register_post_accumulate_grad_hook(self._on_grad)
        return True

    def detach(self) -> None:
        """Remove the hook (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def _on_grad(self, param: torch.Tensor) -> None:
        # inside backward: a final callback queued now precedes DDP's (see module docstring)
        _queue_callback(self._compute_done)

    def _compute_done(self) -> None:
        self._start_ns = perf_counter_ns()
        _queue_callback(self._wait_done)  # after DDP's finalize_backward

    def _wait_done(self) -> None:
        self.exposed_ns += perf_counter_ns() - self._start_ns
        self.passes += 1

    def take_exposed_s(self) -> float:
        """Seconds of exposed all-reduce wait since the last call (>= 0); resets. Never
        blocks."""
        ns, self.exposed_ns = self.exposed_ns, 0
        return ns / 1e9


def _queue_callback(fn: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def timed_allreduce(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A blocking all-reduce (mean) of one gradient bucket through ``dist.all_reduce``.

    ``dist.all_reduce`` is looked up at call time, so the straggler detector's wrapper times the
    wait for the slowest rank as collective wait instead of this rank's compute. Runs on the
    thread that runs backward; blocks for the all-reduce (on gloo: gives up DDP's overlap of
    communication with backward, which is why gloo uses :class:`BackwardWaitTimer`).
    """
    buf = bucket.buffer()
    dist.all_reduce(buf, group=group)
    buf.div_(dist.get_world_size(group))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
