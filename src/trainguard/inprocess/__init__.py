"""In-process restart: restart a distributed training function inside the same processes.

Public API: :class:`Wrapper` (decorator), :class:`CallWrapper` (injected handle),
:class:`State`/:class:`FrozenState`/:class:`Mode`, hook bases, :class:`Compose`, the exception
hierarchy, and (when present) rank-assignment classes and health checks.

Follows: NVRx ``nvidia_resiliency_ext.inprocess``.
"""

from trainguard.inprocess.abort import Abort, AbortTorchDistributed
from trainguard.inprocess.completion import Completion
from trainguard.inprocess.compose import Compose
from trainguard.inprocess.exceptions import (
    BarrierError,
    BarrierOverflow,
    BarrierTimeout,
    FaultCounterExceeded,
    HealthCheckError,
    InternalError,
    RankDiscarded,
    RankShouldRestart,
    RestartAbort,
    RestartError,
    RestartTimeout,
)
from trainguard.inprocess.finalize import Finalize
from trainguard.inprocess.health_check import HealthCheck
from trainguard.inprocess.initialize import Initialize
from trainguard.inprocess.state import FrozenState, Mode, State
from trainguard.inprocess.terminate import Terminate
from trainguard.inprocess.wrap import CallWrapper, RestartRecord, Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "CallWrapper",
    "Completion",
    "Compose",
    "FaultCounterExceeded",
    "Finalize",
    "FrozenState",
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "InternalError",
    "Mode",
    "RankDiscarded",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RestartRecord",
    "RestartTimeout",
    "State",
    "Terminate",
    "Wrapper",
]

# Rank assignment, health checks and RetryController live in modules written alongside; export
# them when present (the coordinator finalises this list).
try:
    from trainguard.inprocess import rank_assignment as _ra

    for _name in getattr(_ra, "__all__", []):
        globals()[_name] = getattr(_ra, _name)
        __all__.append(_name)
except ImportError:
    pass
try:
    from trainguard.inprocess import health_check as _hc

    for _name in getattr(_hc, "__all__", []):
        if _name not in globals():
            globals()[_name] = getattr(_hc, _name)
            __all__.append(_name)
except ImportError:
    pass
