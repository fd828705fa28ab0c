"""Rank-assignment context, base classes and shared helpers.

Every rank runs the same rank assignment on its own :class:`State` with the same terminated set
and computes the same global result locally; only steps that need data from other ranks
(``FilterCountGroupedByKey``, the first call of ``Tree``) exchange it through the store.
"""

from __future__ import annotations

import abc
import dataclasses

import torch.distributed as dist

from trainguard.inprocess.exceptions import InternalError, RankDiscarded
from trainguard.inprocess.state import Mode, State

__all__ = ["RankAssignment", "RankAssignmentCtx", "RankFilter"]

# Every key this subpackage writes lives under this prefix of the store it is given.
KEY_PREFIX = "trainguard/rank_assignment"


@dataclasses.dataclass
class RankAssignmentCtx:
    """Input and output of a rank-assignment step.

    Attributes:
        state: this rank's state. Steps never mutate it; they return a ctx holding a new State.
        store: a store shared by every rank; steps that exchange data write only keys under
            ``trainguard/rank_assignment/`` and namespace them per invocation, so the same store
            may be passed again in later iterations. May be None for purely local steps.
        terminated_ranks: ranks (numbered like ``state.rank``, i.e. the numbering of the
            iteration that just ended) that left. Re-indexing steps consume it (the returned ctx
            holds an empty set); ``FilterCountGroupedByKey`` adds to it.
    """

    state: State
    store: dist.Store | None
    terminated_ranks: set[int] = dataclasses.field(default_factory=set)


class RankAssignment(abc.ABC):
    """Base class of rank-assignment steps: ``step(ctx) -> ctx``.

    Runs on every surviving rank after each restart (and once before the first iteration with
    an empty terminated set). A step that removes this rank raises ``RankDiscarded``.

    Follows: NVRx ``inprocess.rank_assignment.RankAssignment``; difference: steps are pure
    (the input ctx and state are left untouched).
    """

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RankFilter(RankAssignment):
    """Base class of filters: steps that only choose which ranks are active.

    A filter keeps ``rank`` and ``world_size`` and sets ``active_rank``/``active_world_size``/
    ``mode``. It needs an already re-indexed state, so list it to the left of a re-indexing
    step in ``Compose`` (``Compose(MaxActiveWorldSize(4), ShiftRanks())``).

    Raises:
        InternalError: called while ``terminated_ranks`` is not empty (no re-indexing step ran).
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = checked_state(ctx, self)
        if ctx.terminated_ranks:
            raise InternalError(
                f"{self!r} is a RankFilter but received terminated ranks "
                f"{sorted(ctx.terminated_ranks)}; compose it with a re-indexing step that runs "
                f"first, e.g. Compose({self!r}, ShiftRanks())"
            )
        active = self.active_world_size(state)
        if not isinstance(active, int) or not 0 <= active <= state.world_size:
            raise InternalError(
                f"{self!r} chose active_world_size={active!r}, need 0 <= A <= "
                f"world_size={state.world_size}"
            )
        return dataclasses.replace(ctx, state=with_active_prefix(state, active))

    @abc.abstractmethod
    def active_world_size(self, state: State) -> int:
        """The number A of active ranks; ranks ``0 .. A-1`` become active."""
        raise NotImplementedError


def checked_state(ctx: RankAssignmentCtx, step: object) -> State:
    """Validate ``ctx`` and return its state.

    Raises:
        TypeError: ``ctx`` is not a :class:`RankAssignmentCtx`.
        InternalError: ``state.rank`` or a terminated rank is outside ``[0, world_size)``.
    """
    if not isinstance(ctx, RankAssignmentCtx):
        raise TypeError(f"{step!r} expects a RankAssignmentCtx, got {type(ctx).__name__}")
    state = ctx.state
    world = state.world_size
    if not isinstance(world, int) or world < 1:
        raise InternalError(f"{step!r}: world_size={world!r} must be an int >= 1")
    if not isinstance(state.rank, int) or not 0 <= state.rank < world:
        raise InternalError(f"{step!r}: rank={state.rank!r} outside [0, world_size={world})")
    bad = sorted(r for r in ctx.terminated_ranks if not (isinstance(r, int) and 0 <= r < world))
    if bad:
        raise InternalError(
            f"{step!r}: terminated ranks {bad} outside [0, world_size={world}) on rank "
            f"{state.rank}; terminated ranks use the numbering of State.rank"
        )
    return state


def discard(state: State, step: object, why: str) -> RankDiscarded:
    """The ``RankDiscarded`` to raise when ``step`` removes this rank."""
    return RankDiscarded(
        f"{step!r} removed rank {state.rank} (initial rank {state.initial_rank}, "
        f"iteration {state.iteration}): {why}"
    )


def previous_active_world_size(state: State) -> int:
    """A from the last assignment (capped by W), or W if there was none.

    Used so A never grows: a reserve rank replaces a lost active one, never adds to A.
    """
    if state.mode is Mode.INITIALIZED or state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def with_active_prefix(state: State, active_world_size: int) -> State:
    """``state`` with ranks ``0 .. A-1`` active and the rest inactive (reserve)."""
    active = state.rank < active_world_size  # type: ignore[operator]  # checked by caller
    return dataclasses.replace(
        state,
        active_rank=state.rank if active else None,
        active_world_size=active_world_size,
        mode=Mode.ACTIVE if active else Mode.INACTIVE,
    )


def own_id(state: State) -> int:
    """A per-process id that never changes during a call (initial rank, else rank)."""
    return state.initial_rank if state.initial_rank is not None else state.rank  # type: ignore


def next_sequence(store: dist.Store, state: State, what: str) -> int:
    """Per-rank invocation counter of ``what`` on ``store`` (1, 2, ...).

    Every surviving rank runs the same steps in the same order, so the n-th invocation has the
    same number on every rank: it namespaces the keys of one invocation without communication
    and lets a persistent store be reused across iterations and calls.
    """
    return int(store.add(f"{KEY_PREFIX}/{what}/seq/{own_id(state)}", 1))


def require_store(ctx: RankAssignmentCtx, step: object) -> dist.Store:
    """``ctx.store``, or a clear error where a step needs one."""
    if ctx.store is None:
        raise InternalError(
            f"{step!r} exchanges data between ranks and needs RankAssignmentCtx.store; got None"
        )
    return ctx.store
