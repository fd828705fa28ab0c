"""Orphan sweeper: outlives the launcher by design and kills the job's processes when it dies.

Started by the launcher in its own session (so terminal signals do not reach it), holding the
read end of a pipe whose only write end the launcher holds. When the launcher exits for any reason
(SIGKILL included) the pipe reads EOF, and the sweeper SIGKILLs every process whose environment
carries the job's marker ``TRAINGUARD_LAUNCH_ID=<id>`` - workers, monitors, the fork server and
descendants that called ``setsid`` or double-forked (they keep the environment) - repeating for a
short while to catch processes forked meanwhile, removes the job's shared-memory slots and monitor
sockets, then exits. ``PR_SET_PDEATHSIG`` kills direct
children at once; this covers the rest within ~0.1 s (launcher-research.md A8).
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["ENV_MARKER", "marked_pids", "sweep"]

ENV_MARKER = "TRAINGUARD_LAUNCH_ID"


def marked_pids(launch_id: str) -> list[int]:
    """Pids of live processes whose environment holds ``TRAINGUARD_LAUNCH_ID=<launch_id>``."""
    needle = f"{ENV_MARKER}={launch_id}".encode()
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry))
    return out


def sweep(launch_id: str, duration_s: float = 0.3) -> list[int]:
    """SIGCONT+SIGKILL every marked process, repeatedly for ``duration_s``; returns pids hit."""
    hit: set[int] = set()
    end = time.monotonic() + duration_s
    while True:
        pids = marked_pids(launch_id)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                hit.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() >= end:
            return sorted(hit)
        time.sleep(0.02)


def _remove_files(shm_prefix: str, socket_prefix: str) -> None:
    """The job's shared-memory slots and monitor sockets (the launcher could not remove them)."""
    from trainguard._core.shm import sweep_prefix

    if shm_prefix:
        sweep_prefix(shm_prefix)
    if socket_prefix:
        folder, base = os.path.split(socket_prefix)
        try:
            names = [n for n in os.listdir(folder) if n.startswith(base)]
        except OSError:
            names = []
        for name in names:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def main() -> None:
    launch_id, fd = sys.argv[1], int(sys.argv[2])
    shm_prefix, socket_prefix = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else ("", "")
    from trainguard._core.proctitle import set_title

    set_title(f"trainguard: launcher sweeper (launch {launch_id})", "tg-sweeper")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:
        try:
            if not os.read(fd, 64):
                break  # EOF: the launcher exited
        except InterruptedError:
            continue
        except OSError:
            break
    sweep(launch_id)
    _remove_files(shm_prefix, socket_prefix)


if __name__ == "__main__":
    main()
