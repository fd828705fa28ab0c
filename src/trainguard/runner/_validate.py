"""Constructor validation for :class:`~trainguard.runner.DistributedRunner` (no process started)."""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

from trainguard._core.clock import as_seconds
from trainguard.errors import ConfigError
from trainguard.runner._transport import TRANSFER_MODES

REQUIRED_METHODS = ("load", "generate", "reset")


def check_world_size(world_size: Any) -> int:
    """Raises ConfigError (a ValueError) unless ``world_size`` is a real ``int`` >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world_size must be an int >= 1 (one process per rank), got {world_size!r} of type "
            f"{type(world_size).__name__}; pass e.g. world_size=2"
        )
    return world_size


def check_worker_cls(worker_cls: Any) -> type:
    """The class must have the three methods and pickle by reference (spawn imports it by name).

    Raises:
        TypeError: not a class, a missing method, or a class defined inside a function/notebook.
    """
    if not isinstance(worker_cls, type):
        raise TypeError(f"worker_cls must be a class (not an instance), got {worker_cls!r}")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(worker_cls, m, None))]
    if missing:
        raise TypeError(f"worker class {worker_cls.__qualname__} lacks method(s) "
                        f"{', '.join(missing)}; a worker needs load(), generate() and reset()")
    where = f"{worker_cls.__module__}.{worker_cls.__qualname__}"
    if "<locals>" in worker_cls.__qualname__:
        raise TypeError(f"worker class {where} is defined inside a function; spawned ranks "
                        "import it by name, so define it at module top level")
    try:
        pickle.loads(pickle.dumps(worker_cls))
    except Exception as exc:
        raise TypeError(f"worker class {where} cannot be pickled by reference ({exc}); define it "
                        "at module top level in an importable module (not a notebook)") from exc
    return worker_cls


def check_load_kwargs(load_kwargs: Any) -> dict[str, Any]:
    """Pickle every value up front so a bad one fails here, naming its key.

    Raises:
        TypeError: not a mapping with str keys, or a value that cannot be pickled.
    """
    if load_kwargs is None:
        return {}
    if not isinstance(load_kwargs, dict) or not all(isinstance(k, str) for k in load_kwargs):
        raise TypeError(f"load_kwargs must be a dict with str keys, got {load_kwargs!r}")
    for key, value in load_kwargs.items():
        try:
            pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise TypeError(f"load_kwargs[{key!r}] cannot be pickled for the spawned ranks "
                            f"({type(exc).__name__}: {exc}); pass plain data (paths, numbers, "
                            "dataclasses) and build heavy objects inside load()") from exc
    return dict(load_kwargs)


def check_timeout(value: float | timedelta, name: str) -> float:
    """Seconds > 0, from a number or ``timedelta``. Raises ConfigError / TypeError."""
    seconds = as_seconds(value, name)
    if not seconds > 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")
    return seconds


def check_options(transfer: Any, shm_bytes: Any) -> None:
    """Raises ConfigError for an unknown transfer mode or a negative reservation."""
    if transfer not in TRANSFER_MODES:
        raise ConfigError(f"transfer must be one of {TRANSFER_MODES}, got {transfer!r}")
    if isinstance(shm_bytes, bool) or not isinstance(shm_bytes, int) or shm_bytes < 0:
        raise ConfigError(f"shm_bytes must be an int >= 0 (bytes reserved up front), "
                          f"got {shm_bytes!r}")
