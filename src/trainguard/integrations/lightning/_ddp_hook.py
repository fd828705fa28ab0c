"""DDP communication hooks timed for the straggler detector.

DDP all-reduces gradient buckets in C++ inside ``backward``: a fast rank's wait for a slow one
would count as its own compute. Two hooks make that wait visible:

* :func:`overlapped_allreduce` (gloo, the default): keeps DDP's bucketed asynchronous
  all-reduce, so communication still overlaps the rest of ``backward``. Each bucket's future is
  chained with a timestamp; the *exposed* wait of a backward pass is the time from the last
  bucket's issue (this rank's backward compute is done) to the last completion (every peer's
  contribution arrived). :meth:`OverlapTimer.take_exposed_s` hands it to the caller, which adds
  it to the detector's collective wait.
* :func:`timed_allreduce` (other backends, when asked for): a blocking ``dist.all_reduce`` per
  bucket, looked up at call time so the detector's wrapper times it (with CUDA events for CUDA
  tensors). On NCCL a blocking call returns once the kernel is enqueued, so it costs no overlap.

No ``from __future__ import annotations`` here: DDP checks the hooks' annotations at run time
(``bucket`` must be ``dist.GradBucket``, the result ``torch.futures.Future[torch.Tensor]``).
"""

from time import perf_counter_ns

import torch
import torch.distributed as dist

__all__ = ["OverlapTimer", "overlapped_allreduce", "timed_allreduce"]


class OverlapTimer:
    """State of :func:`overlapped_allreduce` for one DDP model (its process group).

    ``issued_ns`` is written by the thread running ``backward`` (DDP calls the hook there),
    ``done_ns`` by the process group's completion thread; both are single int stores under the
    GIL. :meth:`take_exposed_s` is called after ``backward`` returned, when DDP has waited for
    every bucket's future (so every completion was stamped).
    """

    __slots__ = ("buckets", "done_ns", "group", "issued_ns", "world_size")

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world_size = group.size()
        self.issued_ns = 0
        self.done_ns = 0
        self.buckets = 0  # buckets issued since the last take (all passes)

    def take_exposed_s(self) -> float:
        """Seconds of all-reduce not hidden behind ``backward`` since the last call (>= 0; 0.0
        when no bucket was issued, e.g. under ``no_sync``); resets. Never blocks."""
        issued, done = self.issued_ns, self.done_ns
        self.issued_ns = self.done_ns = 0
        return (done - issued) / 1e9 if issued and done > issued else 0.0


def overlapped_allreduce(
    state: OverlapTimer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Asynchronous all-reduce (mean) of one gradient bucket, as DDP's default does, with the
    bucket's issue and completion stamped in ``state``.

    Runs on the thread that runs ``backward``; never blocks (DDP waits for the returned future
    at the end of ``backward``). Uses the process group's own ``allreduce`` (no c10d Python
    wrapper, so the detector does not time the issue as wait). Raises nothing itself; an
    all-reduce failure surfaces from ``backward`` through the future.

    Follows: torch ``ddp_comm_hooks.default_hooks.allreduce_hook`` (divide, then sum); the
    difference is the completion stamp.
    """
    buf = bucket.buffer()
    buf.div_(state.world_size)
    state.issued_ns = perf_counter_ns()
    state.buckets += 1
    fut = state.group.allreduce([buf]).get_future()

    def stamp(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.done_ns = max(state.done_ns, perf_counter_ns())
        return done.value()[0]

    return fut.then(stamp)


def timed_allreduce(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A blocking all-reduce (mean) of one gradient bucket through ``dist.all_reduce``.

    ``dist.all_reduce`` is looked up at call time, so the straggler detector's wrapper times the
    wait for the slowest rank as collective wait instead of this rank's compute. Runs on the
    thread that runs backward; blocks for the all-reduce (on gloo: gives up DDP's overlap of
    communication with backward, which is why gloo uses :func:`overlapped_allreduce`).
    """
    buf = bucket.buffer()
    dist.all_reduce(buf, group=group)
    buf.div_(dist.get_world_size(group))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
