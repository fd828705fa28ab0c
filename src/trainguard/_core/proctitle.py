"""Process titles: what ``ps``, ``top`` and ``psutil.Process(pid).cmdline()`` show for a
trainguard child process, so a monitor, a checkpoint writer and the trainer they serve can be
told apart.

Titles read ``trainguard: rank R <role>`` (``trainguard: rank 1 monitor``, ``trainguard: rank 0
ckpt writer``); launcher workers keep ``trainguard worker rank R (local L) : python SCRIPT ARGS``.

With the ``setproctitle`` package the whole command line is replaced; without it (it is a
dependency, but an import can still fail) only the 15-byte thread name (``ps -o comm``, ``top``,
``psutil.Process.name()``) is set, to ``short`` when given; elsewhere than Linux nothing changes.
Never raises, never blocks.

Follows: PostgreSQL / ``setproctitle``'s own convention of naming the role in the title.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable

__all__ = ["prepare_title", "set_title"]

_setproctitle: Callable[[str], None] | None
_getproctitle: Callable[[], str] | None
try:
    from setproctitle import getproctitle as _getproctitle
    from setproctitle import setproctitle as _setproctitle
except ImportError:  # optional at run time: only the thread name is set then
    _setproctitle = _getproctitle = None

_PR_SET_NAME = 15


def set_title(title: str, short: str | None = None) -> None:
    """Set this process's title to ``title`` (best effort, never raises).

    Args:
        title: the whole title, e.g. ``trainguard: rank 0 ckpt writer``.
        short: the thread name to set when ``setproctitle`` is unavailable (cut to 15 bytes);
            None leaves the thread name as it is then.
    """
    if _setproctitle is not None:
        # a title is cosmetic: never fail the process for it
        with contextlib.suppress(Exception):
            _setproctitle(title)
        return
    if short is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, short.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def prepare_title() -> None:
    """Let ``setproctitle`` find this process's argv area now. Call it before forking a child
    that replaces its C ``environ`` (``os.environ.clear()``, as the launcher's fork server does):
    ``setproctitle`` walks there from ``environ`` on first use, and afterwards silently does
    nothing."""
    if _getproctitle is not None:
        with contextlib.suppress(Exception):  # cosmetic, as above
            _getproctitle()
