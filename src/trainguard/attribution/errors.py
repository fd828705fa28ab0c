"""Errors of the attribution capability.

::

    TrainguardError
     └── AttributionError                 invalid registry, analysis failure
          ├── LogInputError (+ValueError)  empty, binary or unreadable log
          ├── FlightRecorderError          unsafe, malformed or inconsistent dumps
          └── ServiceError                 attribution service/client failure (carries status)
"""

from __future__ import annotations

from trainguard.errors import TrainguardError

__all__ = ["AttributionError", "FlightRecorderError", "LogInputError", "ServiceError"]


class AttributionError(TrainguardError):
    """Base class of attribution errors."""


class LogInputError(AttributionError, ValueError):
    """A log cannot be analysed (missing, empty, binary); the message says which file and why."""


class FlightRecorderError(AttributionError, ValueError):
    """A flight-recorder dump is unsafe, malformed, or inconsistent with its siblings."""


class ServiceError(AttributionError):
    """The attribution service answered with an error; ``status`` is the HTTP status (0: none)."""

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
