"""One queued asynchronous save (trainer side) and its lifecycle."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard._core.clock import Deadline

__all__ = ["SaveRequest", "SaveState"]


class SaveState(enum.Enum):
    """Lifecycle of one save on one rank.

    Legal transitions::

        WRITING ──► WRITTEN ──► COMMITTING ──► COMMITTED      (popped by finalize)
           │           │             └────────► FAILED
           └───────────┴──────────────────────► FAILED        (write error, dead/stuck writer,
                                                               a failure on another rank)
        SKIPPED                                               (terminal, never queued)

    * WRITING: staged; this rank's writer owes the reply for the file(s).
    * WRITTEN: this rank's files are durable (not yet committed).
    * COMMITTING: every rank wrote; rank 0's writer is writing the manifest and pruning.
    * COMMITTED / FAILED: the agreed outcome, the same on every rank.
    * SKIPPED: ``save(..., if_busy="skip")`` found the previous save still staging or writing
      on some rank; every rank skipped it, nothing was copied or written.
    """

    WRITING = "writing"
    WRITTEN = "written"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass
class SaveRequest:
    """One queued save; ``state`` follows :class:`SaveState`; finalize pops it."""

    id: int
    step: int | None
    kind: str
    rel_dir: str
    file: str
    storage_url: str
    collective: bool
    deadline: Deadline
    finalize_fns: list[Callable[[], None]] = field(default_factory=list)
    state: SaveState = SaveState.WRITING
    record: dict[str, Any] = field(default_factory=dict)
    extra: bytes | None = None
    stage_s: float = 0.0
    t_submit: float = 0.0
    durable_s: float | None = None  # submit -> committed on every rank (set by finalize)
    commit_pending: bool = False  # rank 0: the commit was sent to this rank's writer, no reply yet
    commit_record: dict[str, Any] = field(default_factory=dict)  # rank 0: the writer's commit reply
