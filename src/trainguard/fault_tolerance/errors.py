"""Errors of the launcher and the rank monitors.

::

    TrainguardError
     └── LauncherError                      launcher / rank-monitor failures
          ├── LaunchConfigError (+ConfigError, ValueError)  bad flags, YAML, timeouts, ports
          ├── MonitorUnavailableError       no rank monitor to talk to (not under the launcher)
          └── MonitorTimeout (+TrainguardTimeout)  a monitor request got no answer in time
"""

from __future__ import annotations

from trainguard.errors import ConfigError, TrainguardError, TrainguardTimeout

__all__ = [
    "EXIT_STORE_LOST",
    "EXIT_UNHEALTHY",
    "LaunchConfigError",
    "LauncherError",
    "MonitorTimeout",
    "MonitorUnavailableError",
]

# Launcher exit codes beyond 0 (done), 1 (failed, restarts used up), 2 (bad input) and 93
# (--ft-no-restart-exit-code, do not requeue); the full contract is in ``launcher``'s docstring
# and checked against examples/slurm and examples/kubernetes by tests/fault_tolerance.
EXIT_STORE_LOST = 75  # EX_TEMPFAIL: lost the store (lease lapsed), self-fenced; requeue ok
EXIT_UNHEALTHY = 95  # this node failed its pre-cycle health checks: requeue ok (another node)


class LauncherError(TrainguardError):
    """Base of every error raised by ``trainguard.fault_tolerance``."""


class LaunchConfigError(LauncherError, ConfigError):
    """Invalid launcher input; the message says what is wrong and how to fix it."""


class MonitorUnavailableError(LauncherError):
    """The rank monitor cannot be reached (the process was not started by ``trainguard launch``,
    or the launcher is gone)."""


class MonitorTimeout(LauncherError, TrainguardTimeout):
    """A request to the rank monitor was not answered within its timeout."""
