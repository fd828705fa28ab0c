"""Per-rank restart state: :class:`State` (owned by the restart loop) and :class:`FrozenState`.

Follows: NVRx ``inprocess.state`` (same fields and meanings); difference: ``FrozenState`` is a
plain frozen dataclass (no runtime class building) and ``State.from_env`` validates its input.
"""

from __future__ import annotations

import dataclasses
import enum
import os

from trainguard.errors import ConfigError

__all__ = ["FrozenState", "Mode", "State"]


class Mode(enum.Enum):
    """Role of a rank in the current iteration.

    Transitions: INITIALIZED -> ACTIVE | INACTIVE (first rank assignment); ACTIVE <-> INACTIVE
    (reassignment after a fault); any -> TERMINATED (rank removed; only seen inside rank-assignment
    trees, a terminated rank itself leaves through ``RankDiscarded``).
    """

    INITIALIZED = enum.auto()
    ACTIVE = enum.auto()
    INACTIVE = enum.auto()
    TERMINATED = enum.auto()


@dataclasses.dataclass(frozen=True)
class FrozenState:
    """Read-only snapshot of :class:`State` handed to hooks; assignment raises
    ``dataclasses.FrozenInstanceError``."""

    rank: int | None
    world_size: int
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int | None = None
    initial_world_size: int | None = None
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def thaw(self) -> State:
        """A mutable :class:`State` copy of this snapshot."""
        return State(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclasses.dataclass
class State:
    """Mutable restart state of one rank; only the restart loop mutates it.

    Fields:
        rank, world_size: index among surviving ranks (active + reserve) and their count;
            ``rank`` is None for a terminated rank.
        active_rank, active_world_size: exported as ``RANK``/``WORLD_SIZE`` to the wrapped
            function; ``active_rank`` is None for an inactive (reserve) rank.
        initial_rank, initial_world_size: values from the environment at creation; never change.
            They default to ``rank``/``world_size`` when not given (as NVRx).
        iteration: restart counter, 0 on the first attempt of each call.
        mode: see :class:`Mode`.
        fn_exception: this rank's own exception in the current iteration (None if the fault was
            elsewhere); cleared by :meth:`advance`.
    """

    rank: int | None
    world_size: int
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int | None = None
    initial_world_size: int | None = None
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def __post_init__(self) -> None:
        # NVRx compatibility: ``State(rank, world_size)`` is the state at creation, so the
        # initial values default to the given ones (steps keyed by initial rank rely on it).
        if self.initial_rank is None:
            self.initial_rank = self.rank
        if self.initial_world_size is None:
            self.initial_world_size = self.world_size

    @classmethod
    def from_env(cls, environ: dict | None = None) -> State:
        """Build the initial state from ``RANK`` (default 0) and ``WORLD_SIZE`` (default 1).

        Raises:
            ConfigError: a variable is not an integer, or ``RANK`` is outside ``[0, WORLD_SIZE)``.
        """
        env = os.environ if environ is None else environ
        try:
            rank = int(env.get("RANK", "0"))
            world_size = int(env.get("WORLD_SIZE", "1"))
        except ValueError as exc:
            raise ConfigError(
                f"RANK={env.get('RANK')!r} / WORLD_SIZE={env.get('WORLD_SIZE')!r} must be integers "
                "(set them as torchrun does, or let your launcher set them)"
            ) from exc
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"need 0 <= RANK < WORLD_SIZE, got RANK={rank}, WORLD_SIZE={world_size}"
            )
        return cls(
            rank=rank,
            world_size=world_size,
            initial_rank=rank,
            initial_world_size=world_size,
        )

    def freeze(self) -> FrozenState:
        """Snapshot for hooks. ``fn_exception`` is shared, not copied (exceptions hold frames)."""
        return FrozenState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def advance(self) -> None:
        """Move to the next iteration: ``iteration += 1`` and ``fn_exception`` cleared."""
        self.iteration += 1
        self.fn_exception = None

    def set_distributed_vars(self, environ: dict | None = None) -> None:
        """Export ``RANK``/``WORLD_SIZE`` for the wrapped function (active rank and world size).

        An inactive rank gets no ``RANK`` (removed), never the string ``"None"``.
        """
        env = os.environ if environ is None else environ
        if self.active_rank is None:
            env.pop("RANK", None)
        else:
            env["RANK"] = str(self.active_rank)
        if self.active_world_size is not None:
            env["WORLD_SIZE"] = str(self.active_world_size)
