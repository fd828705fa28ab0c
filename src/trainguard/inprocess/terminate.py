"""``Terminate`` hook base class.

Runs when this rank leaves the restart loop through a BaseException (terminal). Errors propagate.

Follows: NVRx ``inprocess.terminate`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc

from trainguard.inprocess.state import FrozenState

__all__ = ["Terminate"]


class Terminate(abc.ABC):
    """Base class of terminate hooks: ``hook(state) -> state``.

    Runs when this rank leaves the restart loop through a BaseException (terminal). Errors
    propagate.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
