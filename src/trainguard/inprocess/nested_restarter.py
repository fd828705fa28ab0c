"""NVRx module path ``inprocess.nested_restarter``: restarter-state log lines for a launcher.

When in-process restart runs under a launcher that also restarts (NVRx's ``ft_launcher``), the
launcher follows the in-process restarter through log lines of the form::

    [NestedRestarter] name=[InProcess] state=<state> stage=<stage>

These hooks emit them, on one rank only (``special_rank``, an initial rank, default 0):

======================================  ===============  ====================================
hook (kind)                             when it runs     line
======================================  ===============  ====================================
NestedRestarterHandlingCompleted         initialize       first call: ``state=initialize``;
(Initialize)                                              later: ``state=handling
                                                          stage=completed``
NestedRestarterHandlingStarting (Abort)  abort            ``state=handling stage=starting``
NestedRestarterFinalized (Completion)    completion       ``state=finalized``
NestedRestarterAborted (Terminate)       terminate        ``state=aborted``
======================================  ===============  ====================================

Follows: NVRx ``inprocess.nested_restarter`` (names, arguments, line format).
"""

from __future__ import annotations

import logging
from typing import Any

from trainguard.inprocess.abort import Abort
from trainguard.inprocess.completion import Completion
from trainguard.inprocess.initialize import Initialize
from trainguard.inprocess.state import FrozenState
from trainguard.inprocess.terminate import Terminate

__all__ = [
    "NestedRestarterAborted",
    "NestedRestarterCallback",
    "NestedRestarterFinalized",
    "NestedRestarterHandlingCompleted",
    "NestedRestarterHandlingStarting",
    "NestedRestarterLogger",
]

LOGGER_NAME = "trainguard.inprocess.nested_restarter"


class NestedRestarterLogger:
    """Formats and emits the restarter lines on ``restarter_logger`` (a ``logging.Logger``,
    INFO level, named ``trainguard.inprocess.nested_restarter``)."""

    def __init__(self, name: str = "InProcess") -> None:
        self.name = name
        self.restarter_logger = logging.getLogger(LOGGER_NAME)

    def log(self, state: str, stage: str | None = None) -> None:
        line = f"[NestedRestarter] name=[{self.name}] state={state}"
        if stage is not None:
            line += f" stage={stage}"
        self.restarter_logger.info(line)


class NestedRestarterCallback:
    """One restarter line per call, on initial rank ``special_rank`` only.

    Args:
        restarter_state: e.g. ``initialize``, ``handling``, ``finalized``, ``aborted``.
        restarter_stage: optional, e.g. ``starting``, ``completed``.
        logger: a :class:`NestedRestarterLogger` (default: a new one).
        special_rank: the initial rank that logs (default 0).

    Returns the state it was given; never raises on logging problems (logging's own rules).
    """

    def __init__(
        self,
        restarter_state: str,
        restarter_stage: str | None = None,
        logger: NestedRestarterLogger | None = None,
        special_rank: int = 0,
    ) -> None:
        self.restarter_state = restarter_state
        self.restarter_stage = restarter_stage
        self.logger = logger if logger is not None else NestedRestarterLogger()
        self.special_rank = special_rank

    def _is_special(self, state: Any) -> bool:
        rank = getattr(state, "initial_rank", None)
        if rank is None:
            rank = getattr(state, "rank", None)
        return rank == self.special_rank

    def __call__(self, state: FrozenState) -> FrozenState:
        if self._is_special(state):
            self.logger.log(self.restarter_state, self.restarter_stage)
        return state


class NestedRestarterHandlingCompleted(Initialize, NestedRestarterCallback):
    """Initialize hook: ``state=initialize`` on the first iteration of the first call, then
    ``state=handling stage=completed`` (a restart was handled) on every later one."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "initialize", None, None, special_rank)
        self._first = True

    def __call__(self, state: FrozenState) -> FrozenState:
        if self._first:
            self._first = False
            self.restarter_state, self.restarter_stage = "initialize", None
        else:
            self.restarter_state, self.restarter_stage = "handling", "completed"
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterHandlingStarting(Abort, NestedRestarterCallback):
    """Abort hook: ``state=handling stage=starting`` when a restart begins."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "handling", "starting", None, special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterFinalized(Completion, NestedRestarterCallback):
    """Completion hook: ``state=finalized`` when the wrapped function completed."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "finalized", None, None, special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterAborted(Terminate, NestedRestarterCallback):
    """Terminate hook: ``state=aborted`` when this rank leaves the restart loop."""

    def __init__(self, special_rank: int = 0) -> None:
        NestedRestarterCallback.__init__(self, "aborted", None, None, special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)
