"""Time blocking ``torch.distributed`` collectives by wrapping the module's functions.

Choice (measured in ``bench/straggler.py``, see BENCHMARKS.md): wrapping the Python collective
functions costs two clock reads per call and works on every backend, including gloo, where
torch offers no completion hook (``ProcessGroup`` work hooks are NCCL-only) and the flight
recorder only stamps ``time_created_ns`` (2-10 µs per record on gloo). Limits, stated:

* only calls made through ``torch.distributed.<name>`` or ``distributed_c10d.<name>`` after
  :func:`install` are timed (``from torch.distributed import all_reduce`` done earlier is not);
* with ``async_op=True`` only the issue is timed, not the later ``work.wait()``; DDP's bucketed
  gradient all-reduce runs in C++ and is therefore counted as compute;
* on NCCL a blocking call returns once the kernel is enqueued, so host-side wait is near zero:
  for a collective whose first tensor is on CUDA the time comes from CUDA events instead
  (``_cuda``: resolved lazily at step marks, never synchronising), chosen per call.

Nested collectives (``all_gather_object`` calling ``all_gather``) are counted once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainguard.straggler._cuda import CudaEventTimer, on_cuda
from trainguard.straggler._recorder import Recorder

__all__ = ["COLLECTIVES", "install", "uninstall"]

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "monitored_barrier", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
)

_saved: list[tuple[Any, str, Any]] = []


def _wrap(rec: Recorder, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if rec.in_collective:
            return fn(*args, **kwargs)
        rec.in_collective = True
        cuda = rec.cuda if rec.cuda is not None and on_cuda(args) else None
        start = cuda.begin() if cuda is not None else None
        t0 = perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            if cuda is not None:
                cuda.end(start)  # its GPU time is added when the events complete
            else:
                rec.coll_ns += perf_counter_ns() - t0
            rec.in_collective = False

    timed.__trainguard_straggler__ = True  # type: ignore[attr-defined]
    return timed


def install(rec: Recorder) -> list[str]:
    """Wrap the collectives so their time adds to ``rec.coll_ns``; returns the wrapped names.

    Called from the training thread by ``Detector.initialize``; undone by :func:`uninstall`.
    """
    if _saved:
        uninstall()
    rec.cuda = _cuda_timer()
    names = []
    for name in COLLECTIVES:
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        timed = _wrap(rec, orig)
        for module in (dist, c10d):
            if getattr(module, name, None) is orig:
                _saved.append((module, name, orig))
                setattr(module, name, timed)
        names.append(name)
    return names


def _cuda_timer() -> CudaEventTimer | None:
    """A CUDA event timer when this process can use CUDA, else None (host timing only)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return CudaEventTimer()


def uninstall() -> None:
    """Restore the original functions (idempotent)."""
    while _saved:
        module, name, orig = _saved.pop()
        setattr(module, name, orig)
