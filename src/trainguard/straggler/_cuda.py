"""Collective time on the GPU with CUDA events (the path for tensors on a CUDA device).

On NCCL a blocking collective returns once its kernel is enqueued, so host-side timing (what
``_collectives`` does for gloo) sees almost nothing. For a CUDA tensor the wrapper instead records
one event on the current stream before the call and one after it; a blocking collective makes the
current stream wait for NCCL's stream, so the pair spans "this rank's stream reached the
collective" to "the collective finished": the wait for the other ranks plus the transfer.

Events are resolved without synchronising: :meth:`CudaEventTimer.resolve` (called at each step
mark) adds the elapsed time of every pair whose end event has completed and keeps the others for a
later step. A collective's time is therefore counted at the first step mark after the GPU
finished it (at most a step or so late), and sections measure host time only on CUDA.

Chosen per call by the device of the collective's first tensor; never built without CUDA.
"""

from __future__ import annotations

from typing import Any

from trainguard.straggler.errors import StragglerConfigError

__all__ = ["CudaEventTimer", "on_cuda"]

_MAX_PENDING = 4096  # unresolved pairs kept; more means the GPU is far behind (dropped, counted)


def on_cuda(args: tuple[Any, ...]) -> bool:
    """True when the first positional argument (a tensor or a list of tensors) is on CUDA."""
    if not args:
        return False
    first = args[0]
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return bool(getattr(first, "is_cuda", False))


class CudaEventTimer:
    """Pairs of CUDA timing events around collectives, resolved lazily (see module docstring).

    Raises (constructor):
        StragglerConfigError: CUDA is not available in this process.
    """

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise StragglerConfigError("CUDA event timing needs a CUDA device; on CPU collectives "
                                       "are timed on the host (the default)")
        self._event = torch.cuda.Event
        self.pending: list[tuple[Any, Any]] = []
        self.dropped = 0

    def begin(self) -> Any:
        """Record and return the start event on the current stream (non-blocking)."""
        ev = self._event(enable_timing=True)
        ev.record()
        return ev

    def end(self, start: Any) -> None:
        """Record the end event on the current stream and queue the pair (non-blocking)."""
        ev = self._event(enable_timing=True)
        ev.record()
        if len(self.pending) >= _MAX_PENDING:
            self.pending.pop(0)
            self.dropped += 1
        self.pending.append((start, ev))

    def resolve(self) -> int:
        """Nanoseconds of every queued pair that completed (removed); never synchronises."""
        done_ns, keep = 0, []
        for start, end in self.pending:
            if end.query():
                done_ns += int(start.elapsed_time(end) * 1e6)  # elapsed_time is in ms
            else:
                keep.append((start, end))
        self.pending = keep
        return done_ns
