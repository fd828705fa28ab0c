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

__all__ = ["Abort", "AbortTorchDistributed"]

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

    * CPU (gloo): ``shutdown(SHUT_RDWR)`` on the process groups' connected TCP sockets (tracked by
      ``CallWrapper.init_process_group``/``CallWrapper.tracking_process_group``), which makes a
      blocked collective raise within milliseconds; the listener and the store are left alone.
      A gloo group created with a plain ``init_process_group`` (untracked) falls back to the
      connected sockets opened since the iteration began (logged as a warning).
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
        tracked = bool(_transport.tracked_fds())  # none tracked: the group was made elsewhere
        shut = _transport.shutdown_tracked()
        if not tracked and dist.is_available() and dist.is_initialized() and self._gloo_world():
            shut = _transport.shutdown_since_iteration_start()
            _log.warning(
                "abort: the process group was not created through CallWrapper.init_process_group "
                "(or inside CallWrapper.tracking_process_group); shut %d sockets opened in this "
                "iteration to release blocked gloo collectives", shut)
        if dist.is_available() and dist.is_initialized():
            self._abort_nccl()
            if self.destroy:
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a half-broken group may refuse; it is gone
                    _log.debug("destroy_process_group failed", exc_info=True)
        _log.debug("abort: %d sockets shut, process groups destroyed", shut)
        return state

    @staticmethod
    def _gloo_world() -> bool:
        try:
            return dist.get_backend() == "gloo"
        except Exception:  # noqa: BLE001 - a group torn down concurrently
            return False

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
