"""Goodput under faults, end to end: the run behind ``bench/goodput.py`` and ``trainguard demo
--duration``.

The same DDP job (``_goodput_rank``: gloo, a step of ``step_ms``, a checkpoint every
``checkpoint_every`` steps) runs for ``duration_s`` seconds with a fault every ``fault_every_s``
seconds drawn from a seeded mix: an exception, a SIGKILL, a hang in a C call (GIL released), a
hang holding the GIL, and a full disk for one save (the checkpoint directory is a private 64 MiB
tmpfs that is filled for ``disk_full_s`` seconds; this needs root to mount, otherwise that kind
is left out and the result says so). Mode ``ours``: trainguard's in-process restart with
``ranks`` active plus ``reserve`` spare processes (a SIGKILL or a GIL hang removes a rank for
good) and asynchronous checkpoints. Mode ``baseline``: ``torchrun --max-restarts`` restarting
every worker on each fault, with a synchronous ``torch.save`` on rank 0.

Definitions (from the ranks' event logs, wall-clock seconds):

* window: the job's first training step (``t_train``, when the first rank started it) -> the
  last step's end, about ``duration_s``; fault times count from ``t_train`` too (process start-up
  before it is excluded for both modes; a baseline restart's start-up inside it counts as lost);
* schedule: faults at ``fault_every_s``, 2x, ... after ``t_train``, every one that leaves
  :attr:`GoodputConfig.recovery_room_s` before the end: ``floor(D / S)`` faults, less the last
  when ``D - floor(D / S) * S`` is below that room (30 s every 8 s: 8, 16, 24 s);
* goodput: kept steps x the median step time / window, where kept steps is the step the job
  ended at (steps redone after a roll-back count once);
* lost time of a fault: its injection -> the job again completes the step it was at, minus one
  median step (detection, restart, checkpoint reload and redone steps);
* recovered: the job regained that step; for a full disk, also a checkpoint committed after the
  disk was freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from trainguard._core.clock import Deadline
from trainguard._core.net import free_port
from trainguard._core.procs import terminate_processes

__all__ = ["KINDS", "RESTART_ALLOWANCE_S", "GoodputConfig", "ModeRun", "OnTick", "fault_plan",
           "figures", "result_json", "run_modes"]

KINDS = ("exception", "sigkill", "hang_c", "hang_gil", "disk_full")
_RANK_MODULE = "trainguard._demo._goodput_rank"
#: a restart after detection, seconds: rebuild the group, reload the newest checkpoint, redo the
#: steps since it (1-2.2 s median lost per fault in BENCHMARKS.md, a reserve rank's takeover
#: included)
RESTART_ALLOWANCE_S = 2.0


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    """One goodput run; durations in seconds (see the module docstring)."""

    duration_s: float = 180.0
    ranks: int = 4
    reserve: int | None = None  # None: one per rank-removing fault in the plan
    fault_every_s: float = 30.0
    seed: int = 0
    step_ms: float = 50.0
    checkpoint_every: int = 20
    # what a user with a 50 ms step configures: 30 steps without progress -> interrupt, 60 ->
    # kill (a GIL-holding hang is killed ~1 s after the soft timeout: it cannot be interrupted)
    soft_timeout_s: float = 1.5
    hard_timeout_s: float = 3.0
    pg_timeout_s: float = 30.0
    disk_full_s: float = 3.0
    kinds: tuple[str, ...] = KINDS

    @property
    def recovery_room_s(self) -> float:
        """Seconds a fault needs before the end of the run to be detected and recovered: the
        slowest detection (a GIL-holding hang is killed at ``hard_timeout_s``; a full disk lasts
        ``disk_full_s``) plus :data:`RESTART_ALLOWANCE_S` for the restart (5 s by default)."""
        return max(self.hard_timeout_s, self.disk_full_s) + RESTART_ALLOWANCE_S


#: called about every 0.5 s while a mode runs (parent's main thread): (mode, its event directory,
#: the fault plan, the full-disk faults fired so far as (plan index, start, end)); must not block
OnTick = Callable[[str, str, list[dict[str, Any]], list[tuple[int, float, float]]], None]


@dataclasses.dataclass
class ModeRun:
    """How one mode went: its event logs' figures and whether its processes ended cleanly."""

    mode: str
    figures: dict[str, Any]
    ok: bool
    exit_codes: list[int | None]


