"""Straggler detection: find the slow rank, say why (kind) and what it costs.

Public surface (NVRx-compatible names first): :class:`Detector`, :class:`CallableId`,
:class:`Report`, :class:`StragglerId`, plus :class:`StragglerInfo`, :class:`ScoringConfig`,
:class:`Actions`, the transport interface and errors. See ``trainguard straggler report RUN_DIR``
for the offline view.
"""

from trainguard.straggler._actions import Actions
from trainguard.straggler._transport import MemoryTransport, StoreTransport, SummaryTransport
from trainguard.straggler.detector import CallableId, Detector
from trainguard.straggler.errors import StragglerConfigError, StragglerError
from trainguard.straggler.report import KINDS, Report, StragglerId, StragglerInfo
from trainguard.straggler.scores import Scorer, ScoringConfig

__all__ = [
    "Actions",
    "CallableId",
    "Detector",
    "KINDS",
    "MemoryTransport",
    "Report",
    "Scorer",
    "ScoringConfig",
    "StoreTransport",
    "StragglerConfigError",
    "StragglerError",
    "StragglerId",
    "StragglerInfo",
    "SummaryTransport",
]
