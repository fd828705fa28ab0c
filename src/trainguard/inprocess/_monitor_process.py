"""Monitor process: one per rank and call, forked before the trainer opens any store connection.

It outlives its trainer: it notices the trainer's death at once (``pidfd`` plus pipe EOF, with
a ``getppid`` fallback), records it in the store, marks the rank terminated and arrives at the
barriers on its behalf. It evaluates the progress deadlines on its own clock every
``monitor_process_interval``: soft timeout -> record an interruption (every rank restarts, this
rank stays); hard timeout -> SIGCONT, SIGTERM, grace, SIGKILL, then as for a death. A soft
timeout whose interrupt cannot be taken (the trainer's watchdog thread has been silent for
``undelivered_grace_s``: its main thread holds the GIL, or it is stopped) escalates to the kill
then instead of waiting for the hard timeout. It publishes a
sibling heartbeat and marks the next live rank in the ring unresponsive if its heartbeat goes
stale. For the default store the monitor of initial rank 0 hosts the TCPStore, so the store
survives the death of that rank's trainer; it leaves only after the termination barrier.

Follows: NVRx MonitorProcess + SiblingMonitor; differences: single fork (the trainer or init
reaps it), deadlines on a clock, pidfd death detection, store hosting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import time
from collections.abc import Callable

import torch.distributed as dist

from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_msg
from trainguard._core.procs import terminate_processes
from trainguard._core.proctitle import set_title
from trainguard._core.store import reentrant_barrier, wait_key
from trainguard.errors import ConfigError
from trainguard.inprocess import _coord as co
from trainguard.inprocess._watchdog import Phase, ProgressBlock

__all__ = ["MonitorConfig", "MonitorProcess"]

_MSG = 1  # frame kind of every command and status message (_core.ipc messages)


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Settings of one monitor process (seconds)."""

    initial_rank: int
    initial_world_size: int
    interval_s: float
    soft_s: float
    hard_s: float
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    barrier_timeout_s: float
    grace_s: float
    collective_grace_s: float
    watchdog_interval_s: float
    undelivered_grace_s: float = float("inf")  # soft timeout -> kill when GIL held/stopped
    logfile: str | None = None
    pidfile: str | None = None
    host: co.StoreAddress | None = None  # set: host the default TCPStore here


class MonitorProcess:
    """Trainer-side handle: fork, send commands, stop and reap."""

    def __init__(
        self, cfg: MonitorConfig, block: ProgressBlock, store_fn: Callable[[], dist.Store]
    ) -> None:
        self.cfg = cfg
        cmd_r, self._cmd_w = os.pipe()
        status_r, status_w = os.pipe()
        trainer = os.getpid()
        pid = os.fork()
        if pid == 0:  # child: never returns
            os.close(self._cmd_w)
            os.close(status_r)
            _child(cfg, block, store_fn, cmd_r, status_w, trainer)
        self.pid = pid
        os.close(cmd_r)
        os.close(status_w)
        self._status_r = status_r
        self._reaped = False

    def wait_ready(self, timeout_s: float) -> None:
        """Block (at most ``timeout_s`` s) until the child reports ready (store hosted).

        Raises:
            ConfigError: the default store's port is taken (the message names the port and
                ``TRAINGUARD_STORE_PORT``); reported as soon as the child fails to bind.
            RuntimeError: the child exited or did not answer in time.
        """
        ready, _, _ = select.select([self._status_r], [], [], timeout_s)
        line = ""
        if ready:
            try:
                line = str(decode_msg(FrameReader(self._status_r, 256).recv()[1])[0].get("op"))
            except (EOFError, OSError, FrameError):
                line = ""
        if line.startswith("ready"):
            return
        self.stop(1.0)
        if line.startswith("port-busy "):
            raise ConfigError(line[len("port-busy "):])
        if line.startswith("error "):
            why = line[len("error "):]
        elif ready:
            why = "it exited before it was ready (see monitor_process_logfile)"
        else:
            why = f"no answer within {timeout_s:.1f} s"
        raise RuntimeError(f"monitor process of rank {self.cfg.initial_rank} failed to start: "
                           f"{why}")

    def send(self, **msg) -> None:
        try:
            send_msg(self._cmd_w, _MSG, msg)
        except OSError:  # child already gone
            pass

    def stop(self, timeout_s: float) -> None:
        """Tell the child to finish and reap it within ``timeout_s`` s (then SIGKILL)."""
        if self._reaped:
            return
        self.send(op="stop")
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not self._try_reap():
            time.sleep(0.005)
        if not self._reaped:
            terminate_processes([self.pid], grace_s=2.0)
            self._reaped = True
        for fd in (self._cmd_w, self._status_r):
            try:
                os.close(fd)
            except OSError:
                pass

    def detach(self, wait_s: float = 1.0) -> None:
        """Tell the child to finish but do not insist: a store host stays up for the others
        (it exits after the termination barrier; init reaps it if we are gone by then)."""
        self.send(op="stop")
        end = time.monotonic() + wait_s
        while time.monotonic() < end and not self._try_reap():
            time.sleep(0.005)
        for fd in (self._cmd_w, self._status_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reaped = True  # not ours to wait for any more

    def _try_reap(self) -> bool:
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid = self.pid
        if pid == self.pid:
            self._reaped = True
        return self._reaped


def _child(cfg, block, store_fn, cmd_r, status_w, trainer_pid) -> None:
    code = 0
    try:
        os.setpgid(0, 0)  # a Ctrl-C to the job's group must not kill the monitor first
        set_title(f"trainguard: rank {cfg.initial_rank} monitor",
                  f"tg-rank{cfg.initial_rank}-mon")  # ps tells it from its trainer
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _redirect_stdio(cfg.logfile)
        log = _child_logger(cfg)
        _Monitor(cfg, block, store_fn, cmd_r, status_w, trainer_pid, log).run()
    except BaseException:  # the child must never return into the trainer's code
        code = 1
        with contextlib.suppress(BaseException):
            logging.getLogger("trainguard.inprocess.monitor").exception("monitor failed")
    finally:
        os._exit(code)


def _redirect_stdio(logfile: str | None) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if logfile else null
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)


