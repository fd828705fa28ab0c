"""``Wrapper`` (the in-process restart decorator) and ``CallWrapper`` (its per-call handle).

Follows: NVRx ``inprocess.Wrapper``/``CallWrapper``. Differences: default hooks are created per
Wrapper; defaults aim at sub-second restarts; the CPU abort breaks gloo collectives; hangs in C
calls are interrupted with a signal; the default TCPStore lives in the monitor process of initial
rank 0 (it survives that rank's trainer); each call uses its own key namespace, so a persistent
store serves any number of calls; restart latency is recorded per restart.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard._core.clock import as_seconds
from trainguard._core.hooks import restart_loop
from trainguard._core.logging import get_logger
from trainguard._core.store import StoreBarrierTimeout, reentrant_barrier
from trainguard.inprocess import _coord as co
from trainguard.inprocess import _pg_guard, _rendezvous, _transport
from trainguard.inprocess._config import DEFAULTS, Duration, WrapperConfig, validate
from trainguard.inprocess._loop import LoopMixin, Outcome, env_restore, env_snapshot
from trainguard.inprocess._monitor_process import MonitorConfig, MonitorProcess
from trainguard.inprocess._monitor_thread import Interrupter
from trainguard.inprocess._watchdog import Phase, ProgressBlock, ProgressWatchdog
from trainguard.inprocess.abort import AbortTorchDistributed
from trainguard.inprocess.compose import Compose
from trainguard.inprocess.exceptions import BarrierTimeout
from trainguard.inprocess.health_check import ChainedGPUHealthCheck, ChainedNVLHealthCheck
from trainguard.inprocess.state import FrozenState, Mode, State

__all__ = ["CallWrapper", "RestartRecord", "Wrapper"]

RestartRecord = co.RestartRecord
log = get_logger("trainguard.inprocess")
_DEFAULT: Any = object()


def _default_rank_assignment() -> Callable:
    from trainguard.inprocess.rank_assignment import default_rank_assignment

    return default_rank_assignment()  # a fresh Compose(ActivateAllRanks(), ShiftRanks())


class Wrapper:
    """Decorator: run the wrapped function under in-process restart.

    Use as ``@Wrapper``, ``@Wrapper()`` or ``@Wrapper(soft_timeout=...)``.

    Each call of the decorated function is one *call*: ranks (``RANK``/``WORLD_SIZE`` from the
    environment) meet at an initial barrier, then run iterations. An ``Exception`` on any rank
    restarts every rank in-process (``iteration += 1``); a ``BaseException`` (``SystemExit``,
    ``RestartAbort``, a failed ``finalize`` or restart health check) takes that rank out and
    the survivors restart without it. The call returns ``fn``'s value on active ranks and
    ``None`` on inactive (reserve) ranks.

    Args (keyword-only; durations are ``timedelta`` or float seconds):
        store_factory: ``store_factory(**store_kwargs)`` gives the coordination store (must be
            reachable from another process: TCPStore, FileStore). Default: a TCPStore hosted
            by the monitor process of initial rank 0 at ``store_kwargs['host']`` or
            ``MASTER_ADDR`` (else 127.0.0.1), port ``store_kwargs['port']``, else env
            ``TRAINGUARD_STORE_PORT``, else ``MASTER_PORT + 1``.
        store_kwargs: arguments of the factory (default store: host, port, timeout).
        initialize: hook run at the start of every iteration.
        abort: hook run in the monitor thread when a restart begins. Default: a new
            :class:`AbortTorchDistributed` (breaks gloo sockets / aborts NCCL, destroys groups).
        finalize: hook run after a fault, before the restart health check; raising exits.
        health_check: hook run before ``fn`` each iteration (raising restarts) and after a
            fault (raising exits).
        rank_assignment: default ``Compose(ActivateAllRanks(), ShiftRanks())`` (new instances).
        completion: hook run after success (errors logged). terminate: hook run when this rank
            leaves through a BaseException (errors propagate).
        monitor_thread_interval: wait chunk of the monitor thread (0.5 s).
        monitor_process_interval: deadline-check cadence of the monitor process (0.1 s).
        heartbeat_interval / heartbeat_timeout: sibling heartbeat (1 s / 30 s).
        progress_watchdog_interval: automatic heartbeat cadence (0.1 s).
        soft_timeout: no progress -> interrupt and restart (60 s).
        hard_timeout: no progress -> kill the rank (SIGCONT, SIGTERM, grace, SIGKILL) (90 s).
            A rank whose interrupt cannot be taken (its main thread holds the GIL, or it is
            stopped: its watchdog thread is silent) is killed sooner: once the soft timeout
            has fired and that thread has been silent for ``max(0.5 s, 10 x
            progress_watchdog_interval)`` (at most ``hard_timeout``).
            Size both to the step time: e.g. soft 1-1.5 s and hard 2.5-3 s for a 50 ms step
            (20-30 steps without progress); the defaults suit steps up to a few seconds.
        barrier_timeout: initial/iteration/termination barriers (120 s).
        completion_timeout: completion barrier after ``fn`` returns (120 s).
        last_call_wait: time to collect concurrent faults before aborting (0.05 s).
        termination_grace_time: SIGTERM -> SIGKILL gap on a hard timeout (5 s).
        monitor_process_logfile / monitor_process_pidfile: absolute paths; ``{rank}`` becomes
            the initial rank.
        enabled: False returns ``fn`` unchanged.
        interrupt_blocking_calls: True (default) delivers the restart interrupt with a signal,
            which also ends blocking calls such as ``time.sleep`` or a socket read; False
            delivers it only at the next bytecode boundary (as NVRx), so a rank stuck in a C
            call is left to the hard timeout, which kills it.

    Raises:
        TypeError: a value of the wrong type.
        ConfigError (ValueError): violated timing invariants (soft < hard < barrier;
            heartbeat_interval < heartbeat_timeout < barrier; monitor_process_interval <
            min(barrier, heartbeat_timeout, soft); monitor_thread_interval and
            progress_watchdog_interval < soft), relative paths.
    """

    def __new__(cls, fn: Callable | None = None, /, **kwargs: Any) -> Any:
        # ``@Wrapper`` without parentheses: Python calls ``Wrapper(fn)``; return the wrapped
        # function (not an instance, so __init__ is not run again).
        if fn is None:
            return super().__new__(cls)
        if not callable(fn) or isinstance(fn, (bool, int, float, str)):
            raise TypeError(
                f"Wrapper takes keyword arguments only (got a positional {fn!r}); use "
                "@Wrapper, @Wrapper() or @Wrapper(soft_timeout=...)"
            )
        return cls(**kwargs)(fn)

    def __init__(
        self,
        fn: Callable | None = None,
        /,
        *,
        store_factory: Callable[..., dist.Store] | None = None,
        store_kwargs: Mapping[str, Any] | None = None,
        initialize: Callable | None = None,
        abort: Callable | None = _DEFAULT,
        finalize: Callable | None = None,
        health_check: Callable | None = None,
        rank_assignment: Callable = _DEFAULT,
        completion: Callable | None = None,
        terminate: Callable | None = None,
        monitor_thread_interval: Duration = DEFAULTS["monitor_thread_interval"],
        monitor_process_interval: Duration = DEFAULTS["monitor_process_interval"],
        heartbeat_interval: Duration = DEFAULTS["heartbeat_interval"],
        progress_watchdog_interval: Duration = DEFAULTS["progress_watchdog_interval"],
        soft_timeout: Duration = DEFAULTS["soft_timeout"],
        hard_timeout: Duration = DEFAULTS["hard_timeout"],
        heartbeat_timeout: Duration = DEFAULTS["heartbeat_timeout"],
        barrier_timeout: Duration = DEFAULTS["barrier_timeout"],
        completion_timeout: Duration = DEFAULTS["completion_timeout"],
        last_call_wait: Duration = DEFAULTS["last_call_wait"],
        termination_grace_time: Duration = DEFAULTS["termination_grace_time"],
        monitor_process_logfile: str | None = None,
        monitor_process_pidfile: str | None = None,
        enabled: bool = True,
        interrupt_blocking_calls: bool = True,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"Wrapper: enabled must be a bool, got {enabled!r}")
        self.enabled = enabled
        durations = {
            "monitor_thread_interval": monitor_thread_interval,
            "monitor_process_interval": monitor_process_interval,
            "heartbeat_interval": heartbeat_interval,
            "progress_watchdog_interval": progress_watchdog_interval,
            "soft_timeout": soft_timeout, "hard_timeout": hard_timeout,
            "heartbeat_timeout": heartbeat_timeout, "barrier_timeout": barrier_timeout,
            "completion_timeout": completion_timeout, "last_call_wait": last_call_wait,
            "termination_grace_time": termination_grace_time,
        }
        hooks = {
            "initialize": initialize,
            "abort": AbortTorchDistributed() if abort is _DEFAULT else abort,
            "finalize": finalize, "health_check": health_check,
            "rank_assignment": (_default_rank_assignment() if rank_assignment is _DEFAULT
                             else rank_assignment),
            "completion": completion, "terminate": terminate,
        }
        self.config: WrapperConfig = validate(
            durations, hooks, store_factory, store_kwargs,
            monitor_process_logfile, monitor_process_pidfile,
        )
        self.restart_health_check = _restart_health_check(health_check)
        if not isinstance(interrupt_blocking_calls, bool):
            raise TypeError("Wrapper: interrupt_blocking_calls must be a bool, got "
                            f"{interrupt_blocking_calls!r}")
        self.interrupt_blocking_calls = interrupt_blocking_calls

    def __call__(self, fn: Callable) -> Callable:
        if not self.enabled:
            return fn

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            _warn_if_logging_unconfigured()
            return _Runtime(self.config, fn, self.restart_health_check,
                            self.interrupt_blocking_calls).run(args, kwargs)

        return wrapped


def _warn_if_logging_unconfigured() -> None:
    """``UserWarning`` (shown once per process by Python's default filter) when neither the root
    nor the ``trainguard`` logger has a handler: restarts are reported through ``logging``.

    Only rank 0 warns (``RANK`` unset, empty or ``0``): every rank runs the same set-up, so one
    line per job says it; a job of N ranks does not print N copies.
    Follows: NVRx's Wrapper, which warns the same way (in every rank).
    """
    if (logging.getLogger().handlers or logging.getLogger("trainguard").handlers
            or os.environ.get("TRAINGUARD_LOG_LEVEL")):
        return
    if os.environ.get("RANK", "").strip() not in ("", "0"):
        return
    warnings.warn(
        "logging is not configured: trainguard.inprocess reports restarts through the logging "
        "module; call logging.basicConfig(level=logging.INFO) or set TRAINGUARD_LOG_LEVEL=INFO",
        UserWarning, stacklevel=3,
    )


def _restart_health_check(user: Callable | None) -> Compose | None:
    """The check run after a fault: ``Compose(*user, GPU, NVL)`` for device ``LOCAL_RANK``.

    Runs NVL, then GPU, then the user's checks. None without an integer ``LOCAL_RANK`` (the
    loop then runs the user's ``health_check`` alone). Both device checks pass on hosts
    without CUDA. Follows: NVRx ``Wrapper.restart_health_check``.
    """
    local = os.environ.get("LOCAL_RANK", "")
    if not local.isdigit():
        return None
    users = [] if user is None else list(user.instances if isinstance(user, Compose) else [user])
    return Compose(*users, ChainedGPUHealthCheck(device_index=int(local)),
                   ChainedNVLHealthCheck(device_index=int(local)))


class CallWrapper:
    """Handle of one wrapped call, injected into ``fn`` (parameters annotated with it).

    Used from the main thread inside ``fn``.
    """

    def __init__(self, runtime: _Runtime) -> None:
        self._rt = runtime

    @property
    def iteration(self) -> int:
        """Restart index of the running attempt (0 on the first attempt of each call)."""
        return self._rt.state.iteration

    @property
    def state(self) -> FrozenState:
        return self._rt.state.freeze()

    @property
    def store(self) -> dist.Store:
        """The call's coordination store, through a connection of this iteration.

        A restart shuts that connection, so a ``wait``/``get`` blocked on it raises within
        milliseconds instead of waiting for the store timeout; the next iteration gets a new
        connection (the keys stay). Stores that cannot be cloned (FileStore) are returned as is.
        """
        return self._rt.iteration_store()

    @property
    def process_group_store(self) -> dist.PrefixStore:
        """A store namespaced to this call and iteration, for ``init_process_group``.

        Built on :attr:`store`'s per-iteration connection, so process-group creation waiting for
        a peer that faulted before joining is released by the restart.
        """
        return dist.PrefixStore(self._rt.keys.pg_prefix(self.iteration), self._rt.iteration_store())

    @property
    def restart_records(self) -> list[RestartRecord]:
        """One :class:`RestartRecord` per restart so far in this call (oldest first)."""
        return list(self._rt.records)

    @property
    def last_restart(self) -> RestartRecord | None:
        return self._rt.records[-1] if self._rt.records else None

    def ping(self) -> None:
        """Manual heartbeat; the first ping of an iteration arms the manual deadline."""
        self._rt.block.set("manual", time.monotonic())

    def atomic(self) -> threading.RLock:
        """Re-entrant lock: a restart interrupt is not raised while the main thread holds it.

        Use as ``with call_wrapper.atomic(): ...`` around e.g. a checkpoint write.
        """
        return self._rt.atomic_lock

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """No soft/hard timeout inside the block (exceptions still restart); nestable."""
        block = self._rt.block
        block.set("disabled", block.get("disabled") + 1)
        try:
            yield
        finally:
            block.touch()
            if block.get("manual") > 0:
                block.set("manual", time.monotonic())
            block.set("disabled", max(block.get("disabled") - 1, 0))

    @contextlib.contextmanager
    def tracking_process_group(self) -> Iterator[None]:
        """Track the sockets of process groups made inside (``new_group``) for the CPU abort.

        Kept for compatibility: the default abort releases every socket opened during the
        iteration, tracked or not, so wrapping group creation in this block is optional.
        """
        with _transport.tracking():
            yield

    def init_process_group(
        self, backend: str | None = None, timeout: Duration | None = None, **kwargs: Any
    ) -> None:
        """``init_process_group`` for this iteration: rank/world size = active rank/size.

        Backend ``nccl`` if CUDA is available else ``gloo``; the store is
        :attr:`process_group_store`; ``timeout`` defaults to ``barrier_timeout``. The group's
        sockets are tracked so the default abort can break a blocked gloo collective.

        Raises:
            RuntimeError: called on an inactive (reserve) rank.
        """
        st = self._rt.state
        if st.active_rank is None or st.active_world_size is None:
            raise RuntimeError("init_process_group on an inactive rank (it runs no fn)")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout_s = self._rt.cfg.barrier_timeout_s if timeout is None else as_seconds(timeout)
        # torch wraps sys.excepthook at every init to prefix "[rankN]:"; unwrap earlier layers
        # so the prefixes do not pile up across restarts (or across calls).
        sys.excepthook = _unwrapped_excepthook(sys.excepthook)
        with _transport.tracking():
            dist.init_process_group(
                backend, store=self.process_group_store, rank=st.active_rank,
                world_size=st.active_world_size, timeout=timedelta(seconds=timeout_s), **kwargs,
            )


def _unwrapped_excepthook(hook: Callable) -> Callable:
    """``hook`` without the ``[rankN]:`` layers that ``dist.init_process_group`` added."""
    for _ in range(1000):
        if getattr(hook, "__name__", "") != "_distributed_excepthook":
            break
        inner = inspect.getclosurevars(hook).nonlocals.get("old_hook")
        if not callable(inner):
            break
        hook = inner
    return hook


class _Runtime(LoopMixin):
    """Resources and phases of one call (owned by the calling thread)."""

    def __init__(self, cfg: WrapperConfig, fn: Callable,
                 restart_check: Callable | None = None, signal_interrupt: bool = True) -> None:
        self.cfg, self.fn = cfg, fn
        self.restart_check = restart_check
        self.signal_interrupt = signal_interrupt
        self.call_wrapper = CallWrapper(self)
        self.records: list[RestartRecord] = []
        self.atomic_lock = threading.RLock()
        self.interrupter = Interrupter()
        self.block = ProgressBlock()
        self.keys: co.Keys | None = None
        self.monitor: MonitorProcess | None = None
        self.watchdog: ProgressWatchdog | None = None
        self.monitor_thread = None
        self.ret: Any = None
        self.hosting = False
        self.frozen_gc = False
        self.completed = False
        self.last_fault_text: str | None = None
        self.iter_store: dist.Store | None = None
        self.rdzv_wrapped = False

    def iteration_store(self) -> dist.Store:
        """The wrapped function's store connection for this iteration (created on first use
        and tracked, so the abort shuts it; see :attr:`CallWrapper.store`)."""
        if self.iter_store is None:
            before = _transport.snapshot()
            store = co.clone_store(self.store)
            if store is not self.store:
                _transport.track_fds(_transport.snapshot() - before)
            self.iter_store = store
        return self.iter_store

    def run(self, args: tuple, kwargs: dict) -> Any:
        saved = env_snapshot()
        try:
            self.setup()
            with restart_loop():
                while self.iterate(args, kwargs) is Outcome.RESTART:
                    pass
            self.completed = True
        except BaseException as exc:
            self.explain_exit(exc)
            if self.keys is not None:
                self.exit_path(exc)
            raise
        finally:
            self.shutdown()
            env_restore(saved)
        self.run_completion()
        log.info("in-process restart: call completed on initial rank %s at iteration %d",
                 self.state.initial_rank, self.state.iteration)
        return self.ret if self.state.mode == Mode.ACTIVE else None

    def explain_exit(self, exc: BaseException) -> None:
        """Name the last restart's fault on the exception that ends the loop.

        A ``RestartAbort`` from a retry limit otherwise hides why the attempts kept failing.
        """
        if not self.records or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        rec = self.records[-1]
        note = (
            f"last restart: iteration {rec.iteration}, {rec.cause} on initial ranks "
            f"{list(rec.fault_ranks)}: {rec.message}"
        )
        if self.last_fault_text:
            note += f"; this rank's last exception: {self.last_fault_text}"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        elif exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]} ({note})",) + exc.args[1:]

    def setup(self) -> None:
        if dist.is_available() and dist.is_initialized():
            raise ValueError(
                "torch.distributed is already initialised when entering the in-process restart "
                "wrapper (requires: not torch.distributed.is_initialized()); create the process "
                "group inside the wrapped function (e.g. with CallWrapper.init_process_group())"
            )
        self.state = State.from_env()
        if "WORLD_SIZE" not in os.environ:
            warnings.warn(
                "trainguard: WORLD_SIZE is not set, so the wrapped function runs as a 1-rank "
                "job; launch it with torchrun or `trainguard launch`, or set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT", RuntimeWarning, stacklevel=4)
        gc.freeze()  # keeps restart-time gc.collect() to the call's own objects
        self.frozen_gc = True
        store_fn, base, port = self._store_source()
        _transport.clear()
        if port is not None:
            _transport.exclude_port(port)
        self.monitor = MonitorProcess(self._monitor_config(), self.block, store_fn)
        self.monitor.wait_ready(self.cfg.barrier_timeout_s)
        self.store = base if base is not None else store_fn()
        call_id = self.store.add(co.Keys.call_counter(self.state.initial_rank), 1)
        self.monitor.send(op="start", call=call_id)
        self.watchdog = ProgressWatchdog(self.block, self.cfg.progress_watchdog_interval_s)
        self.watchdog.start()
        if self.signal_interrupt:
            self.interrupter.install()
        self.interrupter.install_unraisable_hook()
        self.keys = co.Keys(call_id)
        keys = self.keys
        self.rdzv_wrapped = _rendezvous.namespace_rendezvous(
            lambda: keys.user_prefix(self.state.iteration))
        _pg_guard.install()
        self._initial_barrier()
        self.reassign(None)
        log.info("in-process restart: call %d started, initial rank %s of %s", call_id,
                 self.state.initial_rank, self.state.initial_world_size)

    def _store_source(self) -> tuple[Callable[[], dist.Store], dist.Store | None, int | None]:
        cfg = self.cfg
        if cfg.store_factory is None:
            addr = co.resolve_store_address(cfg.store_kwargs, self.state.initial_world_size)
            self.hosting = self.state.initial_rank == 0
            self._host_addr = addr if self.hosting else None
            return (lambda: co.default_store(addr, False)), None, addr.port
        base = cfg.store_factory(**cfg.store_kwargs)
        self._host_addr = None
        return (lambda: co.clone_store(base)), base, getattr(base, "port", None)

    def _monitor_config(self) -> MonitorConfig:
        c, r = self.cfg, self.state.initial_rank

        def fill(path: str | None) -> str | None:
            return None if path is None else path.replace("{rank}", str(r))

        return MonitorConfig(
            initial_rank=r, initial_world_size=self.state.initial_world_size,
            interval_s=c.monitor_process_interval_s, soft_s=c.soft_timeout_s,
            hard_s=c.hard_timeout_s, heartbeat_interval_s=c.heartbeat_interval_s,
            heartbeat_timeout_s=c.heartbeat_timeout_s, barrier_timeout_s=c.barrier_timeout_s,
            grace_s=c.termination_grace_time_s, collective_grace_s=c.collective_grace_s,
            undelivered_grace_s=c.undelivered_grace_s,
            watchdog_interval_s=c.progress_watchdog_interval_s,
            logfile=fill(c.monitor_process_logfile), pidfile=fill(c.monitor_process_pidfile),
            host=self._host_addr,
        )

    def _initial_barrier(self) -> None:
        st = self.state
        try:
            reentrant_barrier(self.store, self.keys.init_barrier, [st.initial_rank],
                              st.initial_world_size, self.cfg.barrier_timeout_s,
                              self.cfg.wait_chunk_s, self.block.touch)
        except StoreBarrierTimeout as exc:
            got = exc.arrived or set()
            missing = sorted(set(range(st.initial_world_size)) - set(got))
            raise BarrierTimeout(
                f"initial barrier: ranks {missing} of WORLD_SIZE={st.initial_world_size} did not "
                f"arrive within {self.cfg.barrier_timeout_s:.1f} s (check that every rank runs "
                "the wrapped function with the same store address)", got,
            ) from exc

    def run_completion(self) -> None:
        if self.cfg.completion is not None:
            try:
                self.cfg.completion(self.state.freeze())
            except Exception:
                log.exception("completion hook failed")

    def shutdown(self) -> None:
        """Stop threads, arrive at the termination barrier, stop and reap the monitor."""
        self.interrupter.restore()
        if self.monitor_thread is not None:
            self.monitor_thread.close(self.cfg.monitor_thread_interval_s + 0.5)
        if self.watchdog is not None:
            self.watchdog.close()
        self.block.set("phase", Phase.DONE)
        if self.keys is not None:
            try:
                reentrant_barrier(self.store, self.keys.term_barrier, [self.state.initial_rank],
                                  self.state.initial_world_size, 0.0)
            except Exception:
                log.debug("termination barrier arrival failed", exc_info=True)
        if self.monitor is not None and self.hosting and not self.completed:
            self.monitor.detach()  # leaving early: the store must outlive the survivors
        elif self.monitor is not None:
            wait_s = self.cfg.barrier_timeout_s + 5.0 if self.hosting else 5.0
            self.monitor.stop(wait_s)
        _transport.clear()
        if self.rdzv_wrapped:
            _rendezvous.restore_rendezvous()
            self.rdzv_wrapped = False
        _pg_guard.uninstall()  # after the barriers: no collective callback is still running
        if self.frozen_gc:
            gc.unfreeze()
