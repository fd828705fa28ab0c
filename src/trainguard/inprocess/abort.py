"""Abort hooks: run in the monitor thread of every rank when a restart begins.

An abort must unblock the main thread (tear down process groups, kill helper processes). Errors
are logged, never raised.

Follows: NVRx ``inprocess.abort`` (a hook takes a FrozenState and returns it); difference:
:class:`AbortTorchDistributed` also breaks gloo collectives on CPU (NVRx handles NCCL only).
"""

from __future__ import annotations

import abc
import threading

import torch
import torch.distributed as dist

from trainguard._core.logging import get_logger
from trainguard.inprocess import _transport
from trainguard.inprocess.state import FrozenState

__all__ = ["Abort", "AbortTorchDistributed", "AbortTransformerEngine"]

_log = get_logger("trainguard.inprocess")


class Abort(abc.ABC):
    """Base class of abort hooks: ``hook(state) -> state``.

    Runs in the monitor thread of every rank when a restart begins, to unblock the main thread
    (tear down process groups, kill helper processes). Errors are logged, never raised.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


class AbortTorchDistributed(Abort):
    """Unblock collectives and destroy every ``torch.distributed`` process group.

    * every wait of the iteration: ``shutdown(SHUT_RDWR)`` on each connected TCP socket the
      process opened since the iteration began, whoever created it (``CallWrapper.
      init_process_group``, a plain ``init_process_group`` and its TCPStore, a ``new_group`` of
      the user or of a library such as ``AsyncCheckpointer``), and on the per-iteration store
      connection behind ``CallWrapper.store``/``process_group_store``. A blocked gloo
      collective, process-group creation or store wait then raises within milliseconds. The
      listeners and the restart loop's own store connections are left alone.
    * CUDA (NCCL): abort each group's NCCL backend (communicators), in parallel threads.
    * ``destroy_process_group()`` follows in the main thread once it caught the interrupt (the
      restart loop does it); ``destroy=True`` destroys here already, as NVRx does. Destroying
      from this thread while the main thread is still inside DDP's backward can deadlock.

    Runs in the monitor thread; blocks at most ``timeout_s`` seconds per NCCL abort.
    Follows: NVRx ``AbortTorchDistributed``; difference: the gloo transport break.
    """

    def __init__(self, timeout_s: float = 10.0, destroy: bool = False) -> None:
        self.timeout_s = timeout_s
        self.destroy = destroy

    def __call__(self, state: FrozenState) -> FrozenState:
        shut = _transport.release_iteration()
        if dist.is_available() and dist.is_initialized():
            self._abort_nccl()
            if self.destroy:
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a half-broken group may refuse; it is gone
                    _log.debug("destroy_process_group failed", exc_info=True)
        _log.debug("abort: %d sockets of this iteration shut", shut)
        return state

    def _abort_nccl(self) -> None:
        if not torch.cuda.is_available():
            return
        try:
            groups = list(dist.distributed_c10d._world.pg_map.keys())
        except AttributeError:
            groups = [dist.group.WORLD]
        threads = []
        for pg in groups:
            backend = _cuda_backend(pg)
            abort = getattr(backend, "abort", None) or getattr(backend, "_shutdown", None)
            abort = abort if backend is not None else None
            if abort is None:
                continue
            t = threading.Thread(target=abort, name="trainguard-nccl-abort", daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(self.timeout_s)


def _cuda_backend(pg):
    try:
        return pg._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - a group without a CUDA backend
        return None


# NVRx module path ``inprocess.abort.AbortTransformerEngine``; defined in its own module.
from trainguard.inprocess._abort_te import AbortTransformerEngine
