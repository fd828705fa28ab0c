"""Deferred release of destroyed process groups: the mechanism lives in ``_core.pg_guard``
(the launcher's workers use it too); this module keeps the names the restart loop uses.

While a wrapped call runs, ``torch.distributed.destroy_process_group`` is wrapped (:func:`install`
/ :func:`uninstall`, nested with the launcher's worker guard); the restart loop calls
:func:`release` after its iteration barrier and at the end of the call, where the main thread has
blocked in store waits since and no collective callback can still be running.
"""

from __future__ import annotations

from trainguard._core.pg_guard import destroy_process_group, hold, install, release, uninstall

__all__ = ["destroy_process_group", "hold", "install", "release", "uninstall"]
