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

__all__ = ["LaunchConfigError", "LauncherError", "MonitorTimeout", "MonitorUnavailableError"]


class LauncherError(TrainguardError):
    """Base of every error raised by ``trainguard.fault_tolerance``."""


class LaunchConfigError(LauncherError, ConfigError):
    """Invalid launcher input; the message says what is wrong and how to fix it."""


class MonitorUnavailableError(LauncherError):
    """The rank monitor cannot be reached (the process was not started by ``trainguard launch``,
    or the launcher is gone)."""


class MonitorTimeout(LauncherError, TrainguardTimeout):
    """A request to the rank monitor was not answered within its timeout."""
