"""The launcher's orchestrator: set up monitors, fork server and logs, run cycles, restart.

Phases: ``_setup`` (sweeper, slots, monitors, fork server, signal handlers) -> ``_run_cycle`` per
cycle (ports, spawn, watch, stop, attribution, progress) -> ``_teardown`` (always; reverse order).
Any failure or hang in a cycle stops every worker and starts the next cycle, up to
``--max-restarts`` global cycles.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil

from trainguard._core.clock import Deadline
from trainguard._core.ipc import FrameError, FrameReader, decode_msg, send_msg
from trainguard._core.net import reserve_port
from trainguard._core.procs import describe_exit, terminate_processes
from trainguard._core.shm import unique_prefix
from trainguard.fault_tolerance import _cycle
from trainguard.fault_tolerance._args import LaunchSpec
from trainguard.fault_tolerance._attr_record import append_record
from trainguard.fault_tolerance._healthport import HealthServer, LauncherState, Liveness
from trainguard.fault_tolerance._logs import LogPump
from trainguard.fault_tolerance._report import after_failure, print_summary
from trainguard.fault_tolerance._slot import Slot
from trainguard.fault_tolerance._spawn import (
    ForkServer,
    Worker,
    spawn_cold,
    stop_helper,
    stop_helpers,
)
from trainguard.fault_tolerance._stragglers import StragglerWatch
from trainguard.fault_tolerance._sweeper import ENV_MARKER, marked_pids
from trainguard.fault_tolerance.config import signal_number
from trainguard.fault_tolerance.errors import EXIT_UNHEALTHY, LaunchConfigError, LauncherError
from trainguard.fault_tolerance.health import HealthCheck, launch_checks, run_health_checks

__all__ = ["EXIT_FAILED", "Launcher"]

_log = logging.getLogger("trainguard.fault_tolerance")
EXIT_FAILED = 1  # a cycle failed and no restart is left (a limit of this allocation, requeue ok)
_PR_SET_CHILD_SUBREAPER = 36
_SETUP_WAIT_S = 180.0  # monitors (30 s each, concurrently) + fork server readiness (120 s)


class _MonitorHandle:
    def __init__(self, launcher: Launcher, local_rank: int) -> None:
        self.local_rank = local_rank
        parent, child = socket.socketpair()
        spec = {"rank": launcher.rank_of(local_rank), "local_rank": local_rank,
                "slot": launcher.slots[local_rank].name, "socket": launcher.socket_path(local_rank),
                "cfg": launcher.spec.ft.to_json(), "fd": child.fileno(), "parent": os.getpid(),
                "timeouts": launcher.calculated.get(launcher.rank_of(local_rank))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.fault_tolerance._monitor", json.dumps(spec)],
            pass_fds=(child.fileno(),), env=launcher.infra_env(), stdin=subprocess.DEVNULL)
        child.close()
        self.sock, self.reader = parent, FrameReader(parent.fileno(), 4096)

    def send(self, msg: dict[str, Any]) -> None:
        try:
            send_msg(self.sock.fileno(), 1, msg)
        except OSError:
            pass

    def close(self) -> None:
        stop_helper(self.proc, self.sock)


class Launcher:
    """Runs one job on this node; :meth:`run` returns the exit code (see ``launcher`` docs)."""

    def __init__(self, spec: LaunchSpec) -> None:
        """Raises LaunchConfigError: a ``--ft-health-check`` hook cannot be loaded or the
        ``--health-port`` cannot be bound (nothing is left open then: :meth:`_undo_on_error`)."""
        self.spec = spec
        self.node = socket.gethostname().split(".")[0]
        self.launch_id = f"{spec.run_id}-{os.getpid()}-{secrets.token_hex(3)}"
        self.run_dir = os.path.abspath(os.path.join(spec.log_dir, spec.run_id)) if spec.log_dir \
            else tempfile.mkdtemp(prefix=f"trainguard_{spec.run_id}_")
        self._own_run_dir = not spec.log_dir  # a temp dir of ours: removed again if left empty
        self.health_server: HealthServer | None = None
        with self._undo_on_error():
            self.health_checks: list[HealthCheck] = launch_checks(
                spec.health_check, self._health_dirs(), spec.nproc_per_node)
        # the loop ticks at least every --monitor-interval; stale after two missed ticks (>= 1 s)
        self.liveness = Liveness(max(1.0, 2 * spec.monitor_interval_s))
        self.liveness.info = {"pid": os.getpid(), "run_id": spec.run_id,
                              "node_rank": spec.node_rank}
        self.liveness.enter(LauncherState.RENDEZVOUS, 0, wait_s=_SETUP_WAIT_S)
        with self._undo_on_error():
            if spec.health_port is not None:
                self.health_server = HealthServer(self.liveness, spec.health_port)
        self.slots: list[Slot] = []
        self.monitors: list[_MonitorHandle] = []
        self.server: ForkServer | None = None
        with self._undo_on_error():  # out of threads or descriptors: the health port is closed
            self.pump = LogPump(self.node)
            self.wake_r, self.wake_w = os.pipe()
        self._signals: list[int] = []
        self._old_handlers: dict[int, Any] = {}
        self.hang_events: list[tuple[int, int, int, dict[str, Any]]] = []
        self.calculated: dict[int, dict[str, Any]] = {}
        self.stop_requested = ""
        self.results: list[_cycle.CycleResult] = []
        self.spawn_times: list[dict[str, float]] = []
        self._sweeper: subprocess.Popen[bytes] | None = None
        self._sweeper_w: int | None = None
        self.no_progress = 0
        self.last_iteration: int | None = None
        self.cold_reason = ""
        self.store_port = 0
        self.background: list[threading.Thread] = []

    @contextlib.contextmanager
    def _undo_on_error(self) -> Iterator[None]:
        """Wrap one constructor step (this class's or a subclass's): when it raises anything,
        close what the constructor had opened so far, then re-raise. The one place a failed
        start cleans up; blocks at most ~4.5 s (the health port's and the log pump's joins)."""
        try:
            yield
        except BaseException:
            self._close_opened()
            raise

    def _close_opened(self) -> None:
        """Close what the constructor opened, in reverse: the log pump (its thread and pipes),
        the wake pipe, the ``--health-port`` listener (the port is free again afterwards), an
        empty temporary run dir. Safe on a half-built launcher and idempotent."""
        pump = self.__dict__.pop("pump", None)
        if pump is not None:
            pump.close()
        for name in ("wake_r", "wake_w"):
            fd = self.__dict__.pop(name, None)
            if fd is not None:
                os.close(fd)
        server, self.health_server = self.__dict__.get("health_server"), None
        if server is not None:
            server.close()
        self.drop_empty_run_dir()

    # -- small helpers used by _cycle ---------------------------------------------------
    def rank_of(self, local_rank: int) -> int:
        return self.spec.node_rank * self.spec.nproc_per_node + local_rank

    def socket_path(self, local_rank: int) -> str:
        return os.path.join(tempfile.gettempdir(),
                            f"tg_ft_{os.getpid()}_{self.launch_id[-6:]}_{local_rank}.sock")

    def cycle_log(self, cycle: int) -> str:
        """``<run_dir>/cycle_<N>.log``: every rank's output of ``cycle`` (see ``_logs``), then
        the launcher's record (``_attr_record``); what attribution reads."""
        return os.path.join(self.run_dir, f"cycle_{cycle}.log")

    def error_file(self, cycle: int, local_rank: int) -> str:
        return os.path.join(self.run_dir, f"attempt_{cycle}", str(local_rank), "error.json")

    def event(self, name: str, **fields: Any) -> None:
        """Append one record to ``<run_dir>/launcher_events.jsonl`` (wall-clock ``wall``)."""
        rec = {"event": name, "wall": time.time(), **fields}
        try:
            with open(os.path.join(self.run_dir, "launcher_events.jsonl"), "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        except OSError as exc:
            _log.debug("cannot record event %s: %s", name, exc)

    def infra_env(self) -> dict[str, str]:
        return {**os.environ, ENV_MARKER: self.launch_id}

    def monitor_fds(self) -> list[int]:
        return [m.sock.fileno() for m in self.monitors]

    def extra_fds(self) -> list[int]:
        """More descriptors the cycle watches (multi-node: the lease keeper's wake pipe)."""
        return []

    def check_external(self, res: _cycle.CycleResult, ready: list[int]) -> None:
        """Called after each watch iteration; may end the cycle (multi-node rendezvous)."""

    def take_signals(self) -> list[int]:
        out, self._signals = self._signals, []
        return out

    def term_grace_s(self) -> float:
        if self.spec.shutdown_timeout_s is not None:
            return self.spec.shutdown_timeout_s
        return self.spec.ft.term_timeout

    # -- setup / teardown --------------------------------------------------------------
    def _setup(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        prefix = unique_prefix("ft")
        r, self._sweeper_w = os.pipe()
        self._sweeper = subprocess.Popen(
            [sys.executable, "-m", "trainguard.fault_tolerance._sweeper", self.launch_id,
             str(r), prefix, self.socket_path(0)[:-len("0.sock")]], pass_fds=(r,),
            start_new_session=True, stdin=subprocess.DEVNULL)
        os.close(r)
        self.slots = [Slot(f"{prefix}{i}", create=True) for i in range(self.spec.nproc_per_node)]
        if self.spec.ft.warm_restart and not self.spec.no_python:
            self.server = ForkServer(self.spec.ft.preload, self.infra_env())
        self.monitors = [_MonitorHandle(self, i) for i in range(self.spec.nproc_per_node)]
        self._install_signals()
        for m in self.monitors:
            self._await_monitor(m)
        if self.server is not None and not self.server.wait_ready(120.0):
            self.cold_reason = self.server.reason
            _log.warning("warm restart off, spawning workers cold: %s", self.cold_reason)
            self.server = None
        elif self.server is None:
            self.cold_reason = "--no-python" if self.spec.no_python else "--ft-warm-restart off"

    def _await_monitor(self, m: _MonitorHandle) -> None:
        import select

        if not select.select([m.sock], [], [], 30.0)[0]:
            raise LauncherError(f"rank monitor of local rank {m.local_rank} did not start "
                                "within 30 s")
        decode_msg(m.reader.recv()[1])

    def _install_signals(self) -> None:
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        names = set(self.spec.ft.forward_signals) | set(self.spec.signals_to_handle) | {
            "SIGTERM", "SIGINT"}
        for name in names:
            signum = signal_number(name)
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def _teardown(self) -> None:
        for thread in self.background:  # attribution of the last cycles (bounded)
            thread.join(30.0)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        if self._old_handlers:
            signal.set_wakeup_fd(-1)
        helpers = [(m.proc, m.sock) for m in self.monitors]
        if self.server is not None:
            helpers.append((self.server.proc, self.server.sock))
        stop_helpers(helpers)  # together, against one deadline (not one second each)
        self.sweep_descendants()
        self.pump.close()
        for s in self.slots:
            s.close()
        if self._sweeper_w is not None:
            os.close(self._sweeper_w)  # the sweeper sweeps once more, then exits
            self._sweeper_w = None
        if self._sweeper is not None:
            try:
                self._sweeper.wait(5.0)
            except subprocess.TimeoutExpired:
                terminate_processes([self._sweeper], grace_s=0.0, first_signal=signal.SIGKILL)
        os.close(self.wake_r)
        os.close(self.wake_w)

    def reap_adopted(self) -> None:
        """Reap orphans adopted as child subreaper (zombies that are none of our own handles;
        ``waitpid(-1)`` would steal our ``Popen`` objects' exit statuses)."""
        own = {m.proc.pid for m in self.monitors}
        if self.server is not None:
            own.add(self.server.proc.pid)
        if self._sweeper is not None:
            own.add(self._sweeper.pid)
        own.update(w.pid for w in self.current or [] if w.popen is not None)
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            try:
                if child.pid not in own and child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError, OSError):
                continue

    def sweep_descendants(self) -> None:
        """SIGKILL leftover job processes (marker scan), sparing monitors and the fork server."""
        keep = {m.proc.pid for m in self.monitors}
        if self.server is not None:
            keep.add(self.server.proc.pid)
        for pid in marked_pids(self.launch_id):
            if pid not in keep:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    # -- monitors ----------------------------------------------------------------------
    def poll_monitors(self, ready: list[int]) -> list[dict[str, Any]]:
        """Messages from monitors whose channel is readable; respawns dead monitors."""
        out = []
        for i, m in enumerate(self.monitors):
            if m.sock.fileno() not in ready:
                continue
            try:
                out.append(decode_msg(m.reader.recv()[1])[0])
            except (EOFError, OSError, FrameError):
                self._respawn_monitor(i)
        return out

    def _respawn_monitor(self, i: int) -> None:
        old = self.monitors[i]
        status = old.proc.poll()
        old.close()
        _log.error("rank monitor of local rank %d died (%s); respawning it (hang detection for "
                   "that rank continues from its shared-memory slot)", i, describe_exit(status))
        new = _MonitorHandle(self, i)
        self._await_monitor(new)
        self.monitors[i] = new
        if self.current is not None:
            w = self.current[i]
            if w.exitcode is None:
                new.send({"op": "cycle", "cycle": len(self.results), "pid": w.pid,
                          "start_ns": w.started_ns})

    current: list[Worker] | None = None

    def report_overdue(self) -> None:
        """Log ranks that are past a section's timeout but still reporting progress."""
        now = time.monotonic_ns()
        limits = self.spec.ft.rank_section_timeouts
        for idx, name in enumerate(self.spec.ft.section_names):
            waiting = {}
            for lr, slot in enumerate(self.slots):
                opened, _ = slot.section_state(idx)
                if opened and (now - opened) / 1e9 > limits[name]:
                    waiting[self.rank_of(lr)] = (now - opened) / 1e9
            if waiting:
                _log.warning("waiting on ranks %s in section %s for %.0f s", sorted(waiting),
                             name, max(waiting.values()))

    # -- workers -----------------------------------------------------------------------
    def worker_env(self, cycle: int, local_rank: int, port: int) -> dict[str, str]:
        spec, world = self.spec, self.spec.nproc_per_node
        rank = self.rank_of(local_rank)
        env = dict(os.environ)
        if world > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        env.update({
            "RANK": str(rank), "LOCAL_RANK": "0" if spec.virtual_local_rank else str(local_rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": str(spec.node_rank), "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_NAME": spec.role, "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": spec.run_id, "TORCHELASTIC_RESTART_COUNT": str(cycle),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_ERROR_FILE": self.error_file(cycle, local_rank),
            ENV_MARKER: self.launch_id, "TRAINGUARD_FT_SLOT": self.slots[local_rank].name,
            "TRAINGUARD_FT_SOCKET": self.socket_path(local_rank),
            "TRAINGUARD_FT_SECTIONS": ",".join(spec.ft.section_names),
            "TRAINGUARD_FT_PARENT": str(os.getpid()),
        })
        if "TRAINGUARD_STORE_PORT" not in os.environ:  # inprocess.Wrapper's store, fresh per cycle
            env["TRAINGUARD_STORE_PORT"] = str(self.store_port)
        auto = spec.ft.auto_heartbeat_timeout
        env["TRAINGUARD_FT_AUTO_HB_INTERVAL"] = str(min(1.0, auto / 10)) if auto else "0"
        return env

    def _mode(self) -> str:
        return "exec" if self.spec.no_python else "module" if self.spec.module else "script"

    def _spawn(self, cycle: int, local_rank: int, port: int) -> Worker:
        spec = self.spec
        env = self.worker_env(cycle, local_rank, port)
        rank = self.rank_of(local_rank)
        attempt = os.path.join(self.run_dir, f"attempt_{cycle}", str(local_rank))
        os.makedirs(attempt, exist_ok=True)
        console = spec.local_ranks_filter is None or local_rank in spec.local_ranks_filter
        redir = spec.redirects.get(local_rank, 0)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.pump.add(rank, out_r, False, os.path.join(attempt, "stdout.log"),
                      console and not redir & 1)
        self.pump.add(rank, err_r, True, os.path.join(attempt, "stderr.log"),
                      console and not redir & 2)
        try:
            return self._start(local_rank, rank, env, out_w, err_w)
        finally:
            os.close(out_w)
            os.close(err_w)

    def _start(self, local_rank: int, rank: int, env: dict[str, str], out_w: int, err_w: int
               ) -> Worker:
        mode, now = self._mode(), time.monotonic_ns()
        args = list(self.spec.script_args)
        if self.server is not None and self.server.ready:
            try:
                pid = self.server.spawn(mode, self.spec.script, args, env, out_w, err_w)
                return Worker(rank, local_rank, pid, True, now)
            except OSError as exc:
                self.cold_reason = f"fork server failed: {exc}"
                _log.warning("warm restart off, spawning workers cold: %s", self.cold_reason)
                self.server.close()
                self.server = None
        proc = spawn_cold(mode, self.spec.script, args, env, out_w, err_w)
        return Worker(rank, local_rank, proc.pid, False, now, popen=proc)

    def collect_exits(self, res: _cycle.CycleResult, workers: list[Worker], timeout_s: float
                      ) -> None:
        """Wait (bounded) for exit statuses of every worker; records them in ``res.exits``."""
        deadline = Deadline(timeout_s)
        by_pid = {w.pid: w for w in workers}
        while any(w.exitcode is None for w in workers) and not deadline.expired():
            for w in workers:
                if w.popen is not None and w.exitcode is None and w.popen.poll() is not None:
                    self._record_exit(res, w, w.popen.returncode)
            if self.server is not None:
                for pid, status in self.server.poll_events():
                    if pid in by_pid:
                        self._record_exit(res, by_pid[pid], status)
            time.sleep(0.005)

    def _record_exit(self, res: _cycle.CycleResult, w: Worker, status: int) -> None:
        if w.exitcode is None:
            w.exitcode, w.exit_ns = status, time.monotonic_ns()
            res.exits.setdefault(w.rank, status)

    # -- cycles ------------------------------------------------------------------------
    def _reserve_ports(self) -> tuple[list[socket.socket], int, int]:
        """Fresh MASTER_PORT and TRAINGUARD_STORE_PORT (inprocess.Wrapper's store) for a cycle,
        held by bound sockets until the cycle ends (two jobs started at once never collide)."""
        held = [reserve_port("127.0.0.1") for _ in range(2)]
        store_port = int(held[1].getsockname()[1])
        if self.spec.master_port:
            held[0].close()
            return held[1:], self.spec.master_port, store_port
        return held, int(held[0].getsockname()[1]), store_port

    def _run_cycle(self, cycle: int) -> _cycle.CycleResult:
        res = _cycle.CycleResult(cycle, started_ns=time.monotonic_ns())
        for s in self.slots:
            s.reset(cycle)
        held, port, store_port = self._reserve_ports()
        self.store_port = store_port
        self.pump.open_cycle(self.cycle_log(cycle))
        t0 = time.monotonic()
        workers: list[Worker] = []
        self.liveness.enter(LauncherState.RUNNING, cycle, wait_s=30.0)  # spawning
        try:
            for lr in range(self.spec.nproc_per_node):
                workers.append(self._spawn(cycle, lr, port))
            self.spawn_times.append({"cycle": cycle, "spawn_s": time.monotonic() - t0})
            for w in workers:
                self.event("spawned", cycle=cycle, rank=w.rank, pid=w.pid, warm=w.warm)
            res.warm = all(w.warm for w in workers)
            self.current = workers
            for m, w in zip(self.monitors, workers):
                m.send({"op": "cycle", "cycle": cycle, "pid": w.pid, "start_ns": w.started_ns})
            _log.info("cycle %d: started %d worker(s) (%s), MASTER_PORT=%d", cycle, len(workers),
                      "warm fork" if res.warm else "cold spawn", port)
            watch = StragglerWatch(self.slots, self.rank_of, cycle).start()
            try:
                _cycle.watch_cycle(self, res, workers)
            finally:
                res.stragglers = watch.stop()
        finally:
            last = res.outcome is not _cycle.Outcome.FAILED or cycle >= self.spec.max_restarts
            ft = self.spec.ft
            self.liveness.enter(LauncherState.STOPPING if last else LauncherState.RESTARTING,
                                cycle, ft.workers_stop_timeout + ft.rank_termination_grace + 12.0)
            _cycle.stop_workers(self, res, workers)
            for m in self.monitors:
                m.send({"op": "idle"})
            self.current = None
            res.progress = _cycle.slot_progress(self)
            res.ended_ns = time.monotonic_ns()
            self.pump.end_cycle()
            if res.outcome is _cycle.Outcome.SUCCEEDED:  # the cycle log says the job ended
                try:
                    append_record(self.cycle_log(cycle), self.node, res)
                except OSError as exc:
                    _log.warning("cycle %d: cannot append the launcher record: %s", cycle, exc)
            for sock in held:
                sock.close()
        return res

    def run(self) -> int:
        """Run the job; returns the launcher's exit code. Always tears everything down."""
        try:
            self._setup()
            return self._loop()
        finally:
            self.liveness.enter(LauncherState.STOPPING, wait_s=60.0)
            self._teardown()
            if self.health_server is not None:
                self.health_server.close()
            print_summary(self)
            self.drop_empty_run_dir()

    def drop_empty_run_dir(self) -> None:
        """Remove the temporary run directory when nothing was written to it (an early exit:
        bad input, an unreachable store); a ``--log-dir`` or a non-empty one stays."""
        if self._own_run_dir:
            try:
                os.rmdir(self.run_dir)
            except OSError:
                pass  # not empty (cycle logs the user may read) or already gone

    def _health_dirs(self) -> list[str]:
        ckpt = self.spec.ft.checkpoint_iteration_file
        return [self.run_dir] + ([os.path.dirname(os.path.abspath(ckpt))] if ckpt else [])

    def check_node_health(self, cycle: int) -> bool:
        """Run the node health checks before ``cycle`` (bounded by --ft-health-check-timeout);
        False (logged, recorded as an event) when this node is unhealthy."""
        if not self.health_checks:
            return True
        timeout = self.spec.health_check_timeout_s
        self.liveness.enter(LauncherState.RENDEZVOUS, cycle, wait_s=timeout + 5.0)
        report = run_health_checks(self.health_checks, timeout)
        self.event("health_check", cycle=cycle, ok=report.ok,
                   results=[{"name": r.name, "ok": r.ok, "reason": r.reason,
                             "elapsed_s": round(r.elapsed_s, 3)} for r in report.results])
        if not report.ok:
            _log.error("node unhealthy before cycle %d: %s; not starting workers (exit %d)",
                       cycle, report.summary(), EXIT_UNHEALTHY)
        return report.ok

    def _loop(self) -> int:
        cycle = 0
        while True:
            if not self.check_node_health(cycle):
                return EXIT_UNHEALTHY
            res = self._run_cycle(cycle)
            self.results.append(res)
            if res.outcome is _cycle.Outcome.SUCCEEDED:
                return 0
            if res.outcome is _cycle.Outcome.SIGNALLED:
                ok = res.exits and all(c == 0 for c in res.exits.values())
                return 0 if ok else 128 + res.signum
            self.liveness.enter(LauncherState.RESTARTING, cycle, wait_s=60.0)  # attribution
            code = after_failure(self, res)
            if code is not None:
                return code
            if cycle >= self.spec.max_restarts:
                _log.error("cycle %d failed and no restart is left (--max-restarts %d)", cycle,
                           self.spec.max_restarts)
                return EXIT_FAILED
            cycle += 1
            _log.warning("restarting all workers: restart %d of at most %d (cycle %d)", cycle,
                         self.spec.max_restarts, cycle)


def check_master_port(spec: LaunchSpec) -> None:
    """An explicit ``--master-port`` must be free (nothing listening on it).

    Raises:
        LaunchConfigError: the port is in use.
    """
    if not spec.master_port:
        return
    try:
        reserve_port("0.0.0.0", spec.master_port).close()
    except OSError as exc:
        raise LaunchConfigError(f"--master-port {spec.master_port} is in use ({exc.strerror}); "
                                "pick another port or omit it to let the launcher choose"
                                ) from None
