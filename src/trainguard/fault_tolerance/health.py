"""Node health checks run by the launcher before every cycle (and, multi-node, every round).

A check is any object with a ``name`` and a ``check()`` returning ``(ok, reason)``
(:class:`HealthCheck`). :func:`run_health_checks` runs a list of them concurrently against one
deadline and returns a :class:`HealthReport`; a check that raises or does not finish in time
counts as failed. Defaults (:func:`default_checks`):

* CPU, always: free disk space and writability of the log and checkpoint directories, free
  memory.
* CUDA, only when this node has NVIDIA devices *and* torch sees CUDA: at least
  ``--nproc-per-node`` devices and a tiny kernel on each, in a short-lived child process (the
  launcher itself never holds a CUDA context). A node without a GPU never fails for that.
* ``--ft-health-check module:function,...``: user hooks (:func:`load_user_check`).

A node that fails a check does not start its workers: on one node the launcher exits with
:data:`~trainguard.fault_tolerance.errors.EXIT_UNHEALTHY` (requeue-OK); in a multi-node job the
rendezvous lets it leave without closing the round, so a spare can take its place.

Follows: NVRx ``inprocess.health_check`` (CUDA/NIC checks) and ``ft_launcher``'s pre-rendezvous
node check; differences: checks are plain objects with a ``(ok, reason)`` result, every check
runs under a deadline, and CUDA is probed in a child process.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import psutil

from trainguard._core.clock import Deadline
from trainguard._core.procs import terminate_processes
from trainguard.fault_tolerance.errors import LaunchConfigError

__all__ = [
    "CudaCheck",
    "DiskSpaceCheck",
    "FreeMemoryCheck",
    "HealthCheck",
    "HealthReport",
    "HealthResult",
    "WritableDirCheck",
    "as_probe",
    "default_checks",
    "launch_checks",
    "load_user_check",
    "run_health_checks",
]

MIN_FREE_DISK_BYTES = 256 * 2**20
MIN_FREE_MEMORY_BYTES = 256 * 2**20


@runtime_checkable
class HealthCheck(Protocol):
    """One node health check.

    ``check()`` returns ``(True, '')`` when healthy, ``(False, reason)`` otherwise; it is called
    from a worker thread of :func:`run_health_checks`, should finish in well under its timeout,
    and may raise (counted as a failure with the exception as the reason).
    """

    name: str

    def check(self) -> tuple[bool, str]: ...


@dataclasses.dataclass(frozen=True)
class HealthResult:
    """Outcome of one check: ``elapsed_s`` in seconds (the timeout when it did not finish)."""

    name: str
    ok: bool
    reason: str
    elapsed_s: float


@dataclasses.dataclass(frozen=True)
class HealthReport:
    """Outcome of one :func:`run_health_checks` call; ``ok`` only when every check passed."""

    results: tuple[HealthResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[HealthResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    def summary(self) -> str:
        """One line: ``name: reason; ...`` of the failed checks ('' when healthy)."""
        return "; ".join(f"{r.name}: {r.reason}" for r in self.failures)


@dataclasses.dataclass
class DiskSpaceCheck:
    """At least ``min_free_bytes`` free on the filesystem holding ``path`` (or its nearest
    existing parent)."""

    path: str
    min_free_bytes: int = MIN_FREE_DISK_BYTES
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"disk_space({self.path})"

    def check(self) -> tuple[bool, str]:
        free = shutil.disk_usage(_existing(self.path)).free
        if free < self.min_free_bytes:
            return False, (f"{free / 2**20:.0f} MiB free, need {self.min_free_bytes / 2**20:.0f} "
                           "MiB: free space or point the directory elsewhere")
        return True, ""


@dataclasses.dataclass
class WritableDirCheck:
    """``path`` exists (created if missing) and a small file can be written, synced and removed
    there."""

    path: str
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"writable({self.path})"

    def check(self) -> tuple[bool, str]:
        try:
            os.makedirs(self.path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tg_health_", dir=self.path)
            try:
                os.write(fd, b"trainguard health check\n")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(tmp)
        except OSError as exc:
            return False, f"not writable: {exc.strerror or exc}"
        return True, ""


@dataclasses.dataclass
class FreeMemoryCheck:
    """At least ``min_available_bytes`` of memory available (``psutil`` ``available``)."""

    min_available_bytes: int = MIN_FREE_MEMORY_BYTES
    name: str = "free_memory"

    def check(self) -> tuple[bool, str]:
        avail = psutil.virtual_memory().available
        if avail < self.min_available_bytes:
            return False, (f"{avail / 2**20:.0f} MiB available, need "
                           f"{self.min_available_bytes / 2**20:.0f} MiB")
        return True, ""


_CUDA_PROBE = """
import json, sys
import torch
if not torch.cuda.is_available():
    print(json.dumps({"available": False})); sys.exit(0)
n = torch.cuda.device_count()
bad = []
for i in range(n):
    try:
        x = torch.arange(1024, device=f"cuda:{i}", dtype=torch.float32)
        if float((x * 2).sum().item()) != 1023.0 * 1024.0:
            bad.append(f"cuda:{i}: wrong result")
        torch.cuda.synchronize(i)
    except Exception as exc:
        bad.append(f"cuda:{i}: {type(exc).__name__}: {str(exc)[:200]}")
