"""``Completion`` hook base class.

Runs once after fn returned on every rank. Errors are logged, never raised.

Follows: NVRx ``inprocess.completion`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc

from trainguard.inprocess.state import FrozenState

__all__ = ["Completion"]


class Completion(abc.ABC):
    """Base class of completion hooks: ``hook(state) -> state``.

    Runs once after fn returned on every rank. Errors are logged, never raised.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError
