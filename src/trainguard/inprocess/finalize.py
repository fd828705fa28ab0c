"""``Finalize`` hook base class.

Runs in the main thread after a fault, before the restart health check. An Exception takes this
rank out (it cannot be trusted to restart).

Follows: NVRx ``inprocess.finalize`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc

from trainguard.inprocess.state import FrozenState

__all__ = ["Finalize"]


class Finalize(abc.ABC):
    """Base class of finalize hooks: ``hook(state) -> state``.

    Runs in the main thread after a fault, before the restart health check. An Exception takes
    this rank out (it cannot be trusted to restart).
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
