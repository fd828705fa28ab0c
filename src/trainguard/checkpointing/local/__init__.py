"""Local (node-level) checkpoints with optional replication to peer ranks."""

from trainguard.checkpointing.local.manager import LocalCheckpointManager
from trainguard.checkpointing.local.replication import CliqueReplicationStrategy
from trainguard.checkpointing.local.tensor_aware import (
    BasicTensorAwareStateDict,
    TensorAwareStateDict,
    TensorPlaceholder,
)

__all__ = [
    "BasicTensorAwareStateDict",
    "CliqueReplicationStrategy",
    "LocalCheckpointManager",
    "TensorAwareStateDict",
    "TensorPlaceholder",
]
