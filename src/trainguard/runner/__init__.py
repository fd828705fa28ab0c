"""Distributed inference runner: drive N rank processes as one model.

``DistributedRunner(worker_cls, world_size=N)`` spawns one process per rank (one per GPU, or CPU
ranks with Gloo), sends the same input to every rank and returns rank 0's result; every failure
has one documented outcome (see :class:`DistributedRunner`).

Follows: reactor-runtime ``distributed`` (names and error semantics).
"""

from trainguard.runner._runner import DistributedRunner
from trainguard.runner.errors import (
    RankDesync,
    RunnerError,
    SharedSlotAllocationFailed,
    WorkerCrashed,
    WorkerTimeout,
)
from trainguard.runner.worker import DistributedWorker

__all__ = [
    "DistributedRunner",
    "DistributedWorker",
    "RankDesync",
    "RunnerError",
    "SharedSlotAllocationFailed",
    "WorkerCrashed",
    "WorkerTimeout",
]
