"""Public test seams: free ports, leak checks, fault plans.

Used by trainguard's own tests and available to users testing code built on trainguard.
"""

from trainguard._core.net import free_port
from trainguard.testing._leaks import LeakChecker, live_children, trainguard_shm_segments

__all__ = ["LeakChecker", "free_port", "live_children", "trainguard_shm_segments"]
