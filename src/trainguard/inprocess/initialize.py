"""``Initialize`` hook base class.

Runs at the start of every iteration, before the health check and fn. An Exception restarts; a BaseException (e.g. RestartAbort) ends this rank.

Follows: NVRx ``inprocess.initialize`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc

from trainguard.inprocess.state import FrozenState

__all__ = ["Initialize"]


class Initialize(abc.ABC):
    """Base class of initialize hooks: ``hook(state) -> state``.

    Runs at the start of every iteration, before the health check and fn. An Exception restarts; a BaseException (e.g. RestartAbort) ends this rank.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
