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

# Rank assignment, health checks, RetryController and further hooks live in modules written
# alongside; export whatever they declare (the coordinator finalises this list).
def _export_all(module_name: str) -> None:
    import importlib

    try:
        module = importlib.import_module(f"trainguard.inprocess.{module_name}")
    except ImportError:
        return
    for name in getattr(module, "__all__", []):
        if name not in globals():
            globals()[name] = getattr(module, name)
            __all__.append(name)


for _module in ("rank_assignment", "health_check", "initialize", "finalize", "completion",
                "terminate", "abort"):
    _export_all(_module)
del _module
