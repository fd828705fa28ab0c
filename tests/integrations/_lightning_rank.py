"""One rank of the Lightning integration tests, run by ``trainguard launch`` (or ``run_ranks``).

Configured by ``TG_LT`` (JSON): ``ns`` ("lightning" or "pl"), ``root`` (checkpoints and events),
``max_steps``, ``step_s`` (sleep per training step), ``slow`` ([rank, factor] or
[rank, factor, cycle]: that rank's steps take factor x longer, in every cycle or in that one),
``scoring`` (ScoringConfig ratio_threshold / consecutive / warmup_windows), ``every``
(ModelCheckpoint every_n_train_steps), ``kill_after_save`` ([cycle, n]: rank 0 SIGKILLs itself
right after its n-th or a later save returned, with the
write in flight, once an earlier save is committed),
``hang`` ([rank, n, cycle]: ``training_step`` sleeps forever n steps after the cycle's first
one), ``raise`` ([rank, step, iteration]: ``training_step`` raises at that step or later, once
a checkpoint is committed; for the in-process recipe, ``inprocess``), ``preempt`` (add the
PreemptionCallback, checking every that many steps), ``calc_after``
(FaultToleranceCallback.calculate_after_steps), ``sharded`` ("dcp" or "torch": add a
ShardedCheckpointCallback saving every 5 steps), ``in_flight``
(TrainguardCheckpointIO max_in_flight, default 2).

Every rank appends JSON events to ``root/events/rank<R>.jsonl``: ``start`` (cycle, pid, resumed
checkpoint, cluster environment, restored FT state), ``step`` (each batch end), ``calculated``,
``saved``, ``committed`` (rank 0's checkpoint plugin), ``kill``, ``end`` (global step,
preemption, straggler reports). The test reads them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainguard.checkpointing import latest

CFG: dict[str, Any] = json.loads(os.environ["TG_LT"])
RANK = int(os.environ.get("RANK", "0"))
CYCLE = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FIRST_STEP: dict[str, int] = {}  # the global step this process started training at
#: straggler scoring; ``scoring`` in TG_LT overrides entries (the test derives from it the first
#: window that can flag)
SCORING = {"ratio_threshold": 1.07, "consecutive": 2, "warmup_windows": 1,
           **CFG.get("scoring", {})}

if CFG["ns"] == "pl":
    import pytorch_lightning as L
    from pytorch_lightning.callbacks import ModelCheckpoint

    import trainguard.integrations.lightning.pl as tgl
else:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import trainguard.integrations.lightning as tgl

from trainguard.straggler import ScoringConfig


def event(kind: str, **data: Any) -> None:
    folder = os.path.join(CFG["root"], "events")
    os.makedirs(folder, exist_ok=True)
    rec = {"event": kind, "rank": RANK, "cycle": CYCLE, "t": time.time(), **data}
    with open(os.path.join(folder, f"rank{RANK}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


class Model(L.LightningModule):
    def __init__(self, iteration: int = 0) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 16)
        self.iteration = iteration

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        step = int(self.global_step)
        FIRST_STEP.setdefault("step", step)
        hang = CFG.get("hang")
        if hang and [RANK, step - FIRST_STEP["step"], CYCLE] == hang:
            event("hang", step=step)
            time.sleep(3600)
        boom = CFG.get("raise")  # once a checkpoint is committed (a resume must have one)
        if boom and [RANK, self.iteration] == boom[::2] and step >= boom[1] \
                and latest(ckpt_dir()) and (not CFG.get("sharded") or latest(sharded_dir())):
            event("raise", step=step)
            raise RuntimeError(f"injected failure at step {step}")
        slow = CFG.get("slow")
        factor = slow[1] if slow and slow[0] == RANK and slow[2:] in ([], [CYCLE]) else 1.0
        time.sleep(CFG.get("step_s", 0.02) * factor)
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(100_000, 16), batch_size=4)


class KillingIO(tgl.TrainguardCheckpointIO):  # type: ignore[misc,valid-type]
    """SIGKILLs rank 0 right after its n-th save returned (the write is still in flight)."""

    saves = 0

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        KillingIO.saves += 1
        event("saved", path=os.fspath(path), step=int(checkpoint["global_step"]),
              block_ms=self.last_block_s * 1e3)
        kill = CFG.get("kill_after_save")  # [cycle, n]: at the n-th save or later, once an
        # earlier save is committed (a kill before any commit proves nothing)
        if kill and kill[0] == CYCLE and KillingIO.saves >= kill[1] and latest(ckpt_dir()):
            event("kill", latest=latest(ckpt_dir()), listing=sorted(os.listdir(ckpt_dir())))
            os.kill(os.getpid(), signal.SIGKILL)

    def _commit(self, req: Any, target: str, step: int, seq: int) -> None:
        super()._commit(req, target, step, seq)
        event("committed", path=target, step=step)


class Recorder(L.Callback):
    def __init__(self, ft: Any, straggler: Any, preempt: Any) -> None:
        self.ft, self.straggler, self.preempt = ft, straggler, preempt
        self.calculations = 0
        self.reports = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        env = getattr(trainer.strategy, "cluster_environment", None)
        event("start", pid=os.getpid(), env=type(env).__name__,
              ft_loaded=self.ft.loaded_state if self.ft else None,
              global_step=int(trainer.global_step))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        event("step", step=int(trainer.global_step))
        reports = self.straggler.reports
        if len(reports) != self.reports:
            self.reports = len(reports)
            event("report", flagged=sorted({s.rank for s in reports[-1].stragglers}),
                  line=reports[-1].summary_line(), per_rank=reports[-1].per_rank,
                  window=reports[-1].window, warmup=reports[-1].warmup)
        if self.ft is not None and self.ft.calculations != self.calculations:
            self.calculations = self.ft.calculations
            event("calculated", state=self.ft.state_dict(), timeouts=self.ft.client.timeouts)


def ckpt_dir() -> str:
    return os.path.join(CFG["root"], "ckpt")


def sharded_dir() -> str:
    return os.path.join(CFG["root"], "sharded")


def build(iteration: int = 0) -> tuple[Any, list[Any]]:
    ft = tgl.FaultToleranceCallback(calculate_after_steps=CFG.get("calc_after", 4),
                                    min_timeout=2.0) if CFG.get("ft", True) else None
    # 2 ranks: the median is the mean, so a rank 3x slower in its step scores ~1.4-1.5 against
    # it (its work is 3 x step_s plus the per-step overhead both ranks share)
    scoring = ScoringConfig(ratio_threshold=SCORING["ratio_threshold"], clear_ratio=1.03,
                            floor_ms=1.0, floor_pct=1.0, consecutive=SCORING["consecutive"],
                            warmup_windows=SCORING["warmup_windows"])
    straggler = tgl.StragglerCallback(window_steps=5, scoring=scoring)
    preempt = tgl.PreemptionCallback(check_every_n_steps=CFG["preempt"]) \
        if CFG.get("preempt") else None
    sharded = tgl.ShardedCheckpointCallback(sharded_dir(),
                                            every_n_train_steps=5, format=CFG["sharded"]) \
        if CFG.get("sharded") else None
    callbacks = [c for c in (ft, straggler, preempt, sharded) if c is not None]
    callbacks += [Recorder(ft, straggler, preempt),
                  ModelCheckpoint(dirpath=ckpt_dir(), save_top_k=1,
                                  every_n_train_steps=CFG.get("every", 4))]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        max_steps=CFG["max_steps"], callbacks=callbacks,
                        # each cycle's writer process imports torch (10-30 s at load 25): with
                        # the default 2 saves in flight the 3rd save waited for it, blocking the
                        # step for longer than the calculated heartbeat timeout
                        plugins=[KillingIO(max_in_flight=CFG.get("in_flight", 2))],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=CFG["root"])
    return trainer, [ft, straggler, preempt, sharded]


def finish(trainer: Any, parts: list[Any]) -> None:
    _ft, straggler, preempt, sharded = parts
    flagged = sorted({s.rank for r in straggler.reports for s in r.stragglers})
    ratios = [round(s.ratio, 3) for r in straggler.reports for s in r.stragglers]
    event("end", global_step=int(trainer.global_step), flagged=flagged, ratios=ratios,
          reports=len(straggler.reports), ddp_hooked=straggler.ddp_hooked,
          preempted=preempt.preempted_at_step if preempt else None,
          preempt_path=preempt.checkpoint_path if preempt else None,
          signal_to_stop_s=preempt.signal_to_stop_s if preempt else None,
          latest=latest(ckpt_dir()),
          sharded_resumed=sharded.resumed_step if sharded else None,
          sharded_saved=sharded.saved_steps if sharded else None)


def main() -> None:
    trainer, parts = build()
    trainer.fit(Model(), ckpt_path=latest(ckpt_dir()))
    finish(trainer, parts)


def main_inprocess() -> None:
    """The in-process restart recipe (README "Lightning"): a new Trainer per iteration, the
    process group made by the wrapper first, resume from the newest committed checkpoint."""
    from trainguard.inprocess import CallWrapper, Wrapper

    @Wrapper(soft_timeout=20.0, hard_timeout=30.0, barrier_timeout=60.0,
             completion_timeout=60.0, heartbeat_timeout=30.0, termination_grace_time=1.0)
    def train(cw: CallWrapper | None = None) -> int:
        assert cw is not None
        cw.init_process_group()  # Lightning then skips its own init_process_group
        trainer, parts = build(cw.iteration)
        ckpt = latest(ckpt_dir())
        event("fit", iteration=cw.iteration, ckpt=ckpt, pid=os.getpid())
        trainer.fit(Model(cw.iteration), ckpt_path=ckpt)
        finish(trainer, parts)
        event("done", iteration=cw.iteration, global_step=int(trainer.global_step))
        return int(trainer.global_step)

    train()


if __name__ == "__main__":
    main_inprocess() if CFG.get("inprocess") else main()
    sys.exit(0)
