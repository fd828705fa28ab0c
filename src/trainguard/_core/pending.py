"""Reach the main thread's next bytecode boundary from another thread: the one
``Py_AddPendingCall`` binding of the package (the launcher's automatic heartbeat and inprocess's
progress watchdogs use it).

The binding is a private foreign-function object. Setting ``argtypes`` on
``ctypes.pythonapi.Py_AddPendingCall`` instead would change one object shared by the whole
process, so two users declaring different argument types break each other (seen: a worker under
``trainguard launch`` that imported ``trainguard.inprocess`` lost its automatic heartbeat thread
to ``ctypes.ArgumentError`` and was then killed as hung).
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["PendingCallback", "add_pending_call"]

#: ``int callback(void *)``, the C signature ``Py_AddPendingCall`` runs.
PendingCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

# PYFUNCTYPE: called with the GIL held, like every ``ctypes.pythonapi`` function.
_add = ctypes.PYFUNCTYPE(ctypes.c_int, PendingCallback, ctypes.c_void_p)(
    ("Py_AddPendingCall", ctypes.pythonapi))


def add_pending_call(callback: Any) -> bool:
    """Queue ``callback`` (a :data:`PendingCallback`) to run in the main thread at its next
    bytecode boundary; the main thread blocked in C code runs it when it returns to Python.

    The caller keeps ``callback`` alive for the interpreter's lifetime (a queued call may run
    after its user stopped). Never blocks. Returns False when CPython's pending-call queue is
    full (try again on the next tick).
    """
    return int(_add(callback, None)) == 0
