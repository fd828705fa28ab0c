"""Local rank-assignment steps: re-indexing (ShiftRanks, FillGaps) and filters.

Each is a pure function of (state, terminated set), so every rank computes the same result.

Follows: NVRx ``inprocess.rank_assignment``; difference: ``FillGaps`` implements the documented
semantics (NVRx's shipped code maps W=8, T={1,4,5} to {6->4, 7->5}; here it is {6->1, 7->4}).
"""

from __future__ import annotations

import bisect
import dataclasses

from trainguard.errors import ConfigError
from trainguard.inprocess.compose import Compose
from trainguard.inprocess.rank_assignment._base import (
    RankAssignment,
    RankAssignmentCtx,
    RankFilter,
    checked_state,
    discard,
    previous_active_world_size,
    with_active_prefix,
)
from trainguard.inprocess.state import State

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "MaxActiveWorldSize",
    "ShiftRanks",
    "default_rank_assignment",
]


def _reindexed(
    ctx: RankAssignmentCtx, state: State, rank: int, world_size: int
) -> RankAssignmentCtx:
    """ctx with the new rank/W; ranks below A = min(previous A, W') are active."""
    moved = dataclasses.replace(state, rank=rank, world_size=world_size)
    active = min(previous_active_world_size(state), world_size)
    return dataclasses.replace(ctx, state=with_active_prefix(moved, active), terminated_ranks=set())


class ShiftRanks(RankAssignment):
    """Close the gaps left by terminated ranks by shifting the ranks above them down.

    New rank = old rank - (number of terminated ranks below it); order is preserved and
    W' = W - |T|. Example (W=8, T={1,4,5}): 0->0, 2->1, 3->2, 6->3, 7->4.

    Sets A = min(previous A (W on the first call), W'); ranks below A are active, so alone it
    keeps every rank active. Consumes ``terminated_ranks``.

    Raises:
        RankDiscarded: this rank is in ``terminated_ranks``.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = checked_state(ctx, self)
        dead = sorted(ctx.terminated_ranks)
        if state.rank in ctx.terminated_ranks:
            raise discard(state, self, f"it is in the terminated set {dead}")
        below = bisect.bisect_left(dead, state.rank)
        return _reindexed(ctx, state, state.rank - below, state.world_size - len(dead))


class FillGaps(RankAssignment):
    """Fill the gaps left by terminated ranks with the highest surviving ranks.

    With W' = W - |T|, ranks below W' keep their index; the survivors at or above W' move, in
    ascending order, into the gaps below W' in ascending order. Example (W=8, T={1,4,5}):
    W'=5, 6->1, 7->4, the others keep their rank. Fewer ranks move than with ShiftRanks.

    Sets A like :class:`ShiftRanks`. Consumes ``terminated_ranks``.

    Raises:
        RankDiscarded: this rank is in ``terminated_ranks``.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = checked_state(ctx, self)
        dead = ctx.terminated_ranks
        if state.rank in dead:
            raise discard(state, self, f"it is in the terminated set {sorted(dead)}")
        new_world = state.world_size - len(dead)
        rank: int = state.rank  # type: ignore[assignment]  # checked above
        if rank >= new_world:
            movers = [r for r in range(new_world, state.world_size) if r not in dead]
            gaps = sorted(r for r in dead if r < new_world)
            rank = gaps[movers.index(rank)]
        return _reindexed(ctx, state, rank, new_world)


class ActivateAllRanks(RankFilter):
    """Make every rank active: ``active_rank = rank``, A = W.

    With this filter a reserve rank never exists; pair it with a re-indexing step (the default
    is ``Compose(ActivateAllRanks(), ShiftRanks())``).
    """

    def active_world_size(self, state: State) -> int:
        return state.world_size


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


class MaxActiveWorldSize(RankFilter):
    """Cap the number of active ranks: A = min(previous A (W the first time), W, n).

    ``n=None`` (the default, as NVRx) means no cap beyond W.

    Ranks ``0 .. A-1`` are active, the rest are reserve. Because A starts from its previous
    value, a reserve rank takes over a lost active one and A never grows.

    Raises:
        ConfigError: ``n`` is not an int >= 1 (at construction).
    """

    def __init__(self, max_active_world_size: int | None = None) -> None:
        self.max_active_world_size = (None if max_active_world_size is None else
                                      _positive_int("max_active_world_size",
                                                    max_active_world_size))

    def active_world_size(self, state: State) -> int:
        cap = state.world_size if self.max_active_world_size is None else \
            self.max_active_world_size
        return min(previous_active_world_size(state), state.world_size, cap)

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"


class ActiveWorldSizeDivisibleBy(RankFilter):
    """Round A down to a multiple of ``divisor``: A = floor(min(previous A, W) / d) * d.

    ``divisor`` defaults to 1 (as NVRx). Ranks ``0 .. A-1`` are active. A may become 0 (no active
    rank); bound that with
    ``RetryController(min_active_world_size=...)``.

    Raises:
        ConfigError: ``divisor`` is not an int >= 1 (at construction).
    """

    def __init__(self, divisor: int = 1) -> None:
        self.divisor = _positive_int("divisor", divisor)

    def active_world_size(self, state: State) -> int:
        base = min(previous_active_world_size(state), state.world_size)
        return base // self.divisor * self.divisor

    def __repr__(self) -> str:
        return f"ActiveWorldSizeDivisibleBy({self.divisor})"


def default_rank_assignment() -> Compose:
    """A fresh default rank assignment, ``Compose(ActivateAllRanks(), ShiftRanks())``.

    A factory (not a shared module-level instance) so no state is shared between Wrappers.
    """
    return Compose(ActivateAllRanks(), ShiftRanks())
