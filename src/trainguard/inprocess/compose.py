"""``Compose``: chain hooks right to left (``Compose(f, g)(x) == f(g(x))``).

Follows: NVRx ``inprocess.compose``: the rightmost stage runs first, tuple results are spread as
arguments, a stage that drops its input (returns None) makes the chain continue with None and
warns, and a ``Compose`` passes ``isinstance`` checks for the stages' lowest common base class.
Difference: no class is built at runtime; ``isinstance`` sees the common base through the
instance's ``__class__`` (``type(c)`` stays :class:`Compose`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Compose"]


def _common_base(instances: tuple[Callable[..., Any], ...]) -> type:
    """The most derived class every stage is an instance of (``object`` if none is shared)."""
    for cls in type(instances[0]).__mro__:
        if all(isinstance(inst, cls) for inst in instances[1:]):
            return cls
    return object


class Compose:
    """Compose callables; the rightmost runs first. Tuple results are spread as arguments.

    Nested ``Compose`` instances are flattened; ``instances`` lists the stages left to right.
    ``isinstance(Compose(a, b), Base)`` is True when both ``a`` and ``b`` are ``Base``
    instances, so a composition of hooks is accepted wherever one hook of that kind is.

    Contract of a call (runs in the caller's thread; blocks as long as the stages do):

    * the first (rightmost) stage gets the call's arguments; each next stage gets the previous
      result, spread if it is a tuple;
    * a stage that was given arguments and returns None drops the value: a ``UserWarning``
      names it and the next stage receives None (the chain's result is None unless a later
      stage produces a value); a stage called without arguments may return None silently;
    * exceptions of a stage propagate unchanged; later stages do not run.

    Raises:
        TypeError: a stage is not callable or no stage is given.
    """

    def __init__(self, *instances: Callable[..., Any]) -> None:
        if not instances:
            raise TypeError("Compose needs at least one callable")
        flat: list[Callable[..., Any]] = []
        for inst in instances:
            if not callable(inst):
                raise TypeError(f"Compose stages must be callable, got {inst!r}")
            flat.extend(inst.instances if isinstance(inst, Compose) else [inst])
        self.instances: tuple[Callable[..., Any], ...] = tuple(flat)
        self._base = _common_base(self.instances)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() support, see the class docstring
        base = self.__dict__.get("_base", object)
        return base if base is not object else type(self)

    def __call__(self, *args: Any) -> Any:
        value: Any = args if len(args) != 1 else args[0]
        for stage in reversed(self.instances):
            empty = isinstance(value, tuple) and not value
            out = stage(*value) if isinstance(value, tuple) else stage(value)
            if out is None and not empty:
                warnings.warn(
                    f"Compose: {stage!r} returned None; the next stage gets None",
                    UserWarning, stacklevel=2,
                )
            value = () if out is None and empty else out
        return None if isinstance(value, tuple) and not value else value

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.instances))})"
