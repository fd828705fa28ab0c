"""Errors of :mod:`trainguard.checkpointing`.

::

    CheckpointError
     ├── CheckpointWriteError            a save failed on >= 1 rank; the previous checkpoint
     │                                   is intact
     │    └── CheckpointWorkerError      the async worker died or got stuck (rank, pid, phase)
     ├── CheckpointTimeout (+TimeoutError)  a bounded checkpoint wait ran out
     ├── CheckpointNotFoundError         no committed (and valid) checkpoint exists
     ├── CorruptCheckpointError          checksum, size or manifest mismatch (names the file)
     ├── CheckpointMismatchError (+ConfigError)  e.g. written with a different world size
     ├── StateDictError (+ConfigError)   a state value cannot be saved (names the key)
     └── NoReplicasAvailableError        a lost rank's local shard has no replica
"""

from __future__ import annotations

from trainguard.errors import ConfigError, TrainguardError, TrainguardTimeout

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTimeout",
    "CheckpointWorkerError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "NoReplicasAvailableError",
    "StateDictError",
]


class CheckpointError(TrainguardError):
    """Base class of every checkpointing error."""


class CheckpointWriteError(CheckpointError):
    """A save failed; ``failures`` maps global rank -> error text (empty if unknown).

    Raised on every rank of the save, so all ranks take the same decision. The previous committed
    checkpoint is untouched and the next save may proceed.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class CheckpointWorkerError(CheckpointWriteError):
    """The background writer process died or exceeded its write timeout."""


class CheckpointTimeout(CheckpointError, TrainguardTimeout):
    """A bounded checkpoint wait (write, finalize, collective) ran out."""


class CheckpointNotFoundError(CheckpointError):
    """No committed, valid checkpoint was found."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file does not match its manifest (size/checksum) or the manifest is invalid."""


class CheckpointMismatchError(CheckpointError, ConfigError):
    """The checkpoint does not fit this job (world size, format, rank)."""


class StateDictError(CheckpointError, ConfigError):
    """A state value cannot be checkpointed (e.g. not picklable); the message names its key."""


class NoReplicasAvailableError(CheckpointError):
    """A rank's local shard is missing and no clique peer holds a replica."""
