"""Deferred release of destroyed process groups (guards a torch GIL deadlock at teardown).

Reproduced with torch alone (2 gloo ranks, a few DDP steps, ``destroy_process_group()`` then
``del model``; hangs within ~5 tries): after ``destroy_process_group`` the DDP model holds the last
reference to its group, so freeing the model runs the gloo group's destructor on the main
thread, which holds the GIL and joins the group's worker threads, while a worker is still
finishing the last all-reduce's callback and waits for the GIL. Under the Wrapper a successful
run then ended with a soft timeout and a killed rank.

While a wrapped call runs, ``torch.distributed.destroy_process_group`` is wrapped so the groups it
destroys are kept alive here (:func:`hold`); they are released by :func:`release` at points where
the main thread has blocked in store waits since (after the iteration barrier of a restart, and
after the completion barrier when the call ends), so the workers' callbacks have run and the
destructors return at once. The restart loop's own teardown goes through the same path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["destroy_process_group", "install", "release", "uninstall"]

_lock = threading.Lock()
_held: list[Any] = []
_installed: list[Callable[..., Any]] = []  # the original function, while installed


def _original() -> Callable[..., Any]:
    return _installed[0] if _installed else dist.distributed_c10d.destroy_process_group


def hold() -> None:
    """Keep references to every live process group (before they are destroyed)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if not pg_map:
        return
    with _lock:
        _held.extend(pg_map.keys())


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group`` that defers freeing the destroyed groups."""
    if group is None:
        hold()
    else:
        with _lock:
            _held.append(group)
    _original()(group)


def release() -> int:
    """Drop the held groups (call where no collective callback can still be running)."""
    with _lock:
        n = len(_held)
        _held.clear()
    return n


def install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (undone by :func:`uninstall`)."""
    if _installed or not dist.is_available():
        return
    _installed.append(dist.distributed_c10d.destroy_process_group)
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def uninstall() -> None:
    """Restore torch's function and release the held groups."""
    if _installed:
        orig = _installed.pop()
        dist.distributed_c10d.destroy_process_group = orig
        dist.destroy_process_group = orig
    release()
