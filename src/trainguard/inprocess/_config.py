"""Validated settings of a :class:`~trainguard.inprocess.Wrapper` (internal: float seconds)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard._core.clock import as_seconds
from trainguard.errors import ConfigError

__all__ = ["DEFAULTS", "WrapperConfig", "validate"]

Duration = timedelta | float | int

#: Defaults in seconds, chosen for sub-second restarts (see ``Wrapper`` docstring).
DEFAULTS: dict[str, float] = {
    "monitor_thread_interval": 0.5,
    "monitor_process_interval": 0.1,
    "heartbeat_interval": 1.0,
    "progress_watchdog_interval": 0.1,
    "soft_timeout": 60.0,
    "hard_timeout": 90.0,
    "heartbeat_timeout": 30.0,
    "barrier_timeout": 120.0,
    "completion_timeout": 120.0,
    "last_call_wait": 0.05,
    "termination_grace_time": 5.0,
}


@dataclasses.dataclass(frozen=True)
class WrapperConfig:
    store_factory: Callable[..., Any] | None
    store_kwargs: dict
    initialize: Callable | None
    abort: Callable | None
    finalize: Callable | None
    health_check: Callable | None
    rank_assignment: Callable
    completion: Callable | None
    terminate: Callable | None
    monitor_thread_interval_s: float
    monitor_process_interval_s: float
    heartbeat_interval_s: float
    progress_watchdog_interval_s: float
    soft_timeout_s: float
    hard_timeout_s: float
    heartbeat_timeout_s: float
    barrier_timeout_s: float
    completion_timeout_s: float
    last_call_wait_s: float
    termination_grace_time_s: float
    monitor_process_logfile: str | None
    monitor_process_pidfile: str | None

    @property
    def wait_chunk_s(self) -> float:
        """Chunk of the trainer's store waits: keeps stamps fresh well inside soft_timeout."""
        return min(self.progress_watchdog_interval_s * 2, self.soft_timeout_s / 4, 0.5)

    @property
    def collective_grace_s(self) -> float:
        """Extra wait before a rank blocked in a collective reports its own soft timeout."""
        return min(max(1.0, 4 * self.monitor_process_interval_s),
                   (self.hard_timeout_s - self.soft_timeout_s) / 2)

    @property
    def undelivered_grace_s(self) -> float:
        """Seconds after a soft timeout, and of the trainer's watchdog thread being silent (the
        main thread holds the GIL, or the process is stopped: the interrupt cannot be taken),
        before the monitor process kills the rank without waiting for ``hard_timeout``."""
        return min(max(0.5, 10 * self.progress_watchdog_interval_s),
                   self.hard_timeout_s - self.soft_timeout_s)


def _check(cond: bool, text: str, **values: float) -> None:
    if not cond:
        shown = ", ".join(f"{k}={v!r} s" for k, v in values.items())
        raise ConfigError(f"Wrapper: need {text}, got {shown}")


def _hook(name: str, value: Any) -> Callable | None:
    if value is not None and not callable(value):
        raise TypeError(f"Wrapper: {name} must be callable or None, got {value!r}")
    return value


def _path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"Wrapper: {name} must be a path string or None, got {value!r}")
    text = os.fspath(value)
    if not os.path.isabs(text):
        raise ConfigError(f"Wrapper: {name} must be an absolute path, got {text!r}")
    return text


def validate(durations: Mapping[str, Duration], hooks: Mapping[str, Any],
             store_factory: Any, store_kwargs: Any, logfile: Any, pidfile: Any) -> WrapperConfig:
    """Check types and timing invariants.

    Raises:
        TypeError: a duration is not a timedelta/number, a hook is not callable, a path is not
            a string, ``store_kwargs`` is not a mapping.
        ConfigError (a ValueError): a timing invariant is violated (the message names the
            condition and the values), a path is relative, torch.distributed is unavailable.
    """
    s = {name: as_seconds(v, name) for name, v in durations.items()}
    for name, v in s.items():
        if name in ("last_call_wait", "termination_grace_time"):
            _check(v >= 0, f"{name} >= 0", **{name: v})
        else:
            _check(v > 0, f"{name} > 0", **{name: v})
    _check(s["soft_timeout"] < s["hard_timeout"] < s["barrier_timeout"],
           "soft_timeout < hard_timeout < barrier_timeout",
           soft_timeout=s["soft_timeout"], hard_timeout=s["hard_timeout"],
           barrier_timeout=s["barrier_timeout"])
    _check(s["heartbeat_interval"] < s["heartbeat_timeout"] < s["barrier_timeout"],
           "heartbeat_interval < heartbeat_timeout < barrier_timeout",
           heartbeat_interval=s["heartbeat_interval"], heartbeat_timeout=s["heartbeat_timeout"],
           barrier_timeout=s["barrier_timeout"])
    limit = min(s["barrier_timeout"], s["heartbeat_timeout"], s["soft_timeout"])
    _check(s["monitor_process_interval"] < limit,
           "monitor_process_interval < min(barrier_timeout, heartbeat_timeout, soft_timeout)",
           monitor_process_interval=s["monitor_process_interval"], min_of_those=limit)
    for name in ("monitor_thread_interval", "progress_watchdog_interval"):
        _check(s[name] < s["soft_timeout"], f"{name} < soft_timeout",
               **{name: s[name], "soft_timeout": s["soft_timeout"]})
    if store_factory is not None and not callable(store_factory):
        raise TypeError(f"Wrapper: store_factory must be callable or None, got {store_factory!r}")
    if store_kwargs is not None and not isinstance(store_kwargs, Mapping):
        raise TypeError(f"Wrapper: store_kwargs must be a mapping or None, got {store_kwargs!r}")
    if not dist.is_available():
        raise ConfigError("Wrapper: torch.distributed is not available in this torch build")
    checked = {name: _hook(name, h) for name, h in hooks.items()}
    if checked["rank_assignment"] is None:
        raise TypeError("Wrapper: rank_assignment must be callable")
    return WrapperConfig(
        store_factory=store_factory,
        store_kwargs=dict(store_kwargs or {}),
        **checked,
        **{f"{name}_s": v for name, v in s.items()},
        monitor_process_logfile=_path("monitor_process_logfile", logfile),
        monitor_process_pidfile=_path("monitor_process_pidfile", pidfile),
    )
