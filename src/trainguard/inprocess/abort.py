"""``Abort`` hook base class.

Runs in the monitor thread of every rank when a restart begins, to unblock the main thread (tear down process groups, kill helper processes). Errors are logged, never raised.

Follows: NVRx ``inprocess.abort`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc

from trainguard.inprocess.state import FrozenState

__all__ = ["Abort"]


class Abort(abc.ABC):
    """Base class of abort hooks: ``hook(state) -> state``.

    Runs in the monitor thread of every rank when a restart begins, to unblock the main thread (tear down process groups, kill helper processes). Errors are logged, never raised.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
