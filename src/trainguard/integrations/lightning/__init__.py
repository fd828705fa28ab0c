"""Lightning integration: every trainguard capability as callbacks and a checkpoint plugin.

Install with ``pip install 'trainguard[lightning]'``. For ``lightning.Trainer``::

    from trainguard.checkpointing import latest
    from trainguard.integrations.lightning import (
        FaultToleranceCallback, PreemptionCallback, StragglerCallback, TrainguardCheckpointIO)

    trainer = lightning.Trainer(
        callbacks=[FaultToleranceCallback(), StragglerCallback(), PreemptionCallback(),
                   ModelCheckpoint(dirpath="ckpt", save_top_k=1, every_n_train_steps=50)],
        plugins=[TrainguardCheckpointIO()], accelerator="cpu", devices=2, strategy="ddp")
    trainer.fit(model, ckpt_path=latest("ckpt"))   # run with: trainguard launch --nproc-per-node 2

For ``pytorch_lightning.Trainer`` import the same names from
:mod:`trainguard.integrations.lightning.pl` (plugins must match the Trainer's namespace).

The names are resolved lazily: importing this package does not import Lightning; the first
attribute access imports ``lightning`` (about 5 s).

* :class:`FaultToleranceCallback` - rank-monitor heartbeats, sections, calculated timeouts kept in
  the checkpoint (run under ``trainguard launch``).
* :class:`StragglerCallback` - straggler detection on public hooks, metrics, optional stop.
* :class:`PreemptionCallback` - SIGTERM: every rank stops at the same step, saves, exits.
* :class:`TrainguardCheckpointIO` - asynchronous never-torn committed saves (single device, DDP).
* :class:`ShardedCheckpointCallback` - per-rank or DCP saves on every rank (FSDP, ModelParallel).

In-process restart recipe: ``docs/lightning.md`` (``Trainer.fit`` inside ``inprocess.Wrapper``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FaultToleranceCallback",
    "PreemptionCallback",
    "ShardedCheckpointCallback",
    "StragglerCallback",
    "TrainguardCheckpointIO",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module("trainguard.integrations.lightning._lightning")
    except ImportError as exc:
        raise ImportError(f"trainguard.integrations.lightning.{name} needs Lightning: pip install "
                          f"'trainguard[lightning]' ({exc})") from exc
    return getattr(module, name)
