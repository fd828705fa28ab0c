"""Launcher-level fault tolerance: ``trainguard launch`` and rank monitoring.

* ``trainguard launch`` (:mod:`trainguard.fault_tolerance.launcher`): torchrun-compatible,
  hang detection on by default, in-job restart of every worker from a torch-preloaded fork server.
* :class:`RankMonitorClient`: heartbeats, sections and progress through shared memory (< 1 µs).
* :class:`FaultToleranceConfig`: the ``--ft-*`` options / YAML ``fault_tolerance:`` section.
"""

from trainguard.fault_tolerance._client import (
    RankMonitorClient,
    WorkloadAction,
    WorkloadControlRequest,
)
from trainguard.fault_tolerance.config import FaultToleranceConfig, check_timeout_chain
from trainguard.fault_tolerance.errors import (
    LaunchConfigError,
    LauncherError,
    MonitorTimeout,
    MonitorUnavailableError,
)

__all__ = [
    "FaultToleranceConfig",
    "LaunchConfigError",
    "LauncherError",
    "MonitorTimeout",
    "MonitorUnavailableError",
    "RankMonitorClient",
    "WorkloadAction",
    "WorkloadControlRequest",
    "check_timeout_chain",
]
