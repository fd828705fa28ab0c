"""Flight-recorder dumps for attribution: the ``_core.flight_recorder`` loader, with its errors
raised as :class:`~trainguard.attribution.errors.FlightRecorderError`."""

from __future__ import annotations

from trainguard._core import flight_recorder as _fr
from trainguard.attribution.errors import FlightRecorderError

__all__ = ["load_dump", "load_dumps"]


def load_dump(path: str) -> dict:
    """See :func:`trainguard._core.flight_recorder.load_dump`.

    Raises:
        FlightRecorderError: unreadable, too large, not a dump, or it asks for a global.
    """
    try:
        return _fr.load_dump(path)
    except _fr.FlightRecorderError as exc:
        raise FlightRecorderError(str(exc)) from None


def load_dumps(path: str, within: list[str] | None = None) -> dict[int, dict]:
    """See :func:`trainguard._core.flight_recorder.load_dumps`.

    Raises:
        FlightRecorderError: nothing found, a dump is unsafe/malformed, or the dumps disagree.
    """
    try:
        return _fr.load_dumps(path, within)
    except _fr.FlightRecorderError as exc:
        raise FlightRecorderError(str(exc)) from None
