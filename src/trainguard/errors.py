"""Root of trainguard's exception tree.

::

    TrainguardError
     ├── TrainguardTimeout (+ builtin TimeoutError)   every timeout (``except TimeoutError``)
     ├── ConfigError (+ builtin ValueError)           bad input / invalid configuration
     └── <one base per capability>                    RestartError, CheckpointError, ...
"""

from __future__ import annotations

__all__ = ["ConfigError", "TrainguardError", "TrainguardTimeout"]


class TrainguardError(Exception):
    """Base class of every error raised by trainguard."""


class TrainguardTimeout(TrainguardError, TimeoutError):
    """A bounded wait ran out. Messages state what was awaited, the elapsed time and the limit."""


class ConfigError(TrainguardError, ValueError):
    """Invalid configuration or argument; the message says what is wrong and how to fix it."""
