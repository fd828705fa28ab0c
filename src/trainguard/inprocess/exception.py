"""NVRx module path ``inprocess.exception``: the in-process restart exceptions.

The same classes as :mod:`trainguard.inprocess.exceptions`. ``TimeoutError`` is NVRx's name for
a restart-machinery timeout; here it is :class:`RestartTimeout` (which is also a builtin
``TimeoutError``), so ``except TimeoutError`` catches it either way and no builtin is shadowed
in trainguard's own modules.

Follows: NVRx ``inprocess.exception``.
"""

from trainguard.inprocess.exceptions import (
    BarrierError,
    BarrierOverflow,
    BarrierTimeout,
    FaultCounterExceeded,
    HealthCheckError,
    InternalError,
    RankDiscarded,
    RankShouldRestart,
    RestartAbort,
    RestartError,
    RestartTimeout,
)

TimeoutError = RestartTimeout  # NVRx's public name: an alias, not a new class

__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FaultCounterExceeded",
    "HealthCheckError",
    "InternalError",
    "RankDiscarded",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RestartTimeout",
    "TimeoutError",
]
