"""``Compose``: chain hooks right to left (``Compose(f, g)(x) == f(g(x))``).

Follows: NVRx ``inprocess.compose``; differences: no runtime class building — a ``Compose`` is
accepted wherever a hook is, and a stage returning None passes its input on (with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["Compose"]


class Compose:
    """Compose callables; the rightmost runs first. Tuple results are spread as arguments.

    Nested ``Compose`` instances are flattened; ``instances`` lists the stages left to right.

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

    def __call__(self, *args: Any) -> Any:
        value: Any = args if len(args) != 1 else args[0]
        for stage in reversed(self.instances):
            out = stage(*value) if isinstance(value, tuple) else stage(value)
            if out is None:
                warnings.warn(f"{stage!r} returned None; passing its input on", stacklevel=2)
                continue
            value = out
        return value

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.instances))})"