def fault_plan(cfg: GoodputConfig, disk_ok: bool) -> list[dict[str, Any]]:
    """Faults at ``fault_every_s``, 2x, ... seconds after training starts, each leaving
    ``cfg.recovery_room_s`` before the end (see the module docstring): a seeded shuffle of the
    kinds, cycled, each on a seeded active rank."""
    rng = random.Random(cfg.seed)
    kinds = [k for k in cfg.kinds if disk_ok or k != "disk_full"]
    order: list[str] = []
    plan = []
    k = 1
    while (t := k * cfg.fault_every_s) <= cfg.duration_s - cfg.recovery_room_s:
        if not order:
            order = rng.sample(kinds, len(kinds))
        plan.append({"t": t, "kind": order.pop(0), "rank": rng.randrange(cfg.ranks)})
        k += 1
    return plan


# -- the checkpoint filesystem and the full disk ------------------------------------------------
@contextlib.contextmanager
def checkpoint_fs(work: str, want_tmpfs: bool) -> Iterator[tuple[str, bool]]:
    """A directory for checkpoints: a private 64 MiB tmpfs when root (so the disk can be filled
    for real), else a plain directory. Yields (path, is_tmpfs); unmounts in ``finally``."""
    path = os.path.join(work, "ckpt_fs")
    os.makedirs(path, exist_ok=True)
    mounted = False
    if want_tmpfs and os.geteuid() == 0:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", path],
                             capture_output=True, check=False, timeout=30)
        mounted = res.returncode == 0
    try:
        yield path, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", path], capture_output=True, check=False, timeout=30)


def _fill(path: str) -> None:
    """Fill the filesystem holding ``path`` with ``path/balloon``."""
    fd = os.open(os.path.join(path, "balloon"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (1 << 20, 4096, 1):  # unbuffered: ENOSPC shows here, not at close
            chunk = b"\0" * size
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, chunk)
    finally:
        os.close(fd)


class DiskFaults(threading.Thread):
    """Parent-side ``disk_full`` faults: at each planned time fill the checkpoint filesystem for
    ``hold_s`` seconds, then free it. ``fired`` holds (plan index, start, end)."""

    def __init__(self, plan: list[dict[str, Any]], out: str, fs: str, hold_s: float) -> None:
        super().__init__(name="goodput-disk-faults", daemon=True)
        self.todo = [(i, f) for i, f in enumerate(plan) if f["kind"] == "disk_full"]
        self.out, self.fs, self.hold_s = out, fs, hold_s
        self.stop = threading.Event()
        self.fired: list[tuple[int, float, float]] = []
        self.filling: tuple[int, float] | None = None  # (plan index, start) while the disk is full

    def run(self) -> None:
        from trainguard._demo._goodput_rank import read_t_train

        if not self.todo:
            return
        while not os.path.exists(os.path.join(self.out, "t_train")):  # training not started
            if self.stop.wait(0.1):
                return
        t_train = read_t_train(self.out, create=False)
        for i, f in self.todo:
            if self.stop.wait(max(0.0, t_train + f["t"] - time.time())):
                return
            start = time.time()
            self.filling = (i, start)
            try:
                _fill(self.fs)
                self.stop.wait(self.hold_s)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.fs, "balloon"))
            self.fired.append((i, start, time.time()))
            self.filling = None

    def so_far(self) -> list[tuple[int, float, float]]:
        """``fired``, plus the fault in progress (its end at infinity: not yet recovered)."""
        filling = self.filling
        return [*self.fired, *([] if filling is None else [(*filling, math.inf)])]


# -- launching ----------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
               TRAINGUARD_LOG_LEVEL="WARNING")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TRAINGUARD_STORE_PORT"):
        env.pop(key, None)
    return env


def _rank_args(mode: str, out: str, ckpt: str, plan: list[dict[str, Any]],
               cfg: GoodputConfig) -> list[str]:
    return [
        "--mode", mode, "--out", out, "--ckpt-dir", ckpt, "--duration", str(cfg.duration_s),
        "--plan", json.dumps(plan),
        "--step-ms", str(cfg.step_ms), "--ckpt-every", str(cfg.checkpoint_every),
        "--active", str(cfg.ranks), "--soft-timeout", str(cfg.soft_timeout_s),
        "--hard-timeout", str(cfg.hard_timeout_s), "--pg-timeout", str(cfg.pg_timeout_s),
    ]


