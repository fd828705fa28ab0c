"""Public test seams: free ports, leak checks, declarative fault plans, a rank launcher and
simulated nodes in network namespaces (:mod:`trainguard.testing.netns`).

Used by trainguard's own tests and available to users testing code built on trainguard.
"""

from trainguard._core.net import free_port
from trainguard.testing._leaks import (
    LeakChecker,
    harness_netns,
    live_children,
    trainguard_shm_segments,
    wait_gone,
)
from trainguard.testing.faults import (
    Fault,
    FaultKind,
    FaultPlan,
    InjectedFault,
    RankResult,
    inject,
    run_ranks,
)
from trainguard.testing.netns import (
    LocalNodes,
    NetnsError,
    SimNode,
    SimNodes,
    netns_unavailable,
    sweep_leftovers,
)

__all__ = [
    "Fault",
    "FaultKind",
    "FaultPlan",
    "InjectedFault",
    "LeakChecker",
    "LocalNodes",
    "NetnsError",
    "RankResult",
    "SimNode",
    "SimNodes",
    "free_port",
    "harness_netns",
    "inject",
    "live_children",
    "netns_unavailable",
    "run_ranks",
    "sweep_leftovers",
    "trainguard_shm_segments",
    "wait_gone",
]
