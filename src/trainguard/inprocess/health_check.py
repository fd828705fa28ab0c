"""Health checks: each takes a FrozenState, returns it, and raises ``HealthCheckError`` if bad.

No GPU present means "not applicable", never "unhealthy": every check here passes on a CPU-only
host, so the default chain is safe to install everywhere.

Follows: NVRx ``inprocess.health_check`` (CudaHealthCheck, FaultCounter, chained NIC check);
differences: missing hardware (no CUDA, no InfiniBand, no NVML) is "not applicable" rather than a
failure (spec defect 7), the CUDA worker thread binds its device, and failures name what failed.
"""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch

from trainguard._core.clock import as_seconds
from trainguard._core.logging import get_logger
from trainguard.errors import ConfigError
from trainguard.inprocess.compose import Compose
from trainguard.inprocess.exceptions import FaultCounterExceeded, HealthCheckError
from trainguard.inprocess.state import FrozenState

__all__ = [
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "CudaHealthCheck",
    "FaultCounter",
    "HealthCheck",
    "NicHealthCheck",
    "default_health_check",
]

_log = get_logger("trainguard.inprocess.health_check")


class HealthCheck(abc.ABC):
    """Base class of health checks: ``check(state) -> state``; raise ``HealthCheckError`` when
    unhealthy.

    A check runs before the wrapped function in every iteration and again after a fault (the
    restart health check); there a raise takes this rank out and the others continue.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


def _seconds(value: timedelta | float, name: str) -> float:
    seconds = as_seconds(value, name)
    if seconds <= 0:
        raise ConfigError(f"{name} must be > 0 seconds, got {seconds}")
    return seconds


def run_bounded(fn: Callable[[], object], timeout_s: float, what: str) -> None:
    """Run ``fn`` in a daemon worker thread and wait at most ``timeout_s`` seconds for it.

    A hung ``fn`` (e.g. a CUDA synchronize on a wedged device) is left behind in its daemon
    thread; the caller gets an error instead of hanging.

    Raises:
        HealthCheckError: ``fn`` raised (chained), or did not return within ``timeout_s``.
    """
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append(exc)

    worker = threading.Thread(target=target, name=f"trainguard-health-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise HealthCheckError(f"{what} did not finish within {timeout_s:.3f} s")
    if errors:
        raise HealthCheckError(f"{what} failed: {errors[0]!r}") from errors[0]


class CudaHealthCheck(HealthCheck):
    """Synchronize this rank's CUDA device in a worker thread with a timeout, then again in the
    caller so sticky CUDA errors surface. Without CUDA the check does nothing (not applicable).

    The worker thread sets the device first, so it creates no context on device 0.

    Args:
        timeout: limit for the worker's synchronize (timedelta or seconds).
        device: CUDA device index; None means ``LOCAL_RANK`` if set, else the current device.

    Raises:
        HealthCheckError: the synchronize raised or timed out (message names the device).
        ConfigError: a non-positive timeout (at construction).
    """

    def __init__(
        self, timeout: timedelta | float = timedelta(seconds=30), device: int | None = None
    ):
        self.timeout_s = _seconds(timeout, "timeout")
        self.device = device

    def __repr__(self) -> str:
        return f"CudaHealthCheck(timeout={self.timeout_s}, device={self.device})"

    def _device_index(self) -> int:
        if self.device is not None:
            return int(self.device)
        local = os.environ.get("LOCAL_RANK", "")
        return int(local) if local.isdigit() else torch.cuda.current_device()

    def __call__(self, state: FrozenState) -> FrozenState:
        if not torch.cuda.is_available():
            return state
        device = self._device_index()
        what = f"CUDA synchronize on cuda:{device} (rank {state.rank})"

        def sync() -> None:
            torch.cuda.set_device(device)
            torch.cuda.synchronize(device)

        run_bounded(sync, self.timeout_s, what)
        try:
            torch.cuda.synchronize(device)
        except Exception as exc:  # a sticky error from earlier work on this device
            raise HealthCheckError(f"{what} in the calling thread failed: {exc!r}") from exc
        return state


class NicHealthCheck(HealthCheck):
    """InfiniBand ``link_downed`` counters must not grow between two checks.

    Reads ``<sysfs_root>/<device>/ports/<port>/counters/link_downed``. The first call records a
    baseline; a later call fails if any counter grew since the previous call. A host without
    InfiniBand (no such files) passes: not applicable.

    Args:
        devices: device names to watch (e.g. ``["mlx5_0"]``); None watches all.
        sysfs_root: where the IB devices are listed.

    Raises:
        HealthCheckError: a link went down since the previous check (names device and port).
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        sysfs_root: str | os.PathLike = "/sys/class/infiniband",
    ) -> None:
        self.devices = None if devices is None else list(devices)
        self.sysfs_root = Path(sysfs_root)
        self._last: dict[str, int] | None = None

    def __repr__(self) -> str:
        return f"NicHealthCheck(devices={self.devices}, sysfs_root={str(self.sysfs_root)!r})"

    def read_counters(self) -> dict[str, int]:
        """``{"<device> port <n>": link_downed}`` for every readable counter."""
        out: dict[str, int] = {}
        for counter in sorted(self.sysfs_root.glob("*/ports/*/counters/link_downed")):
            device, port = counter.parts[-5], counter.parts[-3]
            if self.devices is not None and device not in self.devices:
                continue
            try:
                out[f"{device} port {port}"] = int(counter.read_text().strip())
            except (OSError, ValueError):
                _log.debug("unreadable IB counter %s; skipped", counter)
        return out

    def __call__(self, state: FrozenState) -> FrozenState:
        now = self.read_counters()
        last, self._last = self._last, now
        if last is None:
            return state
        grown = [
            f"{k}: link_downed {last[k]} -> {v}"
            for k, v in now.items()
            if k in last and v > last[k]
        ]
        if grown:
            raise HealthCheckError(
                f"InfiniBand link went down since the last check on rank {state.rank}: "
                + "; ".join(grown)
            )
        return state


