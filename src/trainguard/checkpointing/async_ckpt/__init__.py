"""Asynchronous checkpointing: a persistent writer process per rank, staged true snapshots.

``AsyncCheckpointer.save`` (step checkpoints, torch or DCP format, collective commit) and
``AsyncCheckpointer.async_save`` (``torch.save``-style per-rank files).
"""

from trainguard.checkpointing.async_ckpt._checkpointer import (
    AsyncCheckpointer,
    SaveRequest,
    SaveState,
    abort_all_checkpointers,
)
from trainguard.checkpointing.async_ckpt._pool import prewarm_writers

__all__ = ["AsyncCheckpointer", "SaveRequest", "SaveState", "abort_all_checkpointers",
           "prewarm_writers"]
