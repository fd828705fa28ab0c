"""One rank of the goodput run (``bench/goodput.py``, ``trainguard demo --duration``): a DDP job
that runs until a wall-clock end time while faults are injected on a time schedule.

Run as ``python -m trainguard._demo._goodput_rank ARGS`` (see ``_parse``).

Modes:

* ``ours``: the training function runs under ``trainguard.inprocess.Wrapper`` (plain processes,
  active plus reserve ranks); checkpoints through ``AsyncCheckpointer`` (made once per process,
  ``rebind()`` per restart iteration, ``on_error="log"``), committed off the training loop.
* ``baseline``: a plain script under ``torchrun --max-restarts``; rank 0 writes each checkpoint
  with a synchronous ``torch.save`` (temp file, fsync, rename) as the usual DDP recipe does, every
  rank loads it after a restart; the process group timeout (``--pg-timeout``) is what ends a hang.

A step is a forward/backward of a small MLP (DDP all-reduces the gradients over gloo), padded with
``time.sleep`` to ``--step-ms`` to stand for the accelerator's compute. Every step also all-reduces
a stop flag, so all ranks stop together. Faults (``--plan``: ``[{"t", "kind",
"rank"}]``, ``t`` seconds into training, ``rank`` the active rank) fire at the start of the first
step at or after their time; each fires once per job (a marker file claimed with ``O_EXCL``).
``disk_full`` is injected by the parent (it fills the checkpoint filesystem), not here. Times
count from the job's first training step (``{out}/t_train``), and every rank stops
``--duration`` seconds after it.

Events (JSON lines in ``{out}/ev_{initial rank}_{pid}.jsonl``, ``time.time()`` stamps): ``step``
(``step``, ``t0``, ``t``, ``world``), ``fault`` (``i``, ``kind``, ``step``), ``commit``
(``step``: a checkpoint durable and complete), ``save_failed`` (``step``, ``error``).

Imports only the standard library and torch at module level (trainguard only in ``ours``).
"""

from __future__ import annotations

import time

_START_T = time.time()

import argparse
import json
import os
import re
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HANG_S = 3600.0


class Events:
    """Append-only JSON lines; one ``os.write`` per event (a SIGKILL loses at most that line)."""

    def __init__(self, out: str, initial_rank: int) -> None:
        path = os.path.join(out, f"ev_{initial_rank}_{os.getpid()}.jsonl")
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.initial_rank = initial_rank

    def emit(self, ev: str, **fields: Any) -> None:
        record = {"ev": ev, "t": time.time(), "initial_rank": self.initial_rank, **fields}
        os.write(self.fd, (json.dumps(record, default=str) + "\n").encode())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ours", "baseline"), required=True)
    p.add_argument("--out", required=True, help="event files and fault markers")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--duration", type=float, required=True,
                   help="seconds of training, from the job's first step (all ranks stop then)")
    p.add_argument("--plan", default="[]")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--active", type=int, default=4, help="active ranks (ours)")
    p.add_argument("--soft-timeout", type=float, default=3.0)
    p.add_argument("--hard-timeout", type=float, default=6.0)
    p.add_argument("--pg-timeout", type=float, default=30.0, help="baseline gloo timeout, s")
    return p.parse_args(argv)