class FaultCounter(HealthCheck):
    """Count this rank's own faults (iterations whose ``fn_exception`` is set) and give up past
    ``max_rank_faults``.

    Each fault is counted once even if the check runs several times in one iteration. The count
    persists across Wrapper calls using this instance; :meth:`reset` clears it.

    Args:
        max_rank_faults: faults allowed; the next one raises. None means unlimited.

    Raises:
        FaultCounterExceeded: this rank faulted more than ``max_rank_faults`` times.
        ConfigError: ``max_rank_faults`` is not None or an int >= 0 (at construction).
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        if max_rank_faults is not None and (
            isinstance(max_rank_faults, bool)
            or not isinstance(max_rank_faults, int)
            or max_rank_faults < 0
        ):
            raise ConfigError(
                f"max_rank_faults must be None or an int >= 0, got {max_rank_faults!r}"
            )
        self.max_rank_faults = max_rank_faults
        self.faults = 0
        self._last: tuple[int, int] | None = None  # (iteration, id(exception)): no reference kept

    def __repr__(self) -> str:
        return f"FaultCounter(max_rank_faults={self.max_rank_faults})"

    def reset(self) -> None:
        self.faults, self._last = 0, None

    def __call__(self, state: FrozenState) -> FrozenState:
        exc = state.fn_exception
        if exc is None:
            return state
        mark = (state.iteration, id(exc))
        if mark != self._last:
            self._last = mark
            self.faults += 1
        if self.max_rank_faults is not None and self.faults > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"rank {state.rank} (initial rank {state.initial_rank}) faulted {self.faults} "
                f"times, more than max_rank_faults={self.max_rank_faults}; last fault: {exc!r}"
            )
        return state


def default_health_check(
    timeout: timedelta | float = timedelta(seconds=30), device: int | None = None
) -> Compose:
    """The automatic restart health chain, safe on every host.

    NIC (``link_downed``) first, then CUDA synchronize where CUDA is available (on a CPU-only
    host the chain is the NIC check alone, which passes without InfiniBand). Compose user checks
    in front: ``Compose(*user_checks, *default_health_check().instances)`` runs NIC, CUDA, user.
    """
    checks: list[HealthCheck] = [NicHealthCheck()]
    if torch.cuda.is_available():
        checks.insert(0, CudaHealthCheck(timeout, device))
    return Compose(*checks)


class ChainedGPUHealthCheck(CudaHealthCheck):
    """The GPU stage of the automatic restart health chain, for one device.

    Synchronizes ``cuda:device_index`` with a timeout (see :class:`CudaHealthCheck`); a host
    without CUDA passes (not applicable).

    Args:
        device_index: CUDA device index (the Wrapper passes ``LOCAL_RANK``).
        timeout: limit for the synchronize (timedelta or seconds, default 30 s).

    Raises:
        HealthCheckError: the synchronize raised or timed out.

    Follows: NVRx ``health_check.ChainedGPUHealthCheck`` (same name and ``device_index``);
    difference: NVRx asks NVML for a recovery action and fails on hosts without a driver.
    """

    def __init__(self, device_index: int, timeout: timedelta | float = timedelta(seconds=30)):
        super().__init__(timeout, device_index)
        self.device_index = device_index

    def __repr__(self) -> str:
        return f"ChainedGPUHealthCheck(device_index={self.device_index})"


class ChainedNVLHealthCheck(HealthCheck):
    """The NVLink stage of the automatic restart health chain: reports, never fails.

    With NVML available (``pynvml``) it logs a WARNING for each NVLink of ``device_index`` that
    reports inactive; without NVML or CUDA it does nothing. Blocks for the NVML queries only.

    Follows: NVRx ``health_check.ChainedNVLHealthCheck``, whose result is ignored there too.
    """

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index

    def __repr__(self) -> str:
        return f"ChainedNVLHealthCheck(device_index={self.device_index})"

    def __call__(self, state: FrozenState) -> FrozenState:
        if not torch.cuda.is_available():
            return state
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            down = []
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        down.append(link)
                except pynvml.NVMLError:
                    continue
            if down:
                _log.warning("NVLink check: links %s of cuda:%d are inactive (rank %s)",
                             down, self.device_index, state.rank)
        except Exception:  # noqa: BLE001 - no NVML: not applicable, as documented
            _log.debug("NVLink check skipped (NVML unavailable)", exc_info=True)
        return state


ChainedNicHealthCheck = NicHealthCheck
"""Alias of :class:`NicHealthCheck` under NVRx's name (same behaviour)."""
