"""The restart loop of one wrapped call, as named phases (see ``Runtime.run``).

Protocol per iteration ``i`` (keys from :mod:`._coord`, barriers keyed by initial rank):

1. ``begin``: export RANK/WORLD_SIZE, publish membership, arm the interrupt, start the monitor
   thread, reset progress stamps.
2. ``body``: ``initialize`` -> ``health_check`` -> ``fn`` (active ranks) -> completion barrier
   (reserve ranks arrive at once and wait there for the active ranks).
3. an ``Exception`` -> ``on_fault``: record it; the monitor thread interrupts every rank.
4. ``RankShouldRestart`` -> ``restart``: ``finalize`` -> restart health check -> iteration
   barrier -> rank assignment -> ``advance``.
5. any ``BaseException`` escaping 2-4 -> ``exit_path``: record the departure, mark terminated,
   arrive at the barrier for ourselves, run ``terminate``, re-raise.

Follows: NVRx ``CallWrapper.__call__``, split into phases with an outcome enum.
"""

from __future__ import annotations

import enum
import gc
import itertools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainguard._core.hooks import run_deferred_resets, run_standby_callbacks
from trainguard._core.logging import get_logger
from trainguard._core.store import StoreBarrierTimeout, reentrant_barrier, wait_key
from trainguard.inprocess import _coord as co
from trainguard.inprocess import _pg_guard, _transport
from trainguard.inprocess._monitor_thread import (
    Interrupter,
    MonitorThread,
    RestartInfo,
    open_fds,
)
from trainguard.inprocess._watchdog import Phase
from trainguard.inprocess.exceptions import (
    BarrierTimeout,
    HealthCheckError,
    InternalError,
    RankShouldRestart,
    RestartTimeout,
)
from trainguard.inprocess.state import Mode, State

__all__ = ["Outcome", "assignment_ctx"]

log = get_logger("trainguard.inprocess")
_PEER_RECORD_WAIT_S = 0.5  # a transport error waits this long for a peer's fault record


class Outcome(enum.Enum):
    """Result of one iteration."""

    COMPLETED = enum.auto()  # the completion barrier passed: leave the loop
    RESTART = enum.auto()  # interrupted and reassigned: run the next iteration


def assignment_ctx(state: State, store: dist.Store, terminated: set[int]) -> Any:
    from trainguard.inprocess.rank_assignment import RankAssignmentCtx

    return RankAssignmentCtx(state, store, terminated)