print(json.dumps({"available": True, "count": n, "bad": bad}))
"""


@dataclasses.dataclass
class CudaCheck:
    """At least ``min_devices`` CUDA devices and a tiny kernel on each, probed in a child process
    (killed after ``timeout_s`` seconds). Healthy when torch sees no CUDA at all."""

    min_devices: int
    timeout_s: float = 60.0
    name: str = "cuda"

    def check(self) -> tuple[bool, str]:
        import json

        proc = subprocess.Popen([sys.executable, "-c", _CUDA_PROBE], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            terminate_processes([proc], grace_s=1.0)
            return False, f"CUDA probe did not finish within {self.timeout_s:.0f} s"
        if proc.returncode != 0:
            return False, f"CUDA probe exited {proc.returncode}: {err.strip()[-300:]}"
        data = json.loads(out.strip().splitlines()[-1])
        if not data["available"]:
            return True, ""
        if data["count"] < self.min_devices:
            return False, (f"{data['count']} CUDA device(s) visible, --nproc-per-node needs "
                           f"{self.min_devices}")
        if data["bad"]:
            return False, "; ".join(data["bad"])
        return True, ""


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def has_nvidia_devices() -> bool:
    """True when ``/dev/nvidia<N>`` device files exist (cheap: no torch, no CUDA init)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def default_checks(dirs: Sequence[str], nproc_per_node: int) -> list[HealthCheck]:
    """Disk space and writability of each of ``dirs``, free memory, and :class:`CudaCheck`
    when :func:`has_nvidia_devices`."""
    checks: list[HealthCheck] = []
    for d in dict.fromkeys(os.path.abspath(d) for d in dirs if d):
        checks += [DiskSpaceCheck(d), WritableDirCheck(d)]
    checks.append(FreeMemoryCheck())
    if has_nvidia_devices():
        checks.append(CudaCheck(nproc_per_node))
    return checks


def launch_checks(health_check: str, dirs: Sequence[str], nproc_per_node: int
                  ) -> list[HealthCheck]:
    """The checks ``trainguard launch`` runs: ``--ft-health-check off`` -> none; otherwise
    :func:`default_checks` plus every ``module:function`` of the comma-separated list.

    Raises:
        LaunchConfigError: a user check cannot be loaded (see :func:`load_user_check`).
    """
    text = health_check.strip()
    if text.lower() in ("off", "none", "false", "0"):
        return []
    user = [load_user_check(part) for part in text.split(",") if part.strip()]
    return default_checks(dirs, nproc_per_node) + user


class _CallableCheck:
    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name, self._fn = name, fn

    def check(self) -> tuple[bool, str]:
        out = self._fn()
        if out is None or out is True:
            return True, ""
        if out is False:
            return False, "returned False"
        if isinstance(out, tuple) and len(out) == 2:
            return bool(out[0]), str(out[1])
        return False, f"returned {out!r}; return None/True, False or (ok, reason)"


def load_user_check(spec: str) -> HealthCheck:
    """Load ``module:function`` (a zero-argument callable returning ``None``/``True``,
    ``False`` or ``(ok, reason)``; raising means unhealthy) or ``module:object`` with a
    ``check()`` method. Imports the module (runs its top level once).

    Raises:
        LaunchConfigError: not ``module:attr``, the module cannot be imported, or the attribute
            is missing or not callable.
    """
    mod_name, sep, attr = spec.strip().partition(":")
    if not sep or not mod_name or not attr:
        raise LaunchConfigError(f"--ft-health-check {spec!r}: expected module:function")
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is bad input here
        raise LaunchConfigError(f"--ft-health-check {spec!r}: cannot import {mod_name!r} "
                                f"({type(exc).__name__}: {exc}); check PYTHONPATH") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise LaunchConfigError(f"--ft-health-check {spec!r}: {mod_name} has no {attr!r}")
    if isinstance(obj, HealthCheck):
        return obj
    if not callable(obj):
        raise LaunchConfigError(f"--ft-health-check {spec!r}: {attr!r} is not callable")
    return _CallableCheck(spec.strip(), obj)


def run_health_checks(checks: Sequence[HealthCheck], timeout_s: float) -> HealthReport:
    """Run ``checks`` concurrently, each in a named daemon thread, against one deadline.

    Blocks at most ``timeout_s`` seconds. A check still running at the deadline is reported as
    failed ("did not finish") and its thread is abandoned (a thread cannot be killed; the
    launcher treats the node as unhealthy and exits, which ends it). Never raises for a failing
    check.

    Raises:
        ValueError: ``timeout_s`` is not > 0.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    deadline = Deadline(timeout_s)
    results: dict[int, HealthResult] = {}
    threads = []
    for i, chk in enumerate(checks):
        t = threading.Thread(target=_run_one, args=(chk, i, results), daemon=True,
                             name=f"tg-health-{getattr(chk, 'name', i)}")
        t.start()
        threads.append(t)
    for t in threads:
        t.join(deadline.remaining())
    out = []
    for i, chk in enumerate(checks):
        name = str(getattr(chk, "name", f"check{i}"))
        out.append(results.get(i) or HealthResult(
            name, False, f"did not finish within {timeout_s:g} s", timeout_s))
    return HealthReport(tuple(out))


def as_probe(checks: Sequence[HealthCheck], timeout_s: float) -> Callable[[], str]:
    """One callable that runs ``checks`` (:func:`run_health_checks`, at most ``timeout_s``
    seconds) and returns ``''`` when healthy, else the one-line :meth:`HealthReport.summary`:
    the shape of a pre-join hook of the multi-node rendezvous (non-empty = unhealthy)."""
    def probe() -> str:
        return run_health_checks(checks, timeout_s).summary()

    return probe


def _run_one(chk: HealthCheck, i: int, results: dict[int, HealthResult]) -> None:
    t0 = time.monotonic()
    name = str(getattr(chk, "name", f"check{i}"))
    try:
        ok, reason = chk.check()
    except Exception as exc:  # noqa: BLE001 - a raising check is an unhealthy node
        ok, reason = False, f"raised {type(exc).__name__}: {exc}"
    results[i] = HealthResult(name, bool(ok), str(reason), time.monotonic() - t0)
