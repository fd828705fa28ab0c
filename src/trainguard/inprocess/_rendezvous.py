"""Fresh store keys per iteration for a plain ``init_process_group`` inside the wrapped function.

``init_process_group('gloo')`` with ``env://`` (or ``tcp://``) makes its own TCPStore at
``MASTER_ADDR:MASTER_PORT``, hosted by rank 0's trainer. That server outlives a restart whenever
anything still references the old store (torch reuses a live server on the same port), so the
next attempt saw the previous attempt's keys: ``store.add(key, 1)`` returned 2, 3, ... and gloo
could read a stale peer address. While a wrapped call runs, the ``env``/``tcp`` rendezvous
handlers are wrapped so the store they return is a ``PrefixStore`` under a per-call, per-iteration
namespace: every iteration's keys start empty, whoever keeps the server alive.

Follows: torchelastic, which prefixes the agent's store with ``/worker/attempt_<n>`` for the
same reason.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["namespace_rendezvous", "restore_rendezvous"]

_SCHEMES = ("env", "tcp")
_lock = threading.Lock()
_saved: list[dict[str, Callable[..., Any]]] = []


def _handlers() -> dict[str, Callable[..., Any]] | None:
    # not ``from torch.distributed import rendezvous``: that name is the function, which
    # shadows the module of the same name
    try:
        rdzv = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:
        return None
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    return handlers if isinstance(handlers, dict) else None


def namespace_rendezvous(prefix_fn: Callable[[], str]) -> bool:
    """Wrap the ``env``/``tcp`` handlers: their store gets the prefix ``prefix_fn()`` (called at
    each rendezvous). Undo with :func:`restore_rendezvous`; returns False where torch has no
    handler registry (nothing was changed)."""
    handlers = _handlers()
    if handlers is None:
        return False
    with _lock:
        saved = {s: handlers[s] for s in _SCHEMES if s in handlers}
        _saved.append(saved)
        for scheme, orig in saved.items():
            handlers[scheme] = _wrap(orig, prefix_fn)
    return True


def restore_rendezvous() -> None:
    """Put back the handlers saved by the matching :func:`namespace_rendezvous`."""
    handlers = _handlers()
    with _lock:
        if handlers is None or not _saved:
            return
        handlers.update(_saved.pop())


def _wrap(orig: Callable[..., Iterator[tuple[Any, int, int]]],
          prefix_fn: Callable[[], str]) -> Callable[..., Iterator[tuple[Any, int, int]]]:
    def handler(url: str, *args: Any, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        for store, rank, world_size in orig(url, *args, **kwargs):
            yield dist.PrefixStore(prefix_fn(), store), rank, world_size

    handler.__wrapped__ = orig  # type: ignore[attr-defined]
    return handler
