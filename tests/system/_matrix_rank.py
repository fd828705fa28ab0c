"""One rank of the combined-use matrix (``run_ranks("_matrix_rank:main", ...)``).

A training function under ``inprocess.Wrapper`` that uses the three checkpointers together, the
way the README's "Using them together" section does: an ``AsyncCheckpointer`` in torch format, one
in DCP format and a ``LocalCheckpointManager``. The asynchronous checkpointers are either made
once per process before the wrapper (``created="outside"``; each iteration rebinds them and
makes every checkpointer group inside ``cw.tracking_process_group()``, as the README shows) or
made inside the wrapped function in every iteration with no tracking (``"inside"``: the seam of
issue 13.1, an abort must release every process group whoever made it). Every iteration:

1. loads the newest checkpoint of each checkpointer and records what it loaded beside what is
   committed on disk and what this process saw committed before the restart;
2. trains (a gloo all-reduce and a short sleep per step), saving on all three every
   ``ckpt_every`` steps and calling the non-blocking ``maybe_finalize`` every step;
3. once every checkpointer has committed a save made in this iteration (or after ``FAULT_AFTER_S``),
   fires the plan's fault for this iteration (``FaultPlan`` keyed by active rank and
   iteration), so each iteration ends in exactly one planned fault while a later save may be
   in flight; the iteration after the last fault commits everything and returns.

The state saved at step ``s`` holds tensors full of ``s``, so a load proves which step it read.
Events go to ``{root}/events/rank{initial rank}.{launch}.jsonl`` (one JSON object per line).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpointing import (
    AsyncCheckpointer,
    CheckpointNotFoundError,
    LocalCheckpointManager,
)
from trainguard.inprocess import (
    CallWrapper,
    Compose,
    MaxActiveWorldSize,
    RetryController,
    ShiftRanks,
    Wrapper,
)
from trainguard.testing import Fault, FaultPlan

NUMEL = 1024
STEP_S = 0.01
MIN_STEPS = 4  # steps of an iteration before its fault, at least
# An iteration in which not every kind commits faults after this anyway (wall time, not steps: the
# first iteration's writers start cold, seconds per torch + DCP import on a loaded 2-core machine).
FAULT_AFTER_S = 30.0
# Restart iterations allowed beyond the plan's: a looping job fails in seconds, not at the bound
# of run_ranks (the test asserts exactly one restart per planned fault anyway).
SPARE_ITERATIONS = 2


class Rank:
    """Process-lifetime state of one rank (kept across in-process restarts)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.root = Path(cfg["root"])
        self.initial_rank = int(os.environ["RANK"])
        self.plan = FaultPlan(Fault(**f) for f in cfg["faults"])
        events = self.root / "events"
        events.mkdir(parents=True, exist_ok=True)
        path = events / f"rank{self.initial_rank}.{cfg['launch']}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.seen: dict[str, int] = {}  # newest step this process saw committed, per kind
        self.outside: dict[str, AsyncCheckpointer] = {}
        if cfg["created"] == "outside":  # before any process group: writers start early
            self.outside = {kind: self._async(kind, use_dist=False) for kind in ("torch", "dcp")}
            for ck in self.outside.values():  # iteration 0 must not wait for importing writers
                ck.warmup()

    def emit(self, ev: str, **fields: Any) -> None:
        record = {"ev": ev, "t": time.time(), "initial_rank": self.initial_rank, **fields}
        os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())

    def _async(self, kind: str, use_dist: bool | None = None) -> AsyncCheckpointer:
        return AsyncCheckpointer(
            self.root / kind, format=kind, keep_last=2, write_timeout=60.0,
            collective_timeout=30.0, keep_idle_writer=True, use_dist=use_dist,
        )

    def checkpointers(self) -> dict[str, Any]:
        """This iteration's three checkpointers (collective: every active rank)."""
        if self.outside:
            for ck in self.outside.values():
                ck.rebind()
            asyncs = dict(self.outside)
        else:
            asyncs = {kind: self._async(kind) for kind in ("torch", "dcp")}
        local = LocalCheckpointManager(self.root / "local", "run", keep_last=2,
                                       write_timeout=60.0, collective_timeout=30.0)
        return {**asyncs, "local": local}


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((NUMEL,), float(step)), "s": torch.tensor([step])}


def _load(kind: str, ck: Any) -> tuple[int, int, float | None]:
    """(step loaded, newest committed on disk, value of the loaded tensor); 0 when none."""
    if kind == "local":
        newest = ck.find_latest()
        if newest < 0:
            return 0, 0, None
        tasd, step = ck.load()
        return step, newest, float(tasd.to_state_dict()["w"][0])
    newest = max(ck.manager.committed_steps(), default=0)
    try:
        if kind == "dcp":
            target = _state(0)
            step = ck.load_dcp(target)
            return int(step), newest, float(target["w"][0])
        state, step = ck.load()
        return step, newest, float(state["w"][0])
    except CheckpointNotFoundError:
        return 0, newest, None


def _save(kind: str, ck: Any, step: int) -> None:
    if kind == "local":
        ck.save(_state(step), step, is_async=True)
    else:
        ck.save(_state(step), step)


def _finalize(kind: str, ck: Any, blocking: bool) -> list[int]:
    if kind == "local":
        done = ck.maybe_finalize(blocking=blocking)
        return [] if done is None else [done]
    return [s for s in ck.maybe_finalize(blocking=blocking) if s is not None]


