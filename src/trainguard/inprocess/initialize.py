"""``Initialize`` hook base class and :class:`RetryController`.

Runs at the start of every iteration, before the health check and fn. An Exception restarts;
a BaseException (e.g. RestartAbort) ends this rank.

Follows: NVRx ``inprocess.initialize`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc

from trainguard.errors import ConfigError
from trainguard.inprocess.exceptions import RestartAbort
from trainguard.inprocess.state import FrozenState

__all__ = ["Initialize", "RetryController"]


class Initialize(abc.ABC):
    """Base class of initialize hooks: ``hook(state) -> state``.

    Runs at the start of every iteration, before the health check and fn. An Exception
    restarts; a BaseException (e.g. RestartAbort) ends this rank.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


def _limit(name: str, value: object, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"RetryController {name} must be None or an int >= {minimum}, got {value!r}"
        )
    return value


class RetryController(Initialize):
    """Stop restarting (raise ``RestartAbort``) past an iteration limit or below a world size.

    Use it as (part of) ``initialize``: at the start of iteration ``i`` it aborts if
    ``i >= max_iterations`` (so ``max_iterations=4`` allows 4 attempts: iterations 0..3), if
    ``world_size < min_world_size``, or if ``active_world_size < min_active_world_size``.
    None disables a limit, and an ``active_world_size`` of None (not assigned yet) is not
    compared, so nothing here raises ``TypeError``.

    Follows: NVRx ``RetryController``; difference: every limit may be None (Megatron-Bridge
    #4944), and the message lists each violated limit with its values.

    Raises:
        RestartAbort: a limit is violated (a BaseException: this rank leaves the restart loop).
        ConfigError: a limit is not None or an int in range (at construction).
    """

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int | None = 1,
        min_active_world_size: int | None = 1,
    ) -> None:
        self.max_iterations = _limit("max_iterations", max_iterations, 1)
        self.min_world_size = _limit("min_world_size", min_world_size, 0)
        self.min_active_world_size = _limit("min_active_world_size", min_active_world_size, 0)

    def __repr__(self) -> str:
        return (
            f"RetryController(max_iterations={self.max_iterations}, min_world_size="
            f"{self.min_world_size}, min_active_world_size={self.min_active_world_size})"
        )

    def violations(self, state: FrozenState) -> list[str]:
        """Human descriptions of the limits ``state`` violates (empty: keep going)."""
        out = []
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            out.append(f"iteration={state.iteration} >= max_iterations={self.max_iterations}")
        if self.min_world_size is not None and state.world_size < self.min_world_size:
            out.append(f"world_size {state.world_size} < min_world_size={self.min_world_size}")
        active, floor = state.active_world_size, self.min_active_world_size
        if floor is not None and active is not None and active < floor:
            out.append(f"active_world_size {active} < min_active_world_size={floor}")
        return out

    def __call__(self, state: FrozenState) -> FrozenState:
        problems = self.violations(state)
        if problems:
            raise RestartAbort(
                f"{self!r} stops restarting on rank {state.rank} (initial rank "
                f"{state.initial_rank}): " + "; ".join(problems)
            )
        return state
