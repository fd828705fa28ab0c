"""``StragglerCallback``'s metrics with a real ``lightning.Trainer`` (CPU, one process): through
the Trainer's loggers by default, through ``pl_module.log_dict`` (so in
``trainer.callback_metrics``) with ``log_metrics="log_dict"``, nowhere with ``False``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs the lightning extra (pip install -e '.[dev]')")


def _fit(root: Path, log_metrics: Any) -> tuple[Any, list[dict[str, float]]]:
    import lightning as L
    from lightning.pytorch.loggers.logger import Logger
    from torch.utils.data import DataLoader

    from trainguard.integrations.lightning import StragglerCallback

    logged: list[dict[str, float]] = []

    class Capture(Logger):
        name = "capture"  # type: ignore[assignment]
        version = "0"  # type: ignore[assignment]

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            logged.append(dict(metrics))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(64, 4), batch_size=4)

    cb = StragglerCallback(window_steps=2, log_metrics=log_metrics)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=16, logger=Capture(),
                        log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[cb], default_root_dir=str(root))
    trainer.fit(Model())
    return trainer, logged


@pytest.mark.parametrize("mode", [True, "log_dict", False])
def test_straggler_metrics_destination(tmp_path: Path, mode: Any):
    trainer, logged = _fit(tmp_path, mode)
    to_loggers = [m for m in logged if "straggler/step_ms_median" in m]
    in_callback_metrics = "straggler/step_ms_median" in trainer.callback_metrics
    if mode is True:
        assert to_loggers and not in_callback_metrics
        assert to_loggers[-1]["straggler/count"] == 0.0
    elif mode == "log_dict":  # log_dict reaches the loggers too, through Lightning
        assert in_callback_metrics and to_loggers
        assert float(trainer.callback_metrics["straggler/step_ms_median"]) > 0
    else:
        assert not to_loggers and not in_callback_metrics


def test_straggler_log_metrics_rejects_unknown_value():
    from trainguard.errors import ConfigError
    from trainguard.integrations.lightning import StragglerCallback

    with pytest.raises(ConfigError, match="log_metrics"):
        StragglerCallback(log_metrics="tensorboard")
