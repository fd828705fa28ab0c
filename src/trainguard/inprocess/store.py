"""NVRx module path ``inprocess.store``: store classes for ``Wrapper(store_factory=...)``.

* :class:`StoreMixin`: base class NVRx code derives custom store factories from.
* :class:`TCPStore`: a ``torch.distributed.TCPStore`` whose arguments default from the
  environment as NVRx's does (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, host on
  ``RANK == 0``). Rank 0 hosts it in its own process: unlike trainguard's default store (hosted
  by the monitor process of initial rank 0), it dies with rank 0's trainer.
* :class:`FileStore`, :class:`PrefixStore`: the torch classes (FileStore with the mixin).
* The barrier errors, as in NVRx's module.

Follows: NVRx ``inprocess.store``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.inprocess.exceptions import BarrierError, BarrierOverflow, BarrierTimeout

__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FileStore",
    "PrefixStore",
    "StoreMixin",
    "TCPStore",
]

PrefixStore = dist.PrefixStore


class StoreMixin:
    """Marker base of store classes usable as ``Wrapper(store_factory=...)``.

    A factory is called as ``factory(**store_kwargs)`` in the trainer process; the result must
    be a ``torch.distributed.Store`` that other processes of the job can reach (TCP or file).
    """


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} must be an integer") from exc


class TCPStore(StoreMixin, dist.TCPStore):
    """``torch.distributed.TCPStore`` with NVRx's environment defaults.

    Args:
        host_name: default ``MASTER_ADDR`` (else ``localhost``).
        port: default ``MASTER_PORT`` (required one way or the other).
        world_size: default ``WORLD_SIZE`` (None: not checked).
        is_master: default ``RANK == 0``.
        timeout: store operation timeout (timedelta, default 300 s).
        wait_for_workers: the host waits for ``world_size`` clients at construction.
        multi_tenant, use_libuv: as torch's TCPStore.

    Blocks up to ``timeout`` connecting (client) or waiting for workers (host).

    Raises:
        ConfigError: no port given and ``MASTER_PORT`` unset, or a non-integer variable.
        RuntimeError / DistStoreError: torch could not bind or connect.
    """

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        is_master: bool | None = None,
        timeout: timedelta = timedelta(seconds=300),
        wait_for_workers: bool = False,
        multi_tenant: bool = False,
        use_libuv: bool = True,
    ) -> None:
        host = host_name or os.environ.get("MASTER_ADDR", "localhost")
        port = port if port is not None else _env_int("MASTER_PORT", None)
        if port is None:
            raise ConfigError("TCPStore needs a port: pass port=... or set MASTER_PORT")
        if world_size is None:
            world_size = _env_int("WORLD_SIZE", None)
        if is_master is None:
            is_master = _env_int("RANK", 0) == 0
        super().__init__(
            host, port, world_size, is_master, timeout=timeout,
            wait_for_workers=wait_for_workers, multi_tenant=multi_tenant, use_libuv=use_libuv,
        )


class FileStore(StoreMixin, dist.FileStore):
    """``torch.distributed.FileStore`` (a shared file; ``world_size=-1``: any number of users)."""

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        super().__init__(file_name, world_size)
