"""One cycle: start every worker, watch them until all succeed, one fails or hangs, or a signal
arrives; then stop the rest. The first failure (earliest monotonic time) is the cycle's root
cause; later failures, including errors while stopping, never replace it."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
import select
import signal
import time
from typing import TYPE_CHECKING, Any

from trainguard._core.procs import describe_exit, terminate_processes
from trainguard.fault_tolerance._healthport import LauncherState
from trainguard.fault_tolerance._slot import W

if TYPE_CHECKING:
    from trainguard.fault_tolerance._agent import Launcher
    from trainguard.fault_tolerance._spawn import Worker

__all__ = ["CycleResult", "Failure", "Outcome", "watch_cycle"]

_log = logging.getLogger("trainguard.fault_tolerance")


class Outcome(enum.Enum):
    """How a cycle ended. RUNNING -> SUCCEEDED | FAILED | SIGNALLED (terminal)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SIGNALLED = "signalled"


@dataclasses.dataclass
class Failure:
    """One failed rank: ``kind`` is exit | signal | hang | no_client | monitor; multi-node
    adds peer (another node ended the round; ``rank`` -1) and fence (this node lost its
    lease)."""

    rank: int
    kind: str
    detail: str
    at_ns: int
    exitcode: int | None = None


@dataclasses.dataclass
class CycleResult:
    cycle: int
    outcome: Outcome = Outcome.RUNNING
    failures: list[Failure] = dataclasses.field(default_factory=list)
    exits: dict[int, int | None] = dataclasses.field(default_factory=dict)
    signum: int = 0
    started_ns: int = 0
    ended_ns: int = 0
    warm: bool = False
    progress: int = 0
    verdict: str = ""
    stragglers: str = ""  # ranks the straggler watch flagged this cycle (see _stragglers)

    @property
    def root_cause(self) -> Failure | None:
        return min(self.failures, key=lambda f: f.at_ns) if self.failures else None

    def fail(self, failure: Failure) -> None:
        self.failures.append(failure)
        if self.outcome is Outcome.RUNNING:
            self.outcome = Outcome.FAILED


def _error_file_message(path: str) -> str:
    """The message a worker's ``@record`` wrote to ``TORCHELASTIC_ERROR_FILE`` ('' if none)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        msg = data.get("message", "")
        return str(msg.get("message", msg) if isinstance(msg, dict) else msg).strip()
    except (OSError, ValueError, AttributeError):
        return ""


_ERROR_LINE = re.compile(
    r"\b\w*(Error|Exception|Interrupt)\b|SystemExit|^Traceback |Fatal Python error|terminate called"
    r"|what\(\):|Segmentation fault|core dumped|\bFAILED\b")


def is_error_line(line: str) -> bool:
    """True when ``line`` reads as an error (an exception, traceback, fatal or C++ abort line),
    not a warning or ordinary output: only such a line is appended to a signal death's cause."""
    text = line.strip()
    return bool(text) and "Warning" not in text and _ERROR_LINE.search(text) is not None


def _on_exit(launcher: Launcher, res: CycleResult, worker: Worker, status: int) -> None:
    if worker.exitcode is not None:
        return
    worker.exitcode, worker.exit_ns = status, time.monotonic_ns()
    res.exits[worker.rank] = status
    launcher.monitors[worker.local_rank].send({"op": "idle"})  # nothing left to watch
    launcher.event("exited", cycle=res.cycle, rank=worker.rank, status=status)
    if status == 0 or res.outcome is not Outcome.RUNNING:
        return
    detail = describe_exit(status)
    msg = _error_file_message(launcher.error_file(res.cycle, worker.local_rank))
    tail = launcher.pump.tails.get(worker.rank)
    last = msg or next((ln for ln in reversed(tail or []) if ln.strip()), "")
    if status < 0 and not msg and not is_error_line(last):
        last = ""  # no Python traceback: a rank's last stderr line (a warning) is no cause
    if last:
        detail += f": {last.strip()[:300]}"
    res.fail(Failure(worker.rank, "signal" if status < 0 else "exit", detail, worker.exit_ns,
                     status))


def _on_monitor(launcher: Launcher, res: CycleResult, msg: dict[str, Any]) -> None:
    op = msg.get("op")
    if op == "hang" and int(msg.get("cycle", res.cycle)) != res.cycle:
        return  # late report about an earlier cycle's worker
    if op == "hang":
        detected = int(msg.get("detected_ns", time.monotonic_ns()))
        launcher.hang_events.append((res.cycle, int(msg["rank"]), detected, msg))
        wall = time.time() - (time.monotonic_ns() - detected) / 1e9
        launcher.event("hang_detected", cycle=res.cycle, rank=int(msg["rank"]),
                       detected_wall=wall, kind=msg.get("kind"), timeout_s=msg.get("timeout_s"))
        _log.error("rank %s hang detected (%s timeout %.3g s): %s; dumping stacks, stopping it",
                   msg["rank"], msg.get("kind"), msg.get("timeout_s", 0), msg.get("reason"))
        res.fail(Failure(int(msg["rank"]), "no_client" if msg.get("kind") == "no_client"
                         else "hang", f"{msg.get('kind')}: {msg.get('reason')}", detected))
    elif op == "timeouts":
        launcher.calculated[int(msg["rank"])] = msg.get("timeouts") or {}
    elif op == "control":
        _log.warning("rank %s requested %s: %s", msg["rank"], msg.get("action"),
                     msg.get("description", ""))
        if msg.get("action") in ("shutdown_workload", "exclude_this_node"):
            launcher.stop_requested = f"rank {msg['rank']} requested {msg.get('action')}"