class LoopMixin:
    """Phases of the restart loop; mixed into ``wrap._Runtime`` (which owns the resources)."""

    # Provided by the runtime:
    cfg: Any
    fn: Callable
    state: State
    store: dist.Store
    keys: co.Keys
    block: Any
    interrupter: Interrupter
    atomic_lock: threading.RLock
    records: list
    call_wrapper: Any
    iter_store: Any
    monitor_thread: Any

    # -- iteration ---------------------------------------------------------------------------
    def iterate(self, args: tuple, kwargs: dict) -> Outcome:
        mt = self.begin()
        try:
            try:
                self.ret = self.body(args, kwargs)
            except Exception as exc:  # noqa: BLE001 - every Exception is a fault: restart
                self.on_fault(exc)
            if mt.stop():
                self.absorb_interrupt()
            return Outcome.COMPLETED
        except RankShouldRestart:
            self.interrupter.acknowledge()
            if self.completion_done():  # completed everywhere; a late interrupt is moot
                mt.stop()
                return Outcome.COMPLETED
        # Outside the handler: the exception chain (and the frames of the failed attempt it
        # holds) must be unreachable before the restart collects garbage.
        self.restart(mt)
        self.collect_garbage()  # after restart() returned: its frames held fn_exception
        return Outcome.RESTART

    def begin(self) -> MonitorThread:
        st, it = self.state, self.state.iteration
        st.set_distributed_vars()
        self.block.touch()  # before the new iteration is published (see the monitor's reads)
        self.block.set("iteration", it)
        self.block.set("rank", -1 if st.rank is None else st.rank)
        self.block.set("world_size", st.world_size)
        self.block.set("manual", 0.0)
        self.block.touch()
        self.block.set("phase", Phase.RUNNING)
        co.publish_member(self.store, self.keys, it, st.initial_rank, st.rank)
        self.interrupter.arm()
        self.completed_barrier = False
        self.iter_store = None
        _transport.mark_iteration_start()
        before = open_fds()
        own_store = co.clone_store(self.store)
        mt = MonitorThread(
            own_store, self.keys, it, self.cfg.abort, self._frozen_now,
            self.interrupter, self.atomic_lock, self.cfg.monitor_thread_interval_s,
            self.cfg.last_call_wait_s, max(self.cfg.soft_timeout_s / 4, 0.05),
        )
        if own_store is not self.store:
            mt.conn_fds = open_fds() - before
        mt.start()
        self.monitor_thread = mt
        return mt

    def _frozen_now(self) -> Any:
        # not a bound ``state.freeze``: a lingering monitor thread would keep that (old) state
        # and its fn_exception (frames, tensors of the failed attempt) alive
        return self.state.freeze()

    def body(self, args: tuple, kwargs: dict) -> Any:
        frozen = self.state.freeze()
        if self.cfg.initialize is not None:
            self.cfg.initialize(frozen)
        if self.cfg.health_check is not None:
            try:
                self.cfg.health_check(frozen)
            except Exception as exc:
                raise HealthCheckError(f"health check failed: {exc!r}") from exc
        self.mark_reentry()
        ret = None
        if self.state.mode not in (Mode.ACTIVE, Mode.INACTIVE):  # never skip fn silently
            raise InternalError(
                f"rank assignment left rank {self.state.rank} (initial rank "
                f"{self.state.initial_rank}) in mode {self.state.mode.name}; it must return a "
                "state with mode ACTIVE or INACTIVE (end it with a filter such as "
                "ActivateAllRanks()); restarting")
        if self.state.mode == Mode.ACTIVE:
            from trainguard.inprocess._inject import bind_call_wrapper

            a, kw = bind_call_wrapper(self.fn, type(self.call_wrapper), self.call_wrapper,
                                      args, kwargs)
            ret = self.fn(*a, **kw)
        else:  # a reserve: capabilities prepare for becoming active (warm checkpoint writers)
            run_standby_callbacks()
        self.completion_barrier()
        return ret

    def mark_reentry(self) -> None:
        rec = self.records[-1] if self.records else None
        if rec is not None and rec.reentry_time is None:
            rec.reentry_time = time.time()
            # the figures of RestartRecord, so the log and restart_records agree
            log.info(
                "restart %d -> %d: cause=%s ranks=%s detection=%.3f s restart=%.3f s "
                "(RestartRecord.detection_s: fault -> recorded; restart_s: fault -> re-entry)",
                rec.iteration, rec.iteration + 1, rec.cause, list(rec.fault_ranks),
                rec.detection_s, rec.restart_s,
            )

    # -- completion --------------------------------------------------------------------------
    def completion_done(self) -> bool:
        key = self.keys.it(self.state.iteration, "completion")
        return bool(self.store.check([f"{key}/done"]))

    def completion_barrier(self) -> None:
        st, it = self.state, self.state.iteration
        key = self.keys.it(it, "completion")
        arrived = reentrant_barrier(self.store, key, [st.initial_rank], st.world_size, 0.0)
        if len(arrived) >= st.world_size:
            self.store.set(self.keys.it(it, "event"), b"1")
        bounded = st.mode == Mode.ACTIVE
        deadline = time.monotonic() + self.cfg.completion_timeout_s
        chunk = self.cfg.wait_chunk_s
        while not self.completion_done():
            if co.is_interrupted(self.store, self.keys, it):
                self.wait_interrupt()
            if bounded and time.monotonic() >= deadline:
                got = co.read_int_set(self.store, f"{key}/ranks")
                raise BarrierTimeout(
                    f"completion barrier of iteration {it}: {len(got)}/{st.world_size} ranks "
                    f"after {self.cfg.completion_timeout_s:.3f} s (arrived: {sorted(got)})"
                )
            wait_key(self.store, self.keys.it(it, "event"), chunk, chunk)
            self.block.touch()
        self.completed_barrier = True

    # -- faults ------------------------------------------------------------------------------
    def on_fault(self, exc: Exception) -> None:
        """Record a local Exception and wait for the interrupt (raises RankShouldRestart).

        An exception caused by the restart itself (a collective or store wait broken by the
        abort, or by a peer that died) is a consequence, not this rank's fault: it is recorded
        as secondary and does not become ``State.fn_exception`` (so ``FaultCounter`` and other
        hooks see only the rank's own faults).
        """
        t = time.time()
        it = self.state.iteration
        secondary = self.is_consequence(exc)
        if not secondary:
            self.state.fn_exception = exc
            # text only: keeping the exception would keep the failed attempt's frames alive
            self.last_fault_text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        rec = co.Interruption(co.Cause.EXCEPTION.value, self.state.initial_rank, t, t,
                              repr(exc)[:300], secondary)
        co.record_interruption(self.store, self.keys, self.state.iteration, rec)
        # Text only: a log record must not keep the exception (and the attempt's frames) alive.
        # A primary fault is a WARNING so it shows without any logging set-up.
        if secondary:
            log.debug("iteration %d: %s (secondary); restarting all ranks", it, rec.message)
        else:
            log.warning("trainguard: rank %s (initial rank %s) iteration %d raised; restarting "
                        "all ranks:\n%s", self.state.rank, self.state.initial_rank, it,
                        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        self.wait_interrupt()

    def is_consequence(self, exc: Exception) -> bool:
        """True when ``exc`` was caused by a restart already under way or by a peer's fault.

        Our own abort already ran (it broke the sockets under ``exc``), or ``exc`` is a
        transport error (in its cause chain) and another rank's fault is recorded now or within
        ``_PEER_RECORD_WAIT_S`` (a peer's monitor records its death as its sockets close).
        """
        mt = self.monitor_thread
        if mt is not None and mt.firing:
            return True
        if not co.is_comm_error(exc):
            return False
        deadline = time.monotonic() + _PEER_RECORD_WAIT_S
        while True:
            if co.is_interrupted(self.store, self.keys, self.state.iteration):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def wait_interrupt(self) -> None:
        """Keep running bytecode until the monitor thread interrupts us (bounded)."""
        limit = (self.cfg.last_call_wait_s + self.cfg.soft_timeout_s
                 + 2 * self.cfg.monitor_thread_interval_s)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.01)  # the interrupt signal cuts this sleep short
            self.block.touch()
        raise RestartTimeout(
            f"an interruption was recorded but the restart interrupt did not arrive within "
            f"{limit:.1f} s (last_call_wait + soft_timeout + 2 x monitor_thread_interval); a "
            "custom abort hook may be blocking the monitor thread")

    def absorb_interrupt(self) -> None:
        """The monitor thread fired after we completed: swallow its interrupt."""
        try:
            deadline = time.monotonic() + 5.0
            while not self.interrupter.claimed and time.monotonic() < deadline:
                time.sleep(0.002)
        except RankShouldRestart:
            pass
        self.interrupter.close()

    # -- restart -----------------------------------------------------------------------------
    def restart(self, mt: MonitorThread) -> None:
        mt.stop()
        mt.close(0.5)
        info = mt.info or RestartInfo(co.read_interruptions(self.store, self.keys,
                                                            self.state.iteration), time.time())
        marks = [("interrupted", info.interrupt_time), ("caught", time.time())]
        reset_torch_distributed()
        _transport.clear()
        run_deferred_resets()  # state resets the abort's callbacks left to the main thread
        self.iter_store = None
        frozen = self.state.freeze()
        if self.cfg.finalize is not None:
            self.cfg.finalize(frozen)
        check = getattr(self, "restart_check", None) or self.cfg.health_check
        if check is not None:
            try:
                check(frozen)
            except Exception as exc:
                raise HealthCheckError(f"restart health check failed: {exc!r}") from exc
        marks.append(("finalized", time.time()))
        self.iteration_barrier()
        _pg_guard.release()  # the barrier blocked in store waits: group callbacks have run
        marks.append(("barrier", time.time()))
        # Re-read after the barrier: records written after the abort (a rank the machinery
        # killed at its hard timeout, a departure during the restart) belong to this restart.
        records = co.read_interruptions(self.store, self.keys, self.state.iteration)
        record = co.RestartRecord.from_interruptions(self.state.iteration,
                                                     records or info.records, info.interrupt_time)
        self.reassign(self.state.iteration)
        marks.append(("assigned", time.time()))
        self.records.append(record)
        self.state.advance()
        if log.isEnabledFor(logging.DEBUG):
            steps = ", ".join(f"{b[0]} +{b[1] - a[1]:.3f}" for a, b in itertools.pairwise(marks))
            log.debug("restart phases (s): %s", steps)

    def iteration_barrier(self) -> None:
        st, it = self.state, self.state.iteration
        key = self.keys.it(it, "barrier")
        try:
            reentrant_barrier(self.store, key, [st.initial_rank], st.world_size,
                              self.cfg.barrier_timeout_s, self.cfg.wait_chunk_s, self.block.touch)
        except StoreBarrierTimeout as exc:
            raise BarrierTimeout(f"iteration barrier {it}: {exc}", exc.arrived) from exc

    def reassign(self, iteration: int | None) -> None:
        """Run rank assignment for the iteration after ``iteration`` (None: the first)."""
        if iteration is None:
            terminated: set[int] = set()
        else:
            dead = co.read_int_set(self.store, self.keys.it(iteration, "terminated"))
            members = co.read_members(self.store, self.keys, iteration)
            terminated = co.terminated_ranks(members, dead, self.state.world_size)
        prefix = dist.PrefixStore(self.keys.assignment_prefix(iteration), self.store)
        ctx = self.cfg.rank_assignment(assignment_ctx(self.state, prefix, terminated))
        new = ctx.state
        self.state = new if isinstance(new, State) else new.thaw()

    @staticmethod
    def collect_garbage() -> None:
        # Objects of the failed attempt (tensors, groups, frames) must go now. What survives a
        # full collection is frozen (gc.freeze, undone when the call ends), so each restart
        # scans only the objects created since the previous one (imports, caches: once).
        for _ in range(3):
            if gc.collect() == 0:
                break
        gc.freeze()

    # -- exit --------------------------------------------------------------------------------
    def exit_path(self, exc: BaseException) -> None:
        """This rank leaves: record, mark terminated, arrive for ourselves, run terminate."""
        self.interrupter.close()
        mt = getattr(self, "monitor_thread", None)
        if mt is not None:
            mt.stop()
        cause = co.Cause.HEALTH_CHECK if isinstance(exc, HealthCheckError) else co.Cause.EXIT
        log.info("rank %s leaves the restart loop: %r", self.state.initial_rank, exc)
        if getattr(self, "keys", None) is not None and self.block.get("phase") == Phase.RUNNING:
            t = time.time()
            rec = co.Interruption(cause.value, self.state.initial_rank, t, t, repr(exc)[:300])
            try:
                co.report_departure(self.store, self.keys, self.state.iteration, rec,
                                    max(self.state.world_size, 1))
            except Exception:
                log.exception("could not record this rank's departure")
        self.block.set("phase", Phase.DONE)
        if self.cfg.terminate is not None:
            self.cfg.terminate(self.state.freeze())


def reset_torch_distributed() -> None:
    """Destroy every process group and reset torch's group counter.

    Custom aborts may leave the groups (a stale group would leak). A default group whose
    creation failed half-way (a peer faulted before joining) leaves no group but has advanced
    torch's group counter, which names the group's store keys: without the reset this rank
    would look for ``1/...`` keys in the next iteration while a rank that never tried writes
    ``0/...``, and process-group creation would hang.
    """
    if not dist.is_available():
        return
    if dist.is_initialized():
        _pg_guard.destroy_process_group()  # groups freed after the barrier (see _pg_guard)
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def env_snapshot() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}


def env_restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
