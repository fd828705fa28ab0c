"""In-process restart: restart a distributed training function inside the same processes.

Public API: :class:`Wrapper` (decorator), :class:`CallWrapper` (injected handle),
:class:`State`/:class:`FrozenState`/:class:`Mode`, hook bases, :class:`Compose`, the exception
hierarchy, and (when present) rank-assignment classes and health checks.

Follows: NVRx ``nvidia_resiliency_ext.inprocess``.
"""

# NVRx module paths (``inprocess.exception``, ``inprocess.store`` ...), bound as attributes so
# ``inprocess.<module>.<name>`` works after ``import trainguard.inprocess as inprocess``.
from trainguard.inprocess import (
    abort as abort,
)
from trainguard.inprocess import (
    completion as completion,
)
from trainguard.inprocess import (
    compose as compose,
)
from trainguard.inprocess import (
    exception as exception,
)
from trainguard.inprocess import (
    finalize as finalize,
)
from trainguard.inprocess import (
    health_check as health_check,
)
from trainguard.inprocess import (
    initialize as initialize,
)
from trainguard.inprocess import (
    monitor_thread as monitor_thread,
)
from trainguard.inprocess import (
    nested_restarter as nested_restarter,
)
from trainguard.inprocess import (
    progress_watchdog as progress_watchdog,
)
from trainguard.inprocess import (
    rank_assignment as rank_assignment,
)
from trainguard.inprocess import (
    state as state,
)
from trainguard.inprocess import (
    store as store,
)
from trainguard.inprocess import (
    terminate as terminate,
)
from trainguard.inprocess import (
    wrap as wrap,
)
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
