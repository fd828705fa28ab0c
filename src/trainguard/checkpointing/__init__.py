"""Checkpointing: asynchronous never-torn saves, local checkpoints with replication, storage.

* :class:`AsyncCheckpointer` - stage (memcpy into reused shm) then write in a persistent per-rank
  process; collective commit with checksums and a manifest written last.
* :class:`CheckpointManager` - layout, commit marker, verification, retention over a storage.
* :class:`LocalCheckpointManager` - node-local checkpoints, replicated to clique peers.
* :func:`latest` - the newest committed checkpoint of a directory (``Trainer.fit(ckpt_path=)``).
* :func:`storage_for` - local filesystem (default) or any fsspec URL.
"""

from trainguard.checkpointing._latest import commit_file, latest
from trainguard.checkpointing.async_ckpt import (
    AsyncCheckpointer,
    SaveRequest,
    SaveState,
    abort_all_checkpointers,
    prewarm_writers,
)
from trainguard.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTimeout,
    CheckpointWorkerError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NoReplicasAvailableError,
    StateDictError,
)
from trainguard.checkpointing.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
    TensorAwareStateDict,
)
from trainguard.checkpointing.manager import CheckpointManager
from trainguard.checkpointing.storage import FsspecStorage, LocalStorage, Storage, storage_for

__all__ = [
    "AsyncCheckpointer",
    "BasicTensorAwareStateDict",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTimeout",
    "CheckpointWorkerError",
    "CheckpointWriteError",
    "CliqueReplicationStrategy",
    "CorruptCheckpointError",
    "FsspecStorage",
    "LocalCheckpointManager",
    "LocalStorage",
    "NoReplicasAvailableError",
    "SaveRequest",
    "SaveState",
    "StateDictError",
    "Storage",
    "TensorAwareStateDict",
    "abort_all_checkpointers",
    "commit_file",
    "latest",
    "prewarm_writers",
    "storage_for",
]