class Job:
    """Process-lifetime state: data, model recipe, fault plan, events."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.initial_rank = int(os.environ["RANK"])
        self.events = Events(args.out, self.initial_rank)
        self.plan: list[dict[str, Any]] = json.loads(args.plan)
        self._t_train: float | None = None
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 64, generator=gen)
        self.y = (self.x @ torch.randn(64, 10, generator=gen)).argmax(dim=1)

    def model(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def t_train(self) -> float:
        """When the job's training started (``time.time()``): the first rank to reach its first
        step writes ``{out}/t_train`` (O_EXCL); fault times and the end count from it."""
        if self._t_train is None:
            self._t_train = read_t_train(self.args.out, create=True)
        return self._t_train

    def maybe_fault(self, step: int) -> None:
        """Fire the first due fault of this active rank (once per job)."""
        now, rank, start = time.time(), dist.get_rank(), self.t_train()
        for i, f in enumerate(self.plan):
            if f["kind"] == "disk_full" or f["rank"] != rank or now < start + f["t"]:
                continue
            try:
                fd = os.open(os.path.join(self.args.out, f"fault{i}"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            os.close(fd)
            self.events.emit("fault", i=i, kind=f["kind"], step=step)
            _inject(f["kind"])

    def step(self, ddp: nn.Module, opt: torch.optim.Optimizer, step: int) -> bool:
        """One training step; returns True when every rank agrees the end time passed."""
        t0 = time.time()
        rank, world = dist.get_rank(), dist.get_world_size()
        lo = (step * world + rank) * 32 % (len(self.x) - 32)
        loss = nn.functional.cross_entropy(ddp(self.x[lo:lo + 32]), self.y[lo:lo + 32])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        pad = self.args.step_ms / 1e3 - (time.time() - t0)
        if pad > 0:
            time.sleep(pad)  # the accelerator's share of the step
        end = self.t_train() + self.args.duration
        stop = torch.tensor([1.0 if time.time() >= end else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        self.events.emit("step", step=step, t0=t0, world=world)
        return bool(stop.item())


def read_t_train(out: str, create: bool, timeout_s: float = 5.0) -> float:
    """The time in ``{out}/t_train``; with ``create`` write now there if nobody did yet.

    Raises:
        TimeoutError: the file exists but stays empty for ``timeout_s`` (its writer died).
    """
    path = os.path.join(out, "t_train")
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            now = time.time()
            os.write(fd, repr(now).encode())
            os.close(fd)
            return now
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as fh:
                text = fh.read()
            if text:
                return float(text)
        except FileNotFoundError:
            if not create:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} stayed empty for {timeout_s} s")
        time.sleep(0.01)


def _inject(kind: str) -> None:
    sys.stdout.flush()
    if kind == "exception":
        raise RuntimeError("injected exception")
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang_c":
        time.sleep(HANG_S)  # a C call with the GIL released
    if kind == "hang_gil":
        re.match(r"(a|aa)+$", "a" * 200 + "b")  # exponential backtracking, GIL held
    raise RuntimeError(f"fault {kind!r} returned")


# -- ours ---------------------------------------------------------------------------------------
def run_ours(job: Job) -> None:
    from trainguard.checkpointing import (
        AsyncCheckpointer,
        CheckpointMismatchError,
        CheckpointNotFoundError,
    )
    from trainguard.inprocess import CallWrapper, Compose, MaxActiveWorldSize, ShiftRanks, Wrapper

    a = job.args
    ckpt = AsyncCheckpointer(a.ckpt_dir, format="torch", keep_last=2, on_error="log",
                             use_dist=False, keep_idle_writer=True, write_timeout=30.0,
                             collective_timeout=30.0)
    # DDP's lazy imports while the writer process imports torch, then wait for the writer: a
    # save that finds it still starting blocks the step inside ``cw.atomic()`` (seconds on a
    # busy machine), where a hang timeout sized to a 50 ms step would kill the rank
    warm_up()
    ckpt.warmup(timeout=120.0)

    def load(net: nn.Module, opt: torch.optim.Optimizer) -> int:
        try:
            state, step = ckpt.load()
        except (CheckpointNotFoundError, CheckpointMismatchError):
            return 0
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        return int(step)

    def train(cw: CallWrapper | None = None) -> int:
        if cw is None:
            raise RuntimeError("runs under trainguard.inprocess.Wrapper")
        cw.init_process_group(backend="gloo")
        net, opt = job.model()
        with cw.tracking_process_group():
            ckpt.rebind()
            step = load(net, opt)
        ddp = DistributedDataParallel(net)
        failed = ckpt.failed_saves
        while True:
            job.maybe_fault(step + 1)
            step += 1
            stop = job.step(ddp, opt, step)
            cw.ping()
            if step % a.ckpt_every == 0:
                # not inside cw.atomic(): a save that waits for a slow or stuck writer (its
                # staging memory still in flight) must stay interruptible, or a hang timeout
                # sized to the step kills every rank; an interrupted save is dropped by rebind()
                ckpt.save({"model": net.state_dict(), "opt": opt.state_dict()}, step)
            for done in ckpt.maybe_finalize():
                if done is not None and dist.get_rank() == 0:
                    job.events.emit("commit", step=done)
            if ckpt.failed_saves > failed:
                failed = ckpt.failed_saves
                job.events.emit("save_failed", step=step, error="see the rank log")
            if stop:
                break
        for done in ckpt.wait():
            if done is not None and dist.get_rank() == 0:
                job.events.emit("commit", step=done)
        del ddp
        dist.destroy_process_group()
        return step

    wrapper = Wrapper(
        soft_timeout=timedelta(seconds=a.soft_timeout),
        hard_timeout=timedelta(seconds=a.hard_timeout),
        heartbeat_timeout=timedelta(seconds=a.soft_timeout + 2.0),
        barrier_timeout=timedelta(seconds=60), completion_timeout=timedelta(seconds=60),
        last_call_wait=timedelta(seconds=0.1),
        monitor_process_interval=timedelta(seconds=0.1),
        monitor_thread_interval=timedelta(seconds=0.1),
        progress_watchdog_interval=timedelta(seconds=0.1),
        heartbeat_interval=timedelta(seconds=0.3),
        rank_assignment=Compose(MaxActiveWorldSize(a.active), ShiftRanks()),
    )
    try:
        wrapper(train)()
    finally:
        ckpt.close(finalize=False)


# -- baseline -----------------------------------------------------------------------------------
def run_baseline(job: Job) -> None:
    a = job.args
    path = os.path.join(a.ckpt_dir, "ckpt.pt")
    # A fresh key prefix per torchrun attempt: a plain env:// re-init after a restart reads the
    # previous attempt's gloo addresses (connectFullMesh: connection refused).
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"goodput{attempt}", base),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=a.pg_timeout))
    net, opt = job.model()
    step = 0
    if os.path.exists(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    ddp = DistributedDataParallel(net)
    while True:
        job.maybe_fault(step + 1)
        step += 1
        stop = job.step(ddp, opt, step)
        if step % a.ckpt_every == 0 and dist.get_rank() == 0:
            _sync_save(path, {"model": net.state_dict(), "opt": opt.state_dict(), "step": step})
            job.events.emit("commit", step=step)
        if stop:
            break
    dist.destroy_process_group()


def _sync_save(path: str, state: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def warm_up() -> None:
    """(``ours``) Pay DDP's one-time lazy initialisation (it imports ``torch._dynamo``: seconds
    on a busy machine) before training, as a long job's first minutes would: otherwise a reserve
    rank pays it inside its first restart, and the first iteration inside the hang timeout."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        DistributedDataParallel(nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    job = Job(args)
    job.events.emit("start", import_s=round(time.time() - _START_T, 3))
    if args.mode == "ours":
        run_ours(job)
    else:
        run_baseline(job)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed, then the exit status says it
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
