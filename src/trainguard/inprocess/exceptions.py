"""Exceptions of in-process restart.

::

    TrainguardError
     └── RestartError                    an Exception: leads to a restart where raised in fn/hooks
          ├── HealthCheckError           a health check failed (raised by hooks / the loop)
          ├── InternalError              trainguard bug or inconsistent state
          ├── RestartTimeout (+TrainguardTimeout, TimeoutError)  the restart interrupt did
          │                              not arrive in time after a fault was recorded
          ├── BarrierError
          │    ├── BarrierTimeout (+TrainguardTimeout, TimeoutError)
          │    └── BarrierOverflow
          ├── RankDiscarded              this rank was removed by rank assignment
          └── FaultCounterExceeded       FaultCounter limit passed
    BaseException
     ├── RestartAbort                    terminal: stop restarting (e.g. RetryController)
     └── RankShouldRestart               asynchronous interrupt raised into the main thread

Rule (as NVRx): an ``Exception`` from the wrapped function restarts every rank; a
``BaseException`` takes the raising rank out and the survivors continue.
"""

from __future__ import annotations

from trainguard._core.store import StoreBarrierOverflow, StoreBarrierTimeout
from trainguard.errors import TrainguardError, TrainguardTimeout

__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FaultCounterExceeded",
    "HealthCheckError",
    "InternalError",
    "RankDiscarded",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RestartTimeout",
]


class RestartError(TrainguardError):
    """Base of in-process restart errors."""


class HealthCheckError(RestartError):
    """A health check reported this rank unhealthy."""


class InternalError(RestartError):
    """Inconsistent state inside the restart machinery."""


class RestartTimeout(RestartError, TrainguardTimeout):
    """A fault was recorded but the restart interrupt did not reach this rank in time.

    Raised by the restart loop after ``last_call_wait + soft_timeout + 2 x
    monitor_thread_interval`` seconds (typically a custom abort hook blocking the monitor
    thread); it ends the call on that rank.
    """


class BarrierError(RestartError):
    """A store barrier failed."""


class BarrierTimeout(BarrierError, StoreBarrierTimeout):
    """A store barrier did not complete in time; the message names the missing ranks."""


class BarrierOverflow(BarrierError, StoreBarrierOverflow):
    """More arrivals than expected at a store barrier."""


class RankDiscarded(RestartError):
    """Rank assignment removed this rank."""


class FaultCounterExceeded(RestartError):
    """This rank faulted more often than ``FaultCounter(max_rank_faults)`` allows."""


class RestartAbort(BaseException):
    """Terminal: stop restarting; the raising rank exits (raise from any hook to give up)."""


class RankShouldRestart(BaseException):
    """Raised asynchronously into the main thread to interrupt ``fn`` and restart.

    Wrapped code that catches ``BaseException`` must re-raise it.
    """
