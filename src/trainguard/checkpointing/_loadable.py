"""What a torch-format checkpoint may hold: the types ``torch.load(weights_only=True)`` restores.

A save must never commit what the default load refuses. Two halves, used by the trainer:

* :func:`load_context` - ``torch.serialization.safe_globals`` with an explicit allow-list of NumPy
  types (arrays and scalars of non-object dtypes, dtypes; hence NumPy RNG states:
  ``np.random.get_state()`` and ``Generator.bit_generator.state``), entered by every
  weights-only load of a checkpoint file.
* :func:`check_loadable` - at ``save()`` time, every value that is not a plain leaf (None, bool,
  int, float, str, bytes, a NumPy array or scalar of a non-object dtype) is round-tripped through
  ``torch.save`` / ``torch.load(weights_only=True)`` under that allow-list; a value that does not
  come back raises :class:`StateDictError` naming its key, before anything is written.

Types the user trusts can be allowed with ``torch.serialization.add_safe_globals([...])`` (or the
``safe_globals`` context manager) around both the save and the load; both halves honour it.

Follows: torch ``weights_only`` loading (``torch.serialization.safe_globals``); difference: the
refusal happens at save time, not at restore time.
"""

from __future__ import annotations

import contextlib
import io
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from trainguard.checkpointing.errors import StateDictError

__all__ = ["check_loadable", "load_context", "numpy_safe_globals"]

_PLAIN = (type(None), bool, int, float, str, bytes)
_CONTAINERS = (dict, OrderedDict, list, tuple)
_numpy_globals: list[Any] | None = None


def numpy_safe_globals() -> list[Any]:
    """The NumPy callables and classes allowed for weights-only loading (empty without NumPy).

    Taken from live objects (``ndarray.__reduce__``), so NumPy 1 (``numpy.core``) and NumPy 2
    (``numpy._core``) module paths both work. Object dtypes are excluded.
    """
    global _numpy_globals
    if _numpy_globals is None:
        try:
            import numpy as np
        except ImportError:
            _numpy_globals = []
            return _numpy_globals
        found: list[Any] = [np.ndarray, np.dtype, np.ones(1).__reduce__()[0],
                            np.float64(0).__reduce__()[0]]
        for code in np.typecodes["All"]:
            if code != "O":
                found.append(type(np.dtype(code)))
        _numpy_globals = list(dict.fromkeys(found))
    return _numpy_globals


def load_context() -> contextlib.AbstractContextManager[Any]:
    """Context for ``torch.load(weights_only=True)`` of a checkpoint: NumPy types allowed.

    Only globals the user has not allowed already are added (leaving the context removes what it
    added, so a user's own ``add_safe_globals`` registration survives it).
    """
    present = set(map(id, torch.serialization.get_safe_globals()))
    allowed = [g for g in numpy_safe_globals() if id(g) not in present]
    return torch.serialization.safe_globals(allowed) if allowed else contextlib.nullcontext()


def _plain_numpy(value: Any) -> bool:
    np = _numpy_module()
    if np is None:
        return False
    if isinstance(value, (np.ndarray, np.generic)):
        return not value.dtype.hasobject
    return isinstance(value, np.dtype) and not value.hasobject


def _numpy_module() -> Any:
    import sys

    return sys.modules.get("numpy")  # a state cannot hold NumPy values unless it is imported


def _suspects(value: Any, path: str, skip: type) -> Iterator[tuple[str, Any]]:
    """(key path, value) of every value that needs the round-trip check."""
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(value, dict) and not isinstance(k, _PLAIN):
                yield f"{path}<key {k!r}>", k
            sub = (f"{path}.{k}" if path else str(k)) if isinstance(value, dict) else f"{path}[{k}]"
            yield from _suspects(v, sub, skip)
        return
    if isinstance(value, _PLAIN) and type(value) in _PLAIN:
        return
    if isinstance(value, (skip, torch.Tensor)) or _plain_numpy(value):
        return
    yield path, value


def check_loadable(skeleton: Any, skip: type) -> None:
    """Raise :class:`StateDictError` when ``torch.load(weights_only=True)`` could not restore a
    value of ``skeleton`` (instances of ``skip`` are staged-tensor placeholders).

    Blocks for one in-memory ``torch.save``/``torch.load`` per value that is not a plain leaf
    (none for the usual dicts of tensors and numbers). Runs in the trainer, at save time.
    """
    for path, value in _suspects(skeleton, "", skip):
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
            buf.seek(0)
            with load_context():
                torch.load(buf, weights_only=True)
        except Exception as exc:  # any failure means "cannot be restored"
            tail = str(exc).split("WeightsUnpickler error: ")[-1]
            reason = next((ln.strip() for ln in tail.splitlines() if ln.strip()),
                          type(exc).__name__)
            raise StateDictError(
                f"state value at key {path or '<root>'!r} ({type(value).__name__}) could be saved "
                f"but not loaded back with torch.load(weights_only=True): {reason}. Convert it to "
                "a tensor or plain data (NumPy arrays and NumPy RNG states are allowed), or allow "
                "its type with torch.serialization.add_safe_globals([...]) before saving and "
                "loading; nothing was written.") from exc
