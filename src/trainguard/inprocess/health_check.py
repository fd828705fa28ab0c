"""Health checks. Each takes a FrozenState, returns it, and raises ``HealthCheckError`` if unhealthy.

No GPU present means "not applicable", never "unhealthy".
"""

from __future__ import annotations

import abc

from trainguard.inprocess.state import FrozenState

__all__ = ["HealthCheck"]


class HealthCheck(abc.ABC):
    """Base class of health checks: ``check(state) -> state``; raise ``HealthCheckError`` if unhealthy."""

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
