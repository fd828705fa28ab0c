"""One rank of the restart benchmark's workload (run as a script, one process per rank).

The same small DDP training loop (gloo, CPU) runs under three restart mechanisms:

* ``ours``: ``trainguard.inprocess.Wrapper`` (ranks are plain processes).
* ``nvrx``: NVRx's ``inprocess.Wrapper`` (run with the NVRx virtualenv's interpreter).
* ``torchrun``: a plain script launched by ``torchrun --max-restarts`` (full job restart).

Every restart iteration (or torchrun attempt) builds the process group, loads the checkpoint, wraps
the model in DDP and trains. Iteration ``i`` injects ``plan[i]`` (an exception, a hang in a C call
or a SIGKILL on one rank); once the plan is used up every rank trains ``--final-steps`` steps and
returns.

Each rank appends JSON lines to ``<out>/ev_<initial rank>.jsonl``; the parent derives all figures
from them (``time.time()`` stamps, comparable across processes on one host):
``start`` (process start, before ``import torch``), ``enter`` (the wrapped function or the
torchrun worker body starts), ``ready`` (process group, checkpoint and DDP ready), ``step`` (first
completed step of an iteration), ``fault``, ``hang_end`` (the hang was interrupted), ``record``
(the wrapper's own restart record) and ``done``.

This module imports only the standard library and torch at module level, so it runs in any
virtualenv that has torch (the NVRx one has no trainguard).
"""

from __future__ import annotations

import time

_START_T = time.time()  # before the heavy imports: torchrun's restart cost includes them

import argparse
import dataclasses
import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

IN_DIM, HIDDEN, CLASSES, BATCH = 64, 256, 10, 64
HANG_S = 600.0  # a hang lasts until the restart machinery interrupts it
EXTRA_STEP_LIMIT = 2000  # healthy ranks block in the allreduce right after the fault step


