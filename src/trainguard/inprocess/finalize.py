"""``Finalize`` hook base class.

Runs in the main thread after a fault, before the restart health check. An Exception takes this
rank out (it cannot be trusted to restart).

Follows: NVRx ``inprocess.finalize`` (a hook takes a FrozenState and returns it).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from trainguard._core.clock import as_seconds
from trainguard.errors import ConfigError
from trainguard.inprocess.exceptions import RestartTimeout
from trainguard.inprocess.state import FrozenState

__all__ = ["Finalize", "ThreadedFinalize"]


class Finalize(abc.ABC):
    """Base class of finalize hooks: ``hook(state) -> state``.

    Runs in the main thread after a fault, before the restart health check. An Exception takes
    this rank out (it cannot be trusted to restart).
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


class ThreadedFinalize(Finalize):
    """Run ``fn(*args, **kwargs)`` in a worker thread, waiting at most ``timeout``.

    The worker binds the CUDA device of this rank first (``LOCAL_RANK``, else the current
    device) when CUDA is available, so it creates no context on device 0. A worker that overran
    is left behind as a daemon thread.

    Args:
        timeout: limit (timedelta or seconds, > 0).
        fn: the callable; its return value is ignored.
        args, kwargs: its arguments.

    Raises:
        RestartTimeout: (a ``TimeoutError``) ``fn`` did not return within ``timeout``; as a
            finalize error it takes this rank out.
        Exception: whatever ``fn`` raised, re-raised in the calling thread.
        ConfigError: a non-positive timeout or a non-callable ``fn`` (at construction).

    Follows: NVRx ``finalize.ThreadedFinalize``; difference: works without CUDA (NVRx raises
    RuntimeError on a CPU-only host).
    """

    def __init__(
        self,
        timeout: timedelta | float,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.timeout_s = as_seconds(timeout, "timeout")
        if self.timeout_s <= 0:
            raise ConfigError(f"ThreadedFinalize timeout must be > 0 seconds, got {timeout!r}")
        if not callable(fn):
            raise ConfigError(f"ThreadedFinalize fn must be callable, got {fn!r}")
        self.fn, self.args, self.kwargs = fn, tuple(args), dict(kwargs or {})

    def __repr__(self) -> str:
        return f"ThreadedFinalize(timeout={self.timeout_s}, fn={self.fn!r})"

    def __call__(self, state: FrozenState) -> FrozenState:
        import os
        import threading

        errors: list[BaseException] = []
        local = os.environ.get("LOCAL_RANK", "")

        def target() -> None:
            try:
                if torch.cuda.is_available():
                    torch.cuda.set_device(int(local) if local.isdigit() else
                                          torch.cuda.current_device())
                self.fn(*self.args, **self.kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        worker = threading.Thread(target=target, name="trainguard-finalize", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            raise RestartTimeout(
                f"ThreadedFinalize: {self.fn!r} did not return within {self.timeout_s:.3f} s "
                f"(rank {state.rank}); raise the timeout or make fn bounded"
            )
        if errors:
            raise errors[0]
        return state
