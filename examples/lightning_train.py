"""A Lightning job with every trainguard capability, run by ``trainguard launch``.

Run (2 CPU ranks, gloo; resumes from the newest committed checkpoint when run again)::

    trainguard launch --nproc-per-node 2 --max-restarts 3 --ft-preload lightning \\
        examples/lightning_train.py --ckpt-dir runs/lightning-example/ckpt

What it shows:

* ``FaultToleranceCallback``: heartbeats and sections to the launcher's rank monitor; heartbeat
  timeouts calculated from the run are kept in the checkpoint (a hang is caught within seconds
  after a restart, not the default 10 minutes);
* ``StragglerCallback``: straggler reports on rank 0 (``--slow-rank 1`` makes one rank slower);
* ``PreemptionCallback``: SIGTERM (e.g. ``kill -TERM <launcher pid>``) stops every rank after the
  same step, saves ``preempted-step=N.ckpt`` and exits 0;
* ``TrainguardCheckpointIO``: asynchronous never-torn saves; ``ModelCheckpoint`` may delete the
  previous file only once the newer one is committed;
* ``latest(dir)``: the newest committed checkpoint for ``Trainer.fit(ckpt_path=...)``.

Use ``--namespace pl`` for ``pytorch_lightning`` (plugins must match the Trainer's namespace).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", default="runs/lightning-example/ckpt",
                        help="checkpoint directory (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps (200)")
    parser.add_argument("--every", type=int, default=20, help="save every N steps (20)")
    parser.add_argument("--step-s", type=float, default=0.01,
                        help="extra compute per step in seconds (0.01)")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="make this rank 1.3x slower (-1: none)")
    parser.add_argument("--namespace", choices=["lightning", "pl"], default="lightning")
    args = parser.parse_args(argv)
    for name in ("max_steps", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.step_s < 0:
        parser.error("--step-s must be >= 0 seconds")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.namespace == "pl":
        import pytorch_lightning as L
        from pytorch_lightning.callbacks import ModelCheckpoint

        import trainguard.integrations.lightning.pl as tgl
    else:
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint

        import trainguard.integrations.lightning as tgl
    from trainguard.checkpointing import latest
    from trainguard.errors import ConfigError
    from trainguard.straggler import ScoringConfig

    rank = int(os.environ.get("RANK", "0"))
    slow = 1.3 if rank == args.slow_rank else 1.0

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            time.sleep(args.step_s * slow)  # stands in for a bigger model
            x, y = batch[:, :32], batch[:, 32:]
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(50_000, 33), batch_size=16)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # with 2 ranks the median is the mean: a 1.3x rank scores about 1.13 against it
    straggler = tgl.StragglerCallback(window_steps=20, scoring=ScoringConfig(ratio_threshold=1.1,
                                                                             clear_ratio=1.05))
    preempt = tgl.PreemptionCallback()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        max_steps=args.max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tgl.FaultToleranceCallback(), straggler, preempt,
                   ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=1,
                                   every_n_train_steps=args.every)],
        plugins=[tgl.TrainguardCheckpointIO()])
    resume = latest(args.ckpt_dir)
    try:
        trainer.fit(Regression(), ckpt_path=resume)
    except ConfigError as exc:  # e.g. not started by trainguard launch: one line, exit 2
        print(f"lightning_train.py: error: {exc}", file=sys.stderr)  # argparse's form
        return 2
    if trainer.is_global_zero:
        flagged = sorted({s.rank for r in straggler.reports for s in r.stragglers})
        print(f"resumed from {resume}; finished at step {trainer.global_step}; "
              f"preempted at {preempt.preempted_at_step}; stragglers {flagged}; "
              f"newest committed checkpoint {latest(args.ckpt_dir)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
