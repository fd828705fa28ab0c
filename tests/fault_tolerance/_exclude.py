"""What the fault-tolerance test workers share: asking the launcher to exclude this node.

Imported by ``mn_worker.py`` and ``netns_worker.py`` (run as scripts, so this folder is on
``sys.path``).
"""

from __future__ import annotations

import time


def ask_exclusion(reason: str) -> int:
    """Send ``WorkloadAction.ExcludeThisNode`` with ``reason`` to the rank monitor, give it 0.5 s
    to reach the launcher, and return the exit code the worker should exit with (3)."""
    from trainguard.fault_tolerance import (
        RankMonitorClient,
        WorkloadAction,
        WorkloadControlRequest,
    )

    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.send_workload_control_request(
        WorkloadControlRequest(WorkloadAction.ExcludeThisNode, reason))
    time.sleep(0.5)
    return 3
