"""Errors of the distributed inference runner.

::

    TrainguardError
     └── RunnerError
          ├── RankDesync (+ RuntimeError)              ranks disagreed: runner unusable
          ├── WorkerCrashed (+ RuntimeError)           a rank died without answering: unusable
          ├── WorkerTimeout (+ TrainguardTimeout)      a TimeoutError: unusable
          └── SharedSlotAllocationFailed (+ MemoryError)  raised inside the call; runner stays
                                                          usable

A worker's own exception is re-raised unchanged when every rank raised the same type; it is not
wrapped in any of these.

Follows: reactor-runtime ``distributed`` error names and bases.
"""

from __future__ import annotations

from trainguard.errors import TrainguardError, TrainguardTimeout

__all__ = [
    "RankDesync",
    "RunnerError",
    "SharedSlotAllocationFailed",
    "WorkerCrashed",
    "WorkerTimeout",
]


class RunnerError(TrainguardError):
    """Base of every error the runner itself raises."""


class RankDesync(RunnerError, RuntimeError):
    """Ranks disagreed: some succeeded and others raised, or they raised different types.

    ``__cause__`` is the first failing rank's exception. Attributes: ``rank`` (first failing rank),
    ``outcomes`` (rank -> short description).
    """

    def __init__(self, message: str, rank: int = -1, outcomes: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.outcomes = dict(outcomes or {})


class WorkerCrashed(RunnerError, RuntimeError):
    """A rank process died before answering. Attributes: ``rank``, ``pid``, ``exitcode``
    (negative: killed by signal ``-exitcode``)."""

    def __init__(self, message: str, rank: int = -1, pid: int | None = None,
                 exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.pid, self.exitcode = rank, pid, exitcode


class WorkerTimeout(RunnerError, TrainguardTimeout):
    """Not every rank answered within the limit. Attributes: ``ranks`` (those that did not),
    ``timeout_s`` (the limit, seconds)."""

    def __init__(self, message: str, ranks: list[int] | None = None, timeout_s: float = 0.0):
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.timeout_s = timeout_s


class SharedSlotAllocationFailed(RunnerError, MemoryError):
    """A shared-memory block could not be reserved (never a SIGBUS).

    Attributes: ``requested_bytes``, ``free_bytes``, ``total_bytes`` of ``/dev/shm`` (-1 when
    unknown). The message says how to make room.
    """

    def __init__(self, message: str, requested_bytes: int = 0, free_bytes: int = -1,
                 total_bytes: int = -1):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.free_bytes, self.total_bytes = free_bytes, total_bytes
