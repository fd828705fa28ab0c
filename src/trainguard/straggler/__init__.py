"""Straggler detection: find the slow rank, say why (kind) and what it costs.

Public surface (NVRx-compatible names first): :class:`Detector`, :class:`CallableId`,
:class:`Report`, :class:`StragglerId`, plus :class:`StragglerInfo`, :class:`ScoringConfig`,
:class:`Actions`, the transport interface and errors. See ``trainguard straggler report RUN_DIR``
for the offline view.

The names that need ``torch`` (the detector and the transports) load on first use, so scoring
(:class:`Scorer`, used by ``trainguard launch`` on summaries it reads from its slots) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainguard.straggler._actions import Actions
from trainguard.straggler.errors import StragglerConfigError, StragglerError
from trainguard.straggler.report import KINDS, Report, StragglerId, StragglerInfo
from trainguard.straggler.scores import Scorer, ScoringConfig

if TYPE_CHECKING:
    from trainguard.straggler._transport import (
        MemoryTransport,
        SlotTransport,
        StoreTransport,
        SummaryTransport,
    )
    from trainguard.straggler.detector import CallableId, Detector

__all__ = [
    "Actions",
    "CallableId",
    "Detector",
    "KINDS",
    "MemoryTransport",
    "Report",
    "Scorer",
    "ScoringConfig",
    "SlotTransport",
    "StoreTransport",
    "StragglerConfigError",
    "StragglerError",
    "StragglerId",
    "StragglerInfo",
    "SummaryTransport",
]

_LAZY = {
    "CallableId": "trainguard.straggler.detector",
    "Detector": "trainguard.straggler.detector",
    "MemoryTransport": "trainguard.straggler._transport",
    "SlotTransport": "trainguard.straggler._transport",
    "StoreTransport": "trainguard.straggler._transport",
    "SummaryTransport": "trainguard.straggler._transport",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainguard.straggler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
