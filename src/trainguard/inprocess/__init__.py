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
from trainguard.inprocess.health_check import (
    CudaHealthCheck,
    FaultCounter,
    HealthCheck,
    NicHealthCheck,
    default_health_check,
)
from trainguard.inprocess.initialize import Initialize, RetryController
from trainguard.inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankFilter,
    ShiftRanks,
    Tree,
    TreeEntry,
    default_rank_assignment,
)
from trainguard.inprocess.state import FrozenState, Mode, State
from trainguard.inprocess.terminate import Terminate
from trainguard.inprocess.wrap import CallWrapper, RestartRecord, Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "CallWrapper",
    "Completion",
    "Compose",
    "CudaHealthCheck",
    "FaultCounter",
    "FaultCounterExceeded",
    "FillGaps",
    "FilterCountGroupedByKey",
    "Finalize",
    "FrozenState",
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "InternalError",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "Mode",
    "NicHealthCheck",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RestartRecord",
    "RestartTimeout",
    "RetryController",
    "ShiftRanks",
    "State",
    "Terminate",
    "Tree",
    "TreeEntry",
    "Wrapper",
    "default_health_check",
    "default_rank_assignment",
]
