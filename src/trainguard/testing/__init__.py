"""Public test seams: free ports, leak checks, declarative fault plans and a rank launcher.

Used by trainguard's own tests and available to users testing code built on trainguard.
"""

from trainguard._core.net import free_port
from trainguard.testing._leaks import LeakChecker, live_children, trainguard_shm_segments
from trainguard.testing.faults import (
    Fault,
    FaultKind,
    FaultPlan,
    InjectedFault,
    RankResult,
    inject,
    run_ranks,
)

__all__ = [
    "Fault",
    "FaultKind",
    "FaultPlan",
    "InjectedFault",
    "LeakChecker",
    "RankResult",
    "free_port",
    "inject",
    "live_children",
    "run_ranks",
    "trainguard_shm_segments",
]
