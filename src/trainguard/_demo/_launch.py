"""Launch the demo's rank processes, show progress, and reap everything they started.

Ranks are plain subprocesses (not torchrun: torchrun stops every worker when one dies, which is
exactly the fault the in-process wrapper must survive). Each gets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` for the wrapper's store. The parent waits
against one global deadline, then stops survivors (SIGTERM -> grace -> SIGKILL) and also the
wrapper's monitor processes, found through their pidfiles and by watching the ranks' descendants.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.live import Live

from trainguard._core.clock import Deadline
from trainguard._core.net import free_port
from trainguard._core.procs import describe_exit, terminate_processes
from trainguard._demo._config import DemoConfig
from trainguard._demo._events import EventTail
from trainguard._demo._progress import RunView

__all__ = ["LaunchResult", "launch"]

POLL_S = 0.25
MONITOR_EXIT_WAIT_S = 10.0  # monitors notice their trainer's exit within their own interval


@dataclasses.dataclass
class LaunchResult:
    """How the run went at the process level.

    Attributes:
        t0: launch time (wall clock, seconds); wall_s: launch -> every process reaped, seconds.
        exits: per initial rank, how its process ended (text).
        returncodes: per initial rank, its exit status (negative: killed by that signal).
        timed_out: the global deadline expired and the parent stopped the ranks.
        leftover: pids of helper processes that had to be killed by the parent.
        ranks_s: launch -> the last rank process exited (or the deadline), seconds.
    """

    t0: float
    wall_s: float
    ranks_s: float
    exits: dict[int, str]
    returncodes: dict[int, int | None]
    timed_out: bool
    leftover: list[int]


def _rank_env(config: DemoConfig, rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(config.world_size), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
        TORCH_CPP_LOG_LEVEL=env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        TRAINGUARD_LOG_LEVEL=env.get("TRAINGUARD_LOG_LEVEL", "INFO"),
    )
    env.pop("LOCAL_RANK", None)  # the ranks are not under a launcher that owns devices
    env.pop("TRAINGUARD_STORE_PORT", None)  # MASTER_PORT is the wrapper's store here
    return env


def _spawn(config: DemoConfig, config_path: Path) -> dict[int, subprocess.Popen]:
    port = free_port()
    procs: dict[int, subprocess.Popen] = {}
    try:
        for rank in range(config.world_size):
            with open(config.log_path(rank), "wb") as log:  # the child keeps its own descriptor
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "trainguard._demo._rank", str(config_path)],
                    env=_rank_env(config, rank, port), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT,
                )
    except BaseException:
        terminate_processes(procs.values(), grace_s=2.0)
        raise
    return procs


def _descendants(procs: dict[int, subprocess.Popen], seen: dict[int, float]) -> None:
    """Remember every process the ranks started (pid -> create time) while they are alive."""
    for proc in procs.values():
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child.create_time())
        except psutil.Error:
            continue


def _monitor_pids(config: DemoConfig, since: float) -> dict[int, float]:
    """Pids from the wrapper's monitor pidfiles that belong to this run (created after
    ``since``)."""
    out = {}
    for path in (config.root / "pids").glob("monitor*.pid"):
        try:
            pid = int(path.read_text().split()[0])
            out[pid] = psutil.Process(pid).create_time()
        except (OSError, ValueError, IndexError, psutil.Error):
            continue
    return {pid: ct for pid, ct in out.items() if ct >= since - 1.0}


def _reap_helpers(helpers: dict[int, float]) -> list[int]:
    """Give helper processes time to exit on their own, then stop the rest; returns those
    stopped."""

    def alive() -> list[int]:
        out = []
        for pid, created in helpers.items():
            try:
                proc = psutil.Process(pid)
                if (
                    abs(proc.create_time() - created) < 0.01
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    out.append(pid)
            except psutil.Error:
                continue
        return out

    deadline = Deadline(MONITOR_EXIT_WAIT_S)
    while (left := alive()) and not deadline.expired():
        time.sleep(0.1)
    if left:
        terminate_processes(left, grace_s=2.0)
    return left


def _wait(
    procs, view: RunView, tail: EventTail, timeout_s: float, live: bool, helpers: dict
) -> bool:
    """Poll until every rank exited or ``timeout_s`` passed; returns True on timeout."""
    deadline = Deadline(timeout_s)
    running = dict(procs)
    while running:
        view.feed(tail.poll(), live)
        _descendants(running, helpers)
        for rank, proc in list(running.items()):
            if proc.poll() is not None:
                view.process_exited(rank, proc.returncode, live)
                del running[rank]
        if deadline.expired():
            return bool(running)
        time.sleep(POLL_S)
    view.feed(tail.poll(), live)
    return False


def launch(
    config: DemoConfig, config_path: Path, *, timeout_s: float, console: Console
) -> LaunchResult:
    """Run the demo's ranks to completion (or ``timeout_s`` seconds) and reap them.

    Blocks at most ``timeout_s`` + about 20 s (grace periods). Ctrl-C stops the ranks and
    propagates ``KeyboardInterrupt``.
    """
    live = console.is_terminal
    view = RunView(console, config.steps, len(config.faults), config.world_size)
    tail = EventTail(config.root / "events")
    helpers: dict[int, float] = {}
    t0, start = time.time(), time.monotonic()
    procs = _spawn(config, config_path)
    timed_out, ranks_s = False, 0.0
    try:
        if live:
            with Live(console=console, refresh_per_second=4, get_renderable=view.renderable):
                timed_out = _wait(procs, view, tail, timeout_s, live, helpers)
        else:
            timed_out = _wait(procs, view, tail, timeout_s, live, helpers)
        ranks_s = time.monotonic() - start
        if timed_out:
            console.print(
                f"[bold red]global timeout of {timeout_s:.0f} s expired; stopping the ranks"
            )
    finally:
        terminate_processes(procs.values(), grace_s=3.0)
        helpers.update(_monitor_pids(config, t0))
        leftover = _reap_helpers(helpers)
    return LaunchResult(
        t0=t0,
        wall_s=time.monotonic() - start,
        ranks_s=ranks_s,
        exits={r: describe_exit(p.returncode) for r, p in procs.items()},
        returncodes={r: p.returncode for r, p in procs.items()},
        timed_out=timed_out,
        leftover=leftover,
    )