def train(rank: Rank, cw: CallWrapper | None = None) -> dict[str, Any]:
    if cw is None:
        raise RuntimeError("train() runs under trainguard.inprocess.Wrapper")
    try:
        return _train(rank, cw)
    except BaseException as exc:
        rank.emit("error", iteration=cw.iteration, error=f"{type(exc).__name__}: {exc}"[:400])
        raise


def _train(rank: Rank, cw: CallWrapper) -> dict[str, Any]:
    cfg = rank.cfg
    cw.init_process_group(backend="gloo", timeout=timedelta(seconds=20))
    active, world = dist.get_rank(), dist.get_world_size()
    if cfg["created"] == "outside":  # the README's pattern: their groups made while tracked
        with cw.tracking_process_group():
            cks = rank.checkpointers()
            loads = {kind: _load(kind, ck) for kind, ck in cks.items()}
    else:  # issue 13.1: groups made inside the function, untracked; the abort must free them
        cks = rank.checkpointers()
        loads = {kind: _load(kind, ck) for kind, ck in cks.items()}
    rank.emit("enter", iteration=cw.iteration, active_rank=active, world=world,
              loads={k: {"step": v[0], "newest": v[1], "value": v[2],
                         "seen": rank.seen.get(k, 0)} for k, v in loads.items()})
    last = {kind: v[0] for kind, v in loads.items()}  # newest committed step, per kind
    step = min(last.values())  # every kind resumes at or before its own newest
    faulty = any(f["iteration"] == cw.iteration for f in cfg["faults"])
    fresh: set[str] = set()  # kinds with a commit made in this iteration
    in_flight: set[str] = set()
    flag = torch.zeros(1)
    late_at = time.monotonic() + FAULT_AFTER_S
    k, late = 0, False  # late: agreed by every rank in the step's all-reduce
    while True:
        k += 1
        # Commits are agreed collectively, so every rank takes these branches at the same step.
        if not faulty and ((k > 2 * cfg["ckpt_every"] and not in_flight) or late):
            break  # the plan is used up and every save committed (pinging meanwhile): return
        if faulty and ((fresh >= set(cks) and k > MIN_STEPS) or late):
            rank.plan.check(active, cw.iteration)  # this iteration's fault, on its rank
        step += 1
        flag.fill_(1.0 if time.monotonic() > late_at else 0.0)
        dist.all_reduce(flag)
        late = bool(flag.item() > 0)
        time.sleep(STEP_S)
        cw.ping()
        if step % cfg["ckpt_every"] == 0:
            for kind, ck in cks.items():
                # One save in flight per kind (the next would block on it, past the soft
                # timeout if the writer were still importing torch). Commits are agreed
                # collectively, so every rank skips alike.
                if step > last[kind] and kind not in in_flight and (faulty or k <= 2 * cfg[
                        "ckpt_every"]):
                    _save(kind, ck, step)
                    in_flight.add(kind)
        for kind, ck in cks.items():
            for done in _finalize(kind, ck, blocking=False):
                last[kind] = max(last[kind], done)
                rank.seen[kind] = max(rank.seen.get(kind, 0), done)
                fresh.add(kind)
                in_flight.discard(kind)
    for kind, ck in cks.items():
        for done in _finalize(kind, ck, blocking=True):
            rank.seen[kind] = max(rank.seen.get(kind, 0), done)
    rank.emit("done", iteration=cw.iteration, step=step, seen=rank.seen)
    for ck in cks.values():
        if ck not in rank.outside.values():
            ck.close()
    records = [
        {"iteration": r.iteration, "cause": r.cause, "fault_ranks": list(r.fault_ranks),
         "restart_s": r.restart_s}
        for r in cw.restart_records
    ]
    dist.destroy_process_group()
    return {"iteration": cw.iteration, "step": step, "seen": rank.seen, "records": records}


def warm_up() -> None:
    """Import what the checkpointers and DDP import lazily (DCP pulls in sympy: seconds) before
    the wrapper. A restart that interrupts a module half-way through its import leaves it broken
    in ``sys.modules`` (seen: ``module 'sympy' has no attribute 'printing'`` in every later
    iteration), so heavy imports belong before the wrapped function."""
    for name in ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo"):
        importlib.import_module(name)


def main() -> Any:
    cfg = json.loads(os.environ["TG_MATRIX"])
    warm_up()
    rank = Rank(cfg)
    wrapper = Wrapper(
        soft_timeout=timedelta(seconds=cfg["soft_timeout_s"]),
        hard_timeout=timedelta(seconds=cfg["hard_timeout_s"]),
        barrier_timeout=timedelta(seconds=30), heartbeat_timeout=timedelta(seconds=4),
        heartbeat_interval=timedelta(seconds=0.2),
        monitor_process_interval=timedelta(seconds=0.05),
        monitor_thread_interval=timedelta(seconds=0.1),
        progress_watchdog_interval=timedelta(seconds=0.05),
        termination_grace_time=timedelta(seconds=0.5),
        last_call_wait=timedelta(seconds=0.1),
        rank_assignment=Compose(MaxActiveWorldSize(cfg["active"]), ShiftRanks()),
        initialize=RetryController(max_iterations=len(cfg["faults"]) + 1 + SPARE_ITERATIONS),
    )
    try:
        result = wrapper(train)(rank)
    finally:
        for ck in rank.outside.values():
            ck.close(finalize=False)
    rank.emit("exit", result=result)
    return result
