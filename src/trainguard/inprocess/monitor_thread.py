"""NVRx module path ``inprocess.monitor_thread``: the restart interrupt and its delivery helpers.

:class:`RankShouldRestart` is the interrupt the restart machinery raises into the main thread
(see ``_monitor_thread`` for the monitor thread itself). :func:`async_raise` and
:func:`reraise_if_unraisable` are the two low-level tools NVRx code and tests use directly.

Follows: NVRx ``inprocess.monitor_thread`` (same names and behaviour for these three).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from typing import Any

from trainguard.inprocess.exceptions import RankShouldRestart

__all__ = ["RankShouldRestart", "async_raise", "reraise_if_unraisable"]


def async_raise(tid: int, exc_type: type[BaseException]) -> None:
    """Schedule ``exc_type`` to be raised in thread ``tid`` at its next bytecode boundary.

    Returns at once (never blocks). A thread blocked in a C call (``time.sleep``, a socket
    read) sees the exception only when the call returns.

    Raises:
        ValueError: no thread has id ``tid``.
        SystemError: CPython reported more than one thread state changed (the request is
            revoked before raising).
    """
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    changed = set_exc(ctypes.c_ulong(tid), ctypes.py_object(exc_type))
    if changed == 0:
        raise ValueError(f"async_raise: no thread with id {tid}")
    if changed > 1:
        set_exc(ctypes.c_ulong(tid), ctypes.c_void_p(0))
        raise SystemError(f"async_raise: {changed} thread states changed for id {tid}; revoked")


class reraise_if_unraisable(contextlib.ContextDecorator):
    """Re-raise ``exc_type`` swallowed as "unraisable" (e.g. raised inside ``__del__``).

    While active, ``sys.unraisablehook`` is replaced: an unraisable ``exc_type`` is raised
    again, asynchronously, in the thread that entered the context (about 5 ms later, at its next
    bytecode boundary); any other unraisable goes to the previous hook. The previous hook is
    restored on
    exit, also when the block raises. Use as a context manager or a decorator; not re-entrant
    across threads (the hook is process-wide).

    Follows: NVRx ``monitor_thread.reraise_if_unraisable``.
    """

    def __init__(self, exc_type: type[BaseException]) -> None:
        self.exc_type = exc_type
        self._saved: list[Any] = []

    def __enter__(self) -> reraise_if_unraisable:  # noqa: PYI034
        previous = sys.unraisablehook
        tid = threading.get_ident()
        exc_type = self.exc_type

        def hook(unraisable: Any) -> None:
            if unraisable.exc_type is not None and issubclass(unraisable.exc_type, exc_type):
                # From another thread, a moment later: raised now it would surface inside this
                # hook, where CPython swallows it again.
                timer = threading.Timer(0.005, async_raise, args=(tid, unraisable.exc_type))
                timer.daemon = True
                timer.start()
            else:
                previous(unraisable)

        self._saved.append(previous)
        sys.unraisablehook = hook
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.unraisablehook = self._saved.pop()
