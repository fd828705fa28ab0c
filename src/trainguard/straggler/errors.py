"""Errors of :mod:`trainguard.straggler`.

::

    TrainguardError
     └── StragglerError                 misuse of the detector (not initialized, initialized twice)
          └── StragglerConfigError (+ ConfigError, ValueError)   bad argument; says how to fix it
"""

from __future__ import annotations

from trainguard.errors import ConfigError, TrainguardError

__all__ = ["StragglerConfigError", "StragglerError"]


class StragglerError(TrainguardError):
    """Base of every straggler-detection error."""


class StragglerConfigError(StragglerError, ConfigError):
    """An invalid argument to the detector; the message names it and how to fix it."""
