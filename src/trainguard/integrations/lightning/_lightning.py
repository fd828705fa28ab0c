"""trainguard's Lightning callbacks and checkpoint plugin for the ``lightning`` namespace.

Plugins must match the Trainer's namespace (``lightning.Trainer`` rejects a ``pytorch_lightning``
or ``lightning_fabric`` CheckpointIO and vice versa), so each namespace has its own module:
``from trainguard.integrations.lightning import ...`` (this one) for ``lightning.Trainer``,
``trainguard.integrations.lightning.pl`` for ``pytorch_lightning.Trainer``.
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.plugins import CheckpointIO

from trainguard.integrations.lightning._ckpt_io import CheckpointIOLogic
from trainguard.integrations.lightning._ft import FaultToleranceLogic
from trainguard.integrations.lightning._preempt import PreemptionLogic
from trainguard.integrations.lightning._sharded import ShardedCheckpointLogic
from trainguard.integrations.lightning._straggler import StragglerLogic

__all__ = [
    "FaultToleranceCallback",
    "PreemptionCallback",
    "ShardedCheckpointCallback",
    "StragglerCallback",
    "TrainguardCheckpointIO",
]


class FaultToleranceCallback(FaultToleranceLogic, Callback):
    """Heartbeats, sections and calculated timeouts (see :class:`FaultToleranceLogic`)."""


class StragglerCallback(StragglerLogic, Callback):
    """Straggler detection on public hooks (see :class:`StragglerLogic`)."""


class PreemptionCallback(PreemptionLogic, Callback):
    """SIGTERM stops every rank at the same step and saves (see :class:`PreemptionLogic`)."""


class ShardedCheckpointCallback(ShardedCheckpointLogic, Callback):
    """Per-rank / DCP checkpoints on every rank (see :class:`ShardedCheckpointLogic`)."""


class TrainguardCheckpointIO(CheckpointIOLogic, CheckpointIO):
    """Asynchronous committed checkpoints (see :class:`CheckpointIOLogic`)."""
