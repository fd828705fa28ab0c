"""The demo's training function: DDP over gloo on the digits split, run under ``inprocess.Wrapper``.

Each call of :func:`train` is one restart iteration: it joins this iteration's process group,
rebuilds the model, reloads the newest checkpoint committed on every rank (so every iteration
resumes from the same state on every rank), and runs global steps ``resume_step + 1 .. steps``,
saving asynchronously every ``checkpoint_every`` steps. Objects that do not depend on a process
group (the data arrays, the event log, the fault injector, the checkpointer and its writer
process) live in :class:`Trainer` and survive restarts.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from trainguard._demo._ckpt import DemoCheckpoints, load_checkpoint, save_checkpoint
from trainguard._demo._config import DemoConfig
from trainguard._demo._data import load_split
from trainguard._demo._events import EventLog
from trainguard._demo._faults import FaultInjector
from trainguard.inprocess import CallWrapper

__all__ = ["Trainer", "build_model", "evaluate", "load_checkpoint", "save_checkpoint", "train"]


def build_model(hidden: int, seed: int) -> nn.Module:
    """A 64 -> hidden -> hidden -> 10 MLP, initialised identically on every rank from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` (N, 64) classified as ``y`` (N,)."""
    model.eval()
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return accuracy


class _Batches:
    """Per-step batches from a ``DistributedSampler`` over the active world.

    Step ``s`` (1-based) is batch ``(s - 1) % per_epoch`` of epoch ``(s - 1) // per_epoch``, so a
    resumed run draws the same batches as an uninterrupted one with the same world size.
    """

    def __init__(
        self, dataset: TensorDataset, rank: int, world_size: int, batch: int, seed: int
    ) -> None:
        self.dataset = dataset
        self.batch = batch
        self.sampler: DistributedSampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.per_epoch = max(1, len(self.sampler) // batch)
        self._epoch = -1
        self._indices: list[int] = []

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(step - 1, self.per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._indices, self._epoch = list(self.sampler), epoch
        return self.dataset[self._indices[index * self.batch : (index + 1) * self.batch]]


class Trainer:
    """Process-lifetime state of one rank (kept across in-process restarts).

    Args:
        config: run configuration.
        rank: this process's initial rank.
        log: its event log.
    """

    def __init__(self, config: DemoConfig, rank: int, log: EventLog) -> None:
        self.config = config
        self.rank = rank
        self.log = log
        self.faults = FaultInjector(config, rank, log)
        arrays = load_split(config.data_path)
        self.train_set = TensorDataset(
            torch.from_numpy(arrays["x_train"]), torch.from_numpy(arrays["y_train"])
        )
        self.x_test = torch.from_numpy(arrays["x_test"])
        self.y_test = torch.from_numpy(arrays["y_test"])
        self.records_logged = 0
        self.checkpoints = DemoCheckpoints(config, log)
        self.checkpoints.warm_up(rank)

    def log_restart_records(self, records: list[Any], iteration: int) -> None:
        """Write the wrapper's restart records this rank has not logged yet.

        The records are one per restart, in order, the last one being the restart into the
        current ``iteration``; each is logged with the iteration it restarted into.
        """
        for index in range(self.records_logged, len(records)):
            into = iteration - (len(records) - 1 - index)
            self.log.emit("restart", into_iteration=into, **_record_fields(records[index]))
        self.records_logged = len(records)

    def lr(self, step: int) -> float:
        """Cosine decay from ``config.lr`` over the run (a function of the global step only)."""
        return self.config.lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / self.config.steps))


def _record_fields(record: Any) -> dict:
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        fields = dataclasses.asdict(record)
    elif isinstance(record, dict):
        fields = dict(record)
    else:
        fields = {k: v for k, v in vars(record).items() if not k.startswith("_")}
    for name in ("detection_s", "restart_s"):  # the record's own figures, as the wrapper logs them
        value = getattr(record, name, None)
        if isinstance(value, (int, float)):
            fields[name] = value
    for key in ("ev", "t", "rank"):  # keep the event's own keys intact
        if key in fields:
            fields[f"record_{key}"] = fields.pop(key)
    return fields


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = batch
    loss = nn.functional.cross_entropy(ddp(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP all-reduces gradients over gloo here
    optimizer.step()
    return float(loss.item())


def train(trainer: Trainer, call_wrapper: CallWrapper | None = None) -> float:
    """One restart iteration of the demo (the function given to ``inprocess.Wrapper``).

    Returns:
        Test accuracy of the final model (fraction in [0, 1]).

    Raises:
        DemoFault: an injected exception (the wrapper restarts every rank in-process).
    """
    if call_wrapper is None:
        raise RuntimeError("train() must run under trainguard.inprocess.Wrapper")
    t_fn = time.time()
    cfg, state = trainer.config, call_wrapper.state
    iteration = call_wrapper.iteration
    trainer.log_restart_records(list(call_wrapper.restart_records), iteration)
    call_wrapper.init_process_group(backend="gloo")  # CPU demo: 5 ranks share one host
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg.hidden, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    resume = trainer.checkpoints.begin(call_wrapper, model, optimizer)  # newest committed
    ddp = DistributedDataParallel(model)
    batches = _Batches(trainer.train_set, rank, world, cfg.batch_size, cfg.seed)
    trainer.log.emit(
        "enter",
        iteration=iteration,
        active_rank=rank,
        active_world_size=world,
        world_size=state.world_size,
        resume_step=resume,
        t_fn=t_fn,
    )
    for step in range(resume + 1, cfg.steps + 1):
        trainer.faults.maybe_fire(step, iteration)
        t0 = time.time()
        loss = _step(ddp, optimizer, batches.get(step), trainer.lr(step))
        trainer.log.emit("step", step=step, t0=t0, loss=round(loss, 5), iteration=iteration)
        call_wrapper.ping()
        trainer.checkpoints.step = step
        if step % cfg.checkpoint_every == 0:  # every rank stages its shard; commit is collective
            trainer.checkpoints.save(call_wrapper, step, model, optimizer, iteration)
        if (step + 1) % cfg.checkpoint_every == 0 and step < cfg.steps:
            trainer.checkpoints.prepare()  # the next step saves: vote on skipping it now
    trainer.checkpoints.finish()
    accuracy = evaluate(model, trainer.x_test, trainer.y_test)
    trainer.log.emit("done", step=cfg.steps, accuracy=accuracy, iteration=iteration)
    del ddp
    dist.destroy_process_group()  # a group left alive slows interpreter exit by seconds
    return accuracy