def _child_logger(cfg: MonitorConfig) -> logging.Logger:
    log = logging.getLogger("trainguard.inprocess.monitor")
    log.handlers.clear()
    log.propagate = False
    if cfg.logfile:
        handler = logging.StreamHandler(open(cfg.logfile, "a", buffering=1))  # noqa: SIM115
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s [monitor rank{cfg.initial_rank}] %(message)s")
        )
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    else:
        log.addHandler(logging.NullHandler())
    return log


class _Monitor:
    """The child's state machine (runs only in the forked process)."""

    def __init__(self, cfg, block, store_fn, cmd_r, status_w, trainer_pid, log) -> None:
        self.cfg, self.block, self.log = cfg, block, log
        self.store_fn, self.cmd_r, self.status_w = store_fn, cmd_r, status_w
        self.trainer = trainer_pid
        self.pidfd = _pidfd(trainer_pid)
        self.store: dist.Store | None = None
        self.keys: co.Keys | None = None
        self.reader = FrameReader(cmd_r, 1024)
        self.stopping = False
        self.next_hb = 0.0
        self.died = False
        self.sibling_armed = False
        self.soft_at: tuple[int, float] | None = None  # (iteration, monotonic) of a soft timeout

    def run(self) -> None:
        # NVRx-compatible first line of the log file (names the process and the trainer)
        self.log.info("monitor_process pid=%d target_pid=%d initial_rank=%d started",
                      os.getpid(), self.trainer, self.cfg.initial_rank)
        if self.cfg.pidfile:
            with open(self.cfg.pidfile, "w") as fh:
                fh.write(f"{os.getpid()}\n")
        if self.cfg.host is not None:
            try:
                self.store = co.default_store(self.cfg.host, is_master=True)
            except (RuntimeError, OSError) as exc:  # DistNetworkError is a RuntimeError
                send_msg(self.status_w, _MSG, {"op": _host_failure(self.cfg.host, exc)})
                raise
        send_msg(self.status_w, _MSG, {"op": "ready"})
        if not self._wait_start():
            return
        tick = min(self.cfg.interval_s, self.cfg.heartbeat_interval_s)
        while not self.stopping:
            fds = [self.cmd_r] + ([self.pidfd] if self.pidfd is not None else [])
            ready, _, _ = select.select(fds, [], [], tick)
            gone = self.pidfd in ready or (self.cmd_r in ready and not self._read_cmds())
            if gone and not self.stopping:
                self._on_death(co.Cause.TERMINATED, "process died")
                break
            if not self.stopping and os.getppid() != self.trainer:
                self._on_death(co.Cause.TERMINATED, "process died")
                break
            if not self.stopping:
                self._check_deadlines()
                self._heartbeat()
        self._finish()

    def _wait_start(self) -> bool:
        end = time.monotonic() + self.cfg.barrier_timeout_s
        while self.keys is None and time.monotonic() < end:
            ready, _, _ = select.select([self.cmd_r], [], [], self.cfg.interval_s)
            if (ready and not self._read_cmds()) or os.getppid() != self.trainer:
                return False  # trainer gone before the call started: nothing to report (defect 5)
            if self.stopping:
                return False
        if self.keys is None:
            return False
        if self.store is None:
            self.store = self.store_fn()
        return True

    def _read_cmds(self) -> bool:
        """Handle pending commands; False on EOF (the trainer closed the pipe or died)."""
        while select.select([self.cmd_r], [], [], 0)[0]:
            try:
                msg, _ = decode_msg(self.reader.recv()[1])
            except (EOFError, FrameError):
                return False
            if msg["op"] == "start":
                self.keys = co.Keys(int(msg["call"]))
            elif msg["op"] == "stop":
                self.stopping = True
        return True

    # -- deadlines -------------------------------------------------------------------------
    def _check_deadlines(self) -> None:
        b = self.block
        if b.get("phase") != Phase.RUNNING or b.get("disabled") > 0:
            return
        # the iteration first, then the age, then the iteration again: the trainer's begin()
        # stamps progress before it publishes a new iteration, so an age read between the two
        # reads belongs to the iteration read (an age left from the aborted iteration, read just
        # before the trainer entered the next, was recorded as a soft timeout of the new one)
        it = int(b.get("iteration"))
        age = b.age_s()
        if int(b.get("iteration")) != it:
            return
        if age >= self.cfg.hard_s:
            self._hard_timeout(age)
        elif self._undeliverable(it):
            self._hard_timeout(age, "the restart interrupt cannot be taken (main thread holds "
                                    "the GIL or is stopped)")
        elif age >= self.cfg.soft_s and int(b.get("soft_fired")) != it:
            waiting_on_peer = b.waiting_on_peer(max(3 * self.cfg.watchdog_interval_s, 0.3))
            if waiting_on_peer and age < self.cfg.soft_s + self.cfg.collective_grace_s:
                return  # blocked in a collective: let the hung peer report first
            b.set("soft_fired", it)
            self.soft_at = (it, time.monotonic())
            if co.is_interrupted(self.store, self.keys, it):
                return  # another rank's fault is already being handled
            self.log.info("soft timeout: no progress for %.3f s in iteration %d", age, it)
            self._record(co.Cause.SOFT_TIMEOUT, it, f"no progress for {age:.3f} s", age)

    def _undeliverable(self, it: int) -> bool:
        """The soft timeout of iteration ``it`` fired at least ``undelivered_grace_s`` ago and
        the trainer's watchdog thread has been silent for as long: its main thread holds the
        GIL (or the process is stopped), so no interrupt can reach it and waiting for
        ``hard_s`` gains nothing."""
        if self.soft_at is None or self.soft_at[0] != it:
            return False
        now, grace = time.monotonic(), self.cfg.undelivered_grace_s
        sampled = self.block.get("sampled_at")  # 0: never sampled, nothing to judge by
        return now - self.soft_at[1] >= grace and sampled > 0.0 and now - sampled >= grace

    def _hard_timeout(self, age: float, why: str = "") -> None:
        self.log.info("hard timeout: no progress for %.3f s%s; killing pid %d", age,
                      f" ({why})" if why else "", self.trainer)
        note = f" ({why})" if why else ""
        self._depart(co.Cause.HARD_TIMEOUT, f"no progress for {age:.3f} s{note}; killed", age)
        terminate_processes([self.trainer], grace_s=self.cfg.grace_s)  # this monitor is spared
        self._finish_death()

    # -- store actions ---------------------------------------------------------------------
    def _record(self, cause: co.Cause, it: int, message: str, age: float = 0.0) -> None:
        t = time.time()
        rec = co.Interruption(cause.value, self.cfg.initial_rank, t - age, t, message)
        co.record_interruption(self.store, self.keys, it, rec)

    def _depart(self, cause: co.Cause, message: str, age: float = 0.0) -> None:
        """Report this rank gone (recorded, marked terminated, arrived at the barrier)."""
        b = self.block
        it = int(b.get("iteration"))
        t = time.time()
        rec = co.Interruption(cause.value, self.cfg.initial_rank, t - age, t, message)
        count = int(b.get("world_size")) or self.cfg.initial_world_size
        co.report_departure(self.store, self.keys, it, rec, count)

    def _on_death(self, cause: co.Cause, message: str) -> None:
        if self.block.get("phase") == Phase.DONE:
            return  # the trainer finished the call; a later exit is not a fault
        self.log.info("trainer pid %d gone (%s) in iteration %d", self.trainer, message,
                      int(self.block.get("iteration")))
        self._depart(cause, message)
        self._finish_death()

    def _finish_death(self) -> None:
        self.block.set("phase", Phase.DONE)
        self.died = True

    def _finish(self) -> None:
        if self.store is None or self.keys is None:
            return
        self.store.set(self.keys.heartbeat(self.cfg.initial_rank), b"done")
        if self.died:
            # the trainer died: arrive at the termination barrier for it
            reentrant_barrier(self.store, self.keys.term_barrier, [self.cfg.initial_rank],
                              self.cfg.initial_world_size, 0.0)
        if self.cfg.host is not None:  # keep the store up until every rank has left
            try:
                self._wait_term()
            except RuntimeError:
                self.log.exception("termination barrier")

    def _wait_term(self) -> None:
        """Host the store until every rank arrived at the termination barrier, or until no
        missing rank has shown a fresh heartbeat for ``heartbeat_timeout`` seconds."""
        key, world = self.keys.term_barrier, self.cfg.initial_world_size
        last_alive = time.monotonic()
        while True:
            arrived = reentrant_barrier(self.store, key, [], world, 0.0)
            if len(arrived) >= world:
                return
            self._heartbeat()
            if self._any_alive(set(range(world)) - arrived):
                last_alive = time.monotonic()
            elif time.monotonic() - last_alive > self.cfg.heartbeat_timeout_s:
                self.log.info("termination barrier: ranks %s silent; closing the store",
                              sorted(set(range(world)) - arrived))
                return
            wait_key(self.store, f"{key}/done", min(self.cfg.heartbeat_interval_s, 1.0))

    def _any_alive(self, ranks: set[int]) -> bool:
        now = time.time()
        for r in ranks:
            key = self.keys.heartbeat(r)
            if not self.store.check([key]):
                continue
            raw = self.store.get(key).decode()
            if raw != "done" and now - float(raw) < self.cfg.heartbeat_timeout_s:
                return True
        return False

    # -- sibling heartbeat -----------------------------------------------------------------
    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now < self.next_hb:
            return
        self.next_hb = now + self.cfg.heartbeat_interval_s
        me, world = self.cfg.initial_rank, self.cfg.initial_world_size
        self.store.set(self.keys.heartbeat(me), str(time.time()).encode())
        if world == 1:
            return
        if not self.sibling_armed:
            # Until this rank passed the initial barrier a sibling may still be starting (ranks
            # start up to barrier_timeout apart): judging it by heartbeat_timeout would discard
            # a late but healthy rank. After the barrier every rank's monitor is up.
            if self.block.get("phase") != Phase.RUNNING:
                return
            self.sibling_armed = True
        dead = co.read_int_set(self.store, self.keys.terminated_all)
        sibling = next(((me + k) % world for k in range(1, world)
                        if (me + k) % world not in dead), None)
        if sibling is None or sibling == me:
            return
        key = self.keys.heartbeat(sibling)
        seed = str(time.time()).encode()
        raw = self.store.compare_set(key, b"", seed).decode()
        if raw == "done":
            return
        stale = time.time() - float(raw)
        if stale >= self.cfg.heartbeat_timeout_s:
            self._sibling_unresponsive(sibling, stale)

    def _sibling_unresponsive(self, sibling: int, stale: float) -> None:
        it = int(self.block.get("iteration"))
        self.log.info("rank %d unresponsive: heartbeat %.3f s old", sibling, stale)
        t = time.time()
        rec = co.Interruption(co.Cause.UNRESPONSIVE.value, sibling, t - stale, t,
                              f"heartbeat {stale:.3f} s old")
        co.report_departure(self.store, self.keys, it, rec, self.cfg.initial_world_size)
        reentrant_barrier(self.store, self.keys.term_barrier, [sibling],
                          self.cfg.initial_world_size, 0.0)


def _host_failure(addr: co.StoreAddress, exc: BaseException) -> str:
    """Status line for a store that could not be hosted (``port-busy ...`` or ``error ...``)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "in use" in text.lower() or "eaddrinuse" in text.lower():
        return (
            f"port-busy port {addr.port} on {addr.host} for the in-process restart store is "
            f"already in use; set {co.STORE_PORT_ENV} to a free port (default: MASTER_PORT + 1) "
            "or pass store_kwargs={'port': ...}"
        )
    return f"error cannot host the store on {addr.host}:{addr.port}: {text[:300]}"


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
