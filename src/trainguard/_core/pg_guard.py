"""Deferred release of destroyed torch process groups (guards a torch GIL deadlock at teardown).

The deadlock (torch 2.x, gloo; reproduced with torch alone: 2 ranks looping ``init`` -> one DDP
step -> ``barrier()`` -> ``destroy_process_group()`` -> ``del model`` hang within 1-8 tries):

* a gloo work created inside DDP's backward captures the thread-local state, which holds a
  Python object (the ``contextvars`` context ``torch.autograd`` stashes for its device threads);
* the work is freed by the group's worker thread (``pt_gloo_runloop``) once the next barrier's
  work, which keeps weak references to earlier works, is done, and freeing that Python object
  needs the GIL;
* after ``destroy_process_group()`` the DDP model holds the last reference to the group, so
  freeing the model runs ``~ProcessGroupGloo`` on the main thread, which holds the GIL and
  joins the worker threads: the main thread waits for the worker, the worker for the GIL.

Seen in the launcher's warm-forked workers (a rank stuck in ``std::thread::join`` after its
script returned: ``tests/fault_tolerance/test_ft_pg_guard.py``) and under the in-process
Wrapper (issue 13.8).

The guard wraps ``torch.distributed.destroy_process_group`` so the groups it destroys are kept
alive here instead of being freed by whoever drops the last reference:

* a whole-world destroy frees the groups held by the *previous* whole-world destroy (and the
  groups destroyed before that one): their worker threads went idle long ago, the main thread
  has blocked in the next group's rendezvous since, so their destructors join at once;
* :func:`release` frees every held group (the in-process Wrapper calls it after its barriers);
* groups still held when the interpreter exits are never freed (their destructors would join
  threads that may wait for the GIL; the process exits with them instead).

The module imports torch lazily (:func:`install_when_imported` in a worker that does not use
torch costs nothing).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["destroy_process_group", "hold", "held_count", "install", "install_when_imported",
           "release", "uninstall"]

_C10D = "torch.distributed.distributed_c10d"

_lock = threading.Lock()
_held: list[tuple[int, Any]] = []  # (generation, group)
_generation = 0  # whole-world destroys so far
_orig: list[Callable[..., Any]] = []  # torch's function while the guard is installed
_users = 0  # install() / install_when_imported() calls not undone by uninstall()
_exit_hook: list[bool] = []


def _c10d() -> types.ModuleType | None:
    mod = sys.modules.get(_C10D)
    if mod is not None:
        return mod
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist.distributed_c10d if dist.is_available() else None


def hold(group: Any = None) -> None:
    """Keep a reference to ``group`` (None: to every live group) until it is safe to free."""
    if group is None:
        mod = _c10d()
        pg_map = getattr(getattr(mod, "_world", None), "pg_map", None)
        groups = list(pg_map.keys()) if pg_map else []
    else:
        groups = [group]
    with _lock:
        _held.extend((_generation, g) for g in groups)


def held_count() -> int:
    """How many destroyed groups are held now."""
    with _lock:
        return len(_held)


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group`` that defers freeing the destroyed groups.

    Same arguments, errors and blocking as torch's function (it is called unchanged); then, for
    a whole-world destroy (``group`` None), frees the groups held by earlier whole-world
    destroys (a destructor joins that group's idle threads: milliseconds). Main thread.
    """
    mod = _c10d()
    if mod is None:
        raise RuntimeError("torch.distributed is not available in this torch build")
    orig = _orig[0] if _orig else mod.destroy_process_group
    hold(group)
    orig(group)
    if group is None:  # only once torch's destroy went through: a failed one frees nothing
        _next_generation()


def _next_generation() -> None:
    global _generation
    with _lock:
        stale = [g for gen, g in _held if gen < _generation]
        _held[:] = [(gen, g) for gen, g in _held if gen >= _generation]
        _generation += 1
    del stale  # outside the lock: the destructors join idle threads


def release() -> int:
    """Free every held group (call where no collective callback can still be running, e.g.
    after a store barrier); returns how many were held."""
    with _lock:
        dropped = [g for _, g in _held]
        _held.clear()
    n = len(dropped)
    del dropped
    return n


def _patch(mod: types.ModuleType) -> None:
    with _lock:
        if _orig:
            return
        _orig.append(mod.destroy_process_group)
        mod.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
        if not _exit_hook:
            _exit_hook.append(True)
            atexit.register(_keep_at_exit)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is _orig[0]:
        dist.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


def _unpatch() -> None:
    with _lock:
        if not _orig:
            return
        orig = _orig.pop()
    for name in (_C10D, "torch.distributed"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "destroy_process_group", None) \
                is destroy_process_group:
            mod.destroy_process_group = orig  # type: ignore[attr-defined]


def install() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` (imports torch.distributed); nests:
    each call needs one :func:`uninstall`. No-op without torch.distributed."""
    global _users
    mod = _c10d()
    if mod is None:
        return
    with _lock:
        _users += 1
    _patch(mod)


def uninstall() -> None:
    """Undo one :func:`install`; the last one restores torch's function. Frees held groups."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        last = _users == 0
    if last:
        _unpatch()
    release()


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Patches ``distributed_c10d`` right after it executes (before ``torch.distributed``
    re-exports its names), then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _C10D:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if loader is None or run is None:
            return spec

        def exec_and_patch(module: types.ModuleType) -> None:
            run(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install_when_imported() -> None:
    """Install the guard for the rest of the process: now if torch.distributed is imported,
    else when the script first imports it (an import hook; torch is not imported here)."""
    global _users
    with _lock:
        _users += 1
    mod = sys.modules.get(_C10D)
    if mod is not None:
        _patch(mod)
    elif not any(isinstance(f, _InstallOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())


def _keep_at_exit() -> None:
    """At interpreter exit: never run the held groups' destructors (see the module doc)."""
    incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))
    with _lock:
        for _, group in _held:
            incref(group)
        _held.clear()
