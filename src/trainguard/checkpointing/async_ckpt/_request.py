"""One queued asynchronous save (trainer side)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard._core.clock import Deadline

__all__ = ["SaveRequest"]


@dataclass
class SaveRequest:
    """One queued save. ``state`` goes writing -> written|failed; finalize pops it."""

    id: int
    step: int | None
    kind: str
    rel_dir: str
    file: str
    storage_url: str
    collective: bool
    deadline: Deadline
    finalize_fns: list[Callable[[], None]] = field(default_factory=list)
    state: str = "writing"
    record: dict[str, Any] = field(default_factory=dict)
    extra: bytes | None = None
    stage_s: float = 0.0
    t_submit: float = 0.0
    durable_s: float | None = None  # submit -> committed on every rank (set by finalize)