def _commands(mode: str, cfg: GoodputConfig, reserve: int, rank_args: list[str]
              ) -> list[tuple[list[str], dict[str, str], str]]:
    """(argv, extra env, log name) per process to start."""
    if mode == "baseline":
        restarts = int(cfg.duration_s // cfg.fault_every_s) + 2
        return [([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc-per-node={cfg.ranks}", f"--max-restarts={restarts}",
                  "--monitor-interval=0.5", "-m", _RANK_MODULE, *rank_args], {}, "agent")]
    world = cfg.ranks + reserve
    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TRAINGUARD_STORE_PORT": str(free_port())}  # MASTER_PORT+1 may be taken
    return [([sys.executable, "-m", _RANK_MODULE, *rank_args], {**env, "RANK": str(r)},
             f"rank{r}") for r in range(world)]


def _watch(procs: list[subprocess.Popen], limit_s: float,
           tick: Callable[[], None] | None = None) -> tuple[bool, set[int]]:
    """Wait for every process (at most ``limit_s``), remembering their descendants (the
    wrapper's monitor processes, checkpoint writers) to stop them afterwards; ``tick`` is
    called every poll (0.5 s)."""
    seen: set[int] = set()
    deadline = Deadline(limit_s)
    while any(p.poll() is None for p in procs):
        if deadline.expired():
            return True, seen
        for p in procs:
            with contextlib.suppress(psutil.Error):
                seen.update(c.pid for c in psutil.Process(p.pid).children(recursive=True))
        if tick is not None:
            tick()
        time.sleep(0.5)
    return False, seen


def run_mode(mode: str, cfg: GoodputConfig, work: str, plan: list[dict[str, Any]], fs: str,
             reserve: int, on_tick: OnTick | None = None) -> ModeRun:
    """Run one mode to its end time (blocks about ``duration_s`` plus start-up; at most
    ``duration_s`` + 120 s + the baseline's hang timeouts), stop and reap everything it
    started, and compute its figures. ``on_tick`` (see :data:`OnTick`) shows live progress."""
    out, ckpt = os.path.join(work, mode), os.path.join(fs, mode)
    os.makedirs(out)
    os.makedirs(ckpt)
    rank_args = _rank_args(mode, out, ckpt, plan, cfg)
    disk = DiskFaults(plan, out, fs, cfg.disk_full_s)
    procs: list[subprocess.Popen] = []
    timed_out, helpers = True, set[int]()
    try:
        for argv, extra, name in _commands(mode, cfg, reserve, rank_args):
            with open(os.path.join(work, f"{mode}_{name}.log"), "wb") as log:
                procs.append(subprocess.Popen(argv, env={**_env(), **extra}, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        disk.start()
        limit = cfg.duration_s + 120.0 + (len(plan) + 1) * cfg.pg_timeout_s
        tick = None if on_tick is None else (lambda: on_tick(mode, out, plan, disk.so_far()))
        timed_out, helpers = _watch(procs, limit, tick)
    finally:
        disk.stop.set()
        if disk.is_alive():
            disk.join(timeout=30)
        terminate_processes([*procs, *helpers], grace_s=3.0)
    codes = [p.returncode for p in procs]
    ok = not timed_out and (codes == [0] if mode == "baseline" else 0 in codes)
    t_train = None
    with contextlib.suppress(OSError, ValueError):
        t_train = float(Path(out, "t_train").read_text())
    return ModeRun(mode, figures(load_events(out), plan, disk.fired, t_train), ok, codes)


def run_modes(cfg: GoodputConfig, work: str, modes: tuple[str, ...] = ("ours", "baseline"),
              on_tick: OnTick | None = None
              ) -> tuple[list[dict[str, Any]], dict[str, ModeRun], bool, int]:
    """Plan the faults and run each mode in turn; returns (plan, runs by mode, disk fault
    possible, reserve ranks). ``on_tick`` is passed to :func:`run_mode`."""
    runs: dict[str, ModeRun] = {}
    with checkpoint_fs(work, "disk_full" in cfg.kinds) as (fs, tmpfs):
        plan = fault_plan(cfg, disk_ok=tmpfs)
        removing = sum(f["kind"] in ("sigkill", "hang_gil") for f in plan)
        reserve = removing if cfg.reserve is None else cfg.reserve
        for mode in modes:
            runs[mode] = run_mode(mode, cfg, work, plan, fs, reserve if mode == "ours" else 0,
                                  on_tick)
    return plan, runs, tmpfs, reserve


# -- figures ------------------------------------------------------------------------------------
def load_events(out: str) -> list[dict[str, Any]]:
    """Every rank process's events (``ev_*.jsonl``), in time order; torn lines skipped."""
    events = []
    for path in Path(out).glob("ev_*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def figures(events: list[dict[str, Any]], plan: list[dict[str, Any]],
            disk: list[tuple[int, float, float]], t_train: float | None = None) -> dict[str, Any]:
    """Goodput and per-fault lost time of one mode (see the module docstring); ``t_train`` is
    when training started (default: the first step's start)."""
    steps = [e for e in events if e["ev"] == "step"]
    if not steps:
        return {"goodput": 0.0, "faults": [_row(f, None, None) for f in plan], "kept_steps": 0,
                "median_step_ms": 0.0, "window_s": 0.0, "commits": 0}
    median_step = statistics.median(e["t"] - e["t0"] for e in steps)
    window = steps[-1]["t"] - (min(e["t0"] for e in steps) if t_train is None else t_train)
    kept = steps[-1]["step"]
    commits = [e["t"] for e in events if e["ev"] == "commit"]
    fired = {e["i"]: (e["t"], e["step"]) for e in events if e["ev"] == "fault"}
    freed = {}
    for i, start, end in disk:  # the job was at the newest step logged when the disk filled
        before = [e["step"] for e in steps if e["t"] <= start]
        fired[i] = (start, (max(before) if before else 0) + 1)
        freed[i] = end
    rows = []
    for i, f in enumerate(plan):
        back = None
        if i in fired:
            t_fault, at = fired[i]
            back = next((e["t"] - t_fault for e in steps if e["t"] > t_fault and e["step"] >= at),
                        None)
        row = _row(f, fired.get(i), None if back is None else max(0.0, back - median_step))
        if i in freed:  # a full disk is over when a checkpoint commits again
            row["recovered"] = row["recovered"] and any(t > freed[i] for t in commits)
        rows.append(row)
    return {"goodput": kept * median_step / window if window > 0 else 0.0, "kept_steps": kept,
            "median_step_ms": median_step * 1e3, "window_s": window, "commits": len(commits),
            "faults": rows}


def _row(fault: dict[str, Any], fired: tuple[float, int] | None,
         lost_s: float | None) -> dict[str, Any]:
    return {"kind": fault["kind"], "rank": fault["rank"], "t": fault["t"],
            "fired": fired is not None, "lost_s": lost_s, "recovered": lost_s is not None}


def median_lost(fig: dict[str, Any]) -> float | None:
    """Median lost seconds over the faults that fired and were recovered."""
    lost = [r["lost_s"] for r in fig["faults"] if r.get("lost_s") is not None]
    return round(statistics.median(lost), 3) if lost else None


def result_json(cfg: GoodputConfig, plan: list[dict[str, Any]], runs: dict[str, ModeRun],
                tmpfs: bool, reserve: int) -> dict[str, Any]:
    """The benchmark's final JSON object (``baseline_*`` keys None when it did not run)."""
    ours, base = runs["ours"].figures, runs["baseline"].figures if "baseline" in runs else None
    return {
        "goodput": round(ours["goodput"], 4),
        "baseline_goodput": None if base is None else round(base["goodput"], 4),
        "lost_s_per_fault_median": median_lost(ours),
        "baseline_lost_s_per_fault_median": None if base is None else median_lost(base),
        "faults_injected": sum(r["fired"] for r in ours["faults"]),
        "faults_recovered": sum(bool(r["recovered"]) for r in ours["faults"]),
        "baseline_faults_recovered": None if base is None
        else sum(bool(r["recovered"]) for r in base["faults"]),
        "faults_planned": len(plan),
        "fault_kinds": sorted({f["kind"] for f in plan}),
        "ratio_vs_baseline": round(ours["goodput"] / base["goodput"], 2)
        if base and base["goodput"] else None,
        "duration_s": cfg.duration_s, "ranks": cfg.ranks, "reserve": reserve,
        "step_ms": cfg.step_ms, "checkpoint_every": cfg.checkpoint_every, "seed": cfg.seed,
        "disk_full_tmpfs": tmpfs, "ok": all(r.ok for r in runs.values()),
    }
