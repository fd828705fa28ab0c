"""``ShardedCheckpointCallback`` with a real ``lightning.Trainer`` (CPU, one process): resuming a
sharded (DCP) checkpoint without ``ckpt_path`` continues at the saved step, not at step 0."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs the lightning extra (pip install -e '.[dev]')")


def _fit(root: Path, max_steps: int) -> tuple[Any, list[tuple[str, int, int]], Any]:
    import lightning as L
    from torch.utils.data import DataLoader

    from trainguard.integrations.lightning import ShardedCheckpointCallback

    seen: list[tuple[str, int, int]] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            seen.append(("step", int(self.global_step), int(self.current_epoch)))
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(24, 4, generator=torch.Generator().manual_seed(0)),
                              batch_size=4)  # 6 batches per epoch: step 8 is mid-epoch 1

    class Start(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen.append(("start", int(trainer.global_step), int(trainer.current_epoch)))

    sharded = ShardedCheckpointCallback(str(root), every_n_train_steps=4, format="dcp")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[sharded, Start()],
                        default_root_dir=str(root))
    model = Model()
    trainer.fit(model)
    return trainer, seen, (sharded, model)


def test_sharded_resume_restores_loop_counters(tmp_path: Path):
    first, _, (_, model) = _fit(tmp_path / "ckpt", max_steps=8)
    assert first.global_step == 8
    saved_weight = model.net.weight.detach().clone()

    second, seen, (sharded, resumed) = _fit(tmp_path / "ckpt", max_steps=12)
    assert sharded.resumed_step == 8
    # Lightning's counters come back with the shard: global step 8, epoch 1 (6 batches/epoch)
    assert seen[0] == ("start", 8, 1), seen[:3]
    assert seen[1] == ("step", 8, 1), seen[:3]
    assert second.global_step == 12 and sharded.saved_steps == [12], sharded.saved_steps
    assert [s for s in seen if s[0] == "step"][-1] == ("step", 11, 1)
    assert not torch.equal(resumed.net.weight, saved_weight)  # it trained on from step 8