class Events:
    """Append-only JSON-lines event log of one rank (line-buffered: survives a SIGKILL)."""

    def __init__(self, out_dir: str, rank: int) -> None:
        self.rank = rank
        self._fh = open(os.path.join(out_dir, f"ev_{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def emit(self, event: str, **fields: Any) -> None:
        fields.update(e=event, rank=self.rank, t=fields.get("t", time.time()), pid=os.getpid())
        self._fh.write(json.dumps(fields, default=str) + "\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ours", "nvrx", "torchrun"), required=True)
    p.add_argument("--out", required=True, help="directory for event files and the checkpoint")
    p.add_argument("--plan", default="[]", help='JSON list: [{"kind": "exc", "rank": 1}, ...]')
    p.add_argument("--fault-step", type=int, default=12, help="step of an iteration that faults")
    p.add_argument("--final-steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=5, help="steps between checkpoint saves")
    p.add_argument("--gloo-timeout", type=float, default=60.0, help="seconds")
    p.add_argument("--soft-timeout", type=float, default=2.0, help="seconds (ours only)")
    p.add_argument("--hard-timeout", type=float, default=10.0, help="seconds (ours only)")
    p.add_argument("--last-call-wait", type=float, default=None, help="seconds (ours only)")
    p.add_argument("--store-port", type=int, required=False, help="wrapper store port")
    p.add_argument("--warm-up", action="store_true", help="build a 1-rank DDP before the wrapper")
    p.add_argument("--active", type=int, default=None, help="active ranks; the rest are reserve")
    return p.parse_args(argv)


class Trainer:
    """The training body shared by all three modes; ``iteration`` = restart index."""

    def __init__(self, args: argparse.Namespace, events: Events, initial_rank: int) -> None:
        self.args = args
        self.events = events
        self.initial_rank = initial_rank
        self.plan: list[dict[str, Any]] = json.loads(args.plan)
        self.ckpt = os.path.join(args.out, "ckpt.pt")
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, IN_DIM, generator=gen)
        teacher = torch.randn(IN_DIM, CLASSES, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer, int]:
        """Model + optimizer restored from the last checkpoint, wrapped in DDP."""
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(IN_DIM, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, CLASSES),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = 0
        if os.path.exists(self.ckpt):
            state = torch.load(self.ckpt, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step = int(state["step"])
        return DistributedDataParallel(model), opt, step

    def save(self, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        tmp = f"{self.ckpt}.tmp{os.getpid()}"
        state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt)  # atomic: a fault never leaves a torn checkpoint

    def run(self, iteration: int) -> float:
        """Train one iteration: inject this iteration's fault, or finish; returns the last loss."""
        model, opt, step = self.build()
        self.events.emit("ready", it=iteration)
        fault = self.plan[iteration] if iteration < len(self.plan) else None
        steps = self.args.fault_step + EXTRA_STEP_LIMIT if fault else self.args.final_steps
        rank, world = dist.get_rank(), dist.get_world_size()
        loss = torch.zeros(())
        for i in range(1, steps + 1):
            if (
                fault is not None
                and i == self.args.fault_step
                and fault["rank"] == self.initial_rank
            ):
                self.inject(fault["kind"], iteration)
            lo = ((step + i) * world + rank) * BATCH % (len(self.x) - BATCH)
            loss = nn.functional.cross_entropy(
                model(self.x[lo : lo + BATCH]), self.y[lo : lo + BATCH]
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i == 1:
                self.events.emit("step", it=iteration, n=i, world=world)
            if rank == 0 and i % self.args.ckpt_every == 0:
                self.save(model, opt, step + i)
        if fault is not None:
            raise RuntimeError(f"planned fault {fault} did not interrupt training")
        return float(loss.detach())

    def inject(self, kind: str, iteration: int) -> None:
        self.events.emit("fault", it=iteration, kind=kind)
        if kind == "exc":
            raise RuntimeError(f"injected exception on rank {self.initial_rank}, it {iteration}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(HANG_S)  # not reached: SIGKILL cannot be caught
        if kind == "hang":
            try:
                time.sleep(HANG_S)  # a C call: the GIL is released, no bytecode runs
            finally:
                self.events.emit("hang_end", it=iteration)
            return
        raise ValueError(f"unknown fault kind {kind!r}; use exc, hang or kill")


def warm_up() -> None:
    """Pay torch.distributed's and DDP's one-time lazy initialisation (~2 s on 2 cores) now.

    Optional (``--warm-up``, off by default, as a plain training script would not do it): a user
    can do the same before the wrapper. It mainly shortens a reserve rank's first activation (its
    first DDP construction); it also creates DDP's lazily built objects before the wrapper's
    ``gc.freeze()``, so the first restart's garbage collection does not scan them.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        DistributedDataParallel(nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()


def _record_dict(rec: Any) -> dict[str, Any]:
    """The wrapper's restart record as plain JSON-able fields (properties included)."""
    if dataclasses.is_dataclass(rec) and not isinstance(rec, type):
        out = dataclasses.asdict(rec)
    elif isinstance(rec, dict):
        out = dict(rec)
    else:
        out = {k: v for k, v in vars(rec).items() if not k.startswith("_")}
    for name in ("detection_s", "restart_s"):
        if name not in out and getattr(rec, name, None) is not None:
            out[name] = getattr(rec, name)
    out.pop("t", None)  # keep the event's own timestamp
    return out


def run_ours(args: argparse.Namespace, trainer: Trainer) -> None:
    from trainguard.inprocess import CallWrapper, Wrapper

    kwargs: dict[str, Any] = {
        "soft_timeout": timedelta(seconds=args.soft_timeout),
        "hard_timeout": timedelta(seconds=args.hard_timeout),
    }
    if args.store_port:
        kwargs["store_kwargs"] = {"port": args.store_port}
    if args.last_call_wait is not None:
        kwargs["last_call_wait"] = timedelta(seconds=args.last_call_wait)
    if args.active is not None:
        from trainguard.inprocess import Compose
        from trainguard.inprocess.rank_assignment import MaxActiveWorldSize, ShiftRanks

        # Rightmost first: shift out lost ranks, then the first `active` ranks run fn.
        kwargs["rank_assignment"] = Compose(MaxActiveWorldSize(args.active), ShiftRanks())

    def train(call: CallWrapper) -> float:
        trainer.events.emit("enter", it=call.iteration)
        records = list(call.restart_records)
        if records:
            trainer.events.emit("record", it=call.iteration, **_record_dict(records[-1]))
        try:
            call.init_process_group(backend="gloo", timeout=timedelta(seconds=args.gloo_timeout))
            return trainer.run(call.iteration)
        except Exception as exc:  # logged for diagnosis, then handed to the wrapper
            if "injected" not in str(exc):
                trainer.events.emit("error", it=call.iteration, error=repr(exc)[:500])
            raise

    Wrapper(**kwargs)(train)()


def run_nvrx(args: argparse.Namespace, trainer: Trainer) -> None:
    from nvidia_resiliency_ext import inprocess

    base_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        timeout=timedelta(seconds=60),
    )
    store_kwargs = {"port": args.store_port} if args.store_port else None

    def train(call_wrapper: Optional[inprocess.CallWrapper] = None) -> float:  # noqa: UP045
        if call_wrapper is None:
            raise RuntimeError("NVRx did not inject its CallWrapper into train()")
        it = call_wrapper.iteration
        trainer.events.emit("enter", it=it)
        store = dist.PrefixStore(f"bench_it{it}", base_store)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=args.gloo_timeout),
        )
        return trainer.run(it)

    # NVRx cannot inject through string (PEP 563) annotations: give it the real class.
    train.__annotations__["call_wrapper"] = Optional[inprocess.CallWrapper]  # noqa: UP045
    inprocess.Wrapper(store_kwargs=store_kwargs)(train)()


def run_torchrun(args: argparse.Namespace, trainer: Trainer) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    trainer.events.emit("enter", it=attempt)
    # A fresh key prefix per attempt: plain env:// re-init died in gloo's connectFullMesh.
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"bench_attempt{attempt}", base),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=args.gloo_timeout),
    )
    trainer.run(attempt)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    initial_rank = int(os.environ["RANK"])
    events = Events(args.out, initial_rank)
    events.emit("start", t=_START_T, mode=args.mode)
    trainer = Trainer(args, events, initial_rank)
    if args.warm_up and args.mode != "torchrun":
        warm_up()
    {"ours": run_ours, "nvrx": run_nvrx, "torchrun": run_torchrun}[args.mode](args, trainer)
    events.emit("done")
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
