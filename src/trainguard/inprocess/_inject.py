"""Injection of the live ``CallWrapper`` into the wrapped function's arguments.

A parameter receives the CallWrapper when its annotation is ``CallWrapper``, ``Optional`` /
``Union[..., CallWrapper, ...]``, or the string ``"CallWrapper"`` (PEP 563 or quoted). Hints are
resolved with ``typing.get_type_hints`` and guarded: an unresolvable or generic annotation
(``dict[str, int]``) is simply not a CallWrapper, never an error (NVRx defect 2). A ``*args`` /
``**kwargs`` adapter that declares ``CallWrapper`` in its annotation receives it by keyword when
the caller did not pass one (Megatron-Bridge #5187).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["bind_call_wrapper", "call_wrapper_params"]


def _mentions(annotation: Any, cls: type) -> bool:
    if annotation is cls:
        return True
    if isinstance(annotation, str):
        text = annotation.replace(" ", "").replace("'", "").replace('"', "")
        return any(part.split(".")[-1] == cls.__name__
                   for part in text.replace("[", ",").replace("]", ",").replace("|", ",")
                   .split(","))
    if isinstance(annotation, typing.ForwardRef):
        return _mentions(annotation.__forward_arg__, cls)
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        return any(_mentions(a, cls) for a in args)
    return False


def call_wrapper_params(fn: Callable, cls: type) -> tuple[list[str], str | None]:
    """Names of ``fn``'s parameters annotated with ``cls``, and a ``**kwargs`` name to use."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], None
    try:
        hints = typing.get_type_hints(fn, localns={cls.__name__: cls})
    except Exception:  # noqa: BLE001 - unresolvable hints: fall back to raw annotations
        hints = {}
    named, var_kw = [], None
    for name, p in sig.parameters.items():
        ann = hints.get(name, p.annotation)
        if ann is inspect.Parameter.empty or not _mentions(ann, cls):
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = "call_wrapper"
        elif p.kind is not inspect.Parameter.VAR_POSITIONAL:
            named.append(name)
    return named, var_kw


def bind_call_wrapper(
    fn: Callable, cls: type, value: Any, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every CallWrapper parameter set to ``value``."""
    named, var_kw = call_wrapper_params(fn, cls)
    if not named and var_kw is None:
        return args, kwargs
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **kwargs)
    for name in named:
        bound.arguments[name] = value
    out_args, out_kwargs = bound.args, dict(bound.kwargs)
    if var_kw is not None and not any(isinstance(v, cls) for v in out_kwargs.values()):
        out_kwargs[var_kw] = value
    return out_args, out_kwargs