def watch_cycle(launcher: Launcher, res: CycleResult, workers: list[Worker]) -> None:
    """Block until the cycle's outcome is decided (no fixed bound: a healthy job runs until it
    ends; every iteration waits at most ``--monitor-interval``)."""
    by_pid = {w.pid: w for w in workers}
    pidfds = {os.pidfd_open(w.popen.pid): w for w in workers if w.popen is not None}
    next_report = time.monotonic() + 5.0
    try:
        while res.outcome is Outcome.RUNNING:
            fds = [launcher.wake_r, *pidfds, *launcher.monitor_fds(), *launcher.extra_fds()]
            if launcher.server is not None and launcher.server.ready:
                fds.append(launcher.server.fileno())
            ready, _, _ = select.select(fds, [], [], launcher.spec.monitor_interval_s)
            launcher.liveness.tick()  # --health-port: the loop is alive
            _collect(launcher, res, by_pid, pidfds, ready)
            launcher.check_external(res, ready)
            if res.outcome is Outcome.RUNNING and all(w.exitcode == 0 for w in workers):
                res.outcome = Outcome.SUCCEEDED
            if time.monotonic() >= next_report:
                launcher.report_overdue()
                launcher.reap_adopted()
                next_report = time.monotonic() + 5.0
    finally:
        for fd in pidfds:
            os.close(fd)


def _collect(launcher: Launcher, res: CycleResult, by_pid: dict[int, Worker],
             pidfds: dict[int, Worker], ready: list[int]) -> None:
    if launcher.wake_r in ready:
        os.read(launcher.wake_r, 512)
    for signum in launcher.take_signals():
        _forward(launcher, res, signum, list(by_pid.values()))
    for fd, worker in pidfds.items():
        if fd in ready and worker.popen is not None and worker.popen.poll() is not None:
            _on_exit(launcher, res, worker, worker.popen.returncode)
    if launcher.server is not None:
        for pid, status in launcher.server.poll_events():
            if pid in by_pid:
                _on_exit(launcher, res, by_pid[pid], status)
    for msg in launcher.poll_monitors(ready):
        _on_monitor(launcher, res, msg)


def _forward(launcher: Launcher, res: CycleResult, signum: int, workers: list[Worker]) -> None:
    """Forward ``signum`` to each rank's main process; SIGTERM/SIGINT end the cycle: each rank
    gets the termination grace, then its tree is SIGKILLed."""
    name = signal.Signals(signum).name
    live = [w for w in workers if w.exitcode is None]
    if signum not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        _log.info("forwarding %s to %d worker(s)", name, len(live))
        for w in live:
            try:
                os.kill(w.pid, signum)
            except ProcessLookupError:
                pass
        return
    grace = launcher.term_grace_s()
    launcher.liveness.enter(LauncherState.STOPPING, wait_s=grace + 5.0)
    _log.warning("received %s: forwarding to %d worker(s), SIGKILL after %.1f s", name, len(live),
                 grace)
    res.outcome, res.signum = Outcome.SIGNALLED, signum
    terminate_processes([w.popen or w.pid for w in live], grace_s=grace, first_signal=signum)
    launcher.collect_exits(res, workers, 2.0)


def stop_workers(launcher: Launcher, res: CycleResult, workers: list[Worker]) -> None:
    """Stop every worker still running (SIGTERM, ``workers_stop_timeout``, SIGKILL of groups and
    trees), then collect the exit statuses (bounded)."""
    live = [w for w in workers if w.exitcode is None]
    hung = {f.rank for f in res.failures if f.kind in ("hang", "no_client")}
    if live:
        grace = launcher.spec.ft.workers_stop_timeout
        others = [w for w in live if w.rank not in hung]
        terminate_processes([w.popen or w.pid for w in others], grace_s=grace, groups=True)
    launcher.collect_exits(res, workers, launcher.spec.ft.rank_termination_grace + 6.0)
    stuck = [w for w in workers if w.exitcode is None]
    if stuck:  # e.g. its monitor died while killing it
        terminate_processes([w.popen or w.pid for w in stuck], grace_s=0.0,
                            first_signal=signal.SIGKILL, groups=True)
        launcher.collect_exits(res, workers, 2.0)
    launcher.sweep_descendants()  # setsid / double-forked descendants carry the job marker


def slot_progress(launcher: Launcher) -> int:
    """Largest client progress counter over the ranks in this cycle."""
    return max((s.get(W.PROGRESS) for s in launcher.slots), default=0)
